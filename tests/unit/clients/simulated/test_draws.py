"""Per-client draws held whole or a block at a time give the same values."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from flasync.clients.simulated._draws import EAGER_UP_TO, DrawnColumn
from flasync.clients.simulated.population import Network
from flasync.config import NetworkConfig
from flasync.core import seeding


def _normal(g: np.random.Generator, m: int) -> np.ndarray:
    return g.normal(0.0, 0.5, m)


def _scaled(z: np.ndarray) -> np.ndarray:
    return 0.1 * np.exp(z)


def _phase(g: np.random.Generator, m: int) -> np.ndarray:
    return g.random(m, dtype=np.float32)


@pytest.mark.parametrize("draw", [_normal, _phase])
def test_blocks_drawn_again_equal_one_draw_of_everything(
    draw: Callable[[np.random.Generator, int], np.ndarray],
) -> None:
    """Columns built block by block (normal draws, and float32 draws that buffer half-words) read back bit-exactly
    the values one call draws, by client and by array, and leave the generator where one call would."""
    n = 1003
    whole = np.random.default_rng(3)
    first, second = _scaled(draw(whole, n)), _scaled(draw(whole, n))
    blocks = np.random.default_rng(3)
    one = DrawnColumn(blocks, n, draw, _scaled, eager_up_to=10, block=33)
    two = DrawnColumn(blocks, n, draw, _scaled, eager_up_to=10, block=33)
    assert np.array_equal(np.asarray(one), first) and np.array_equal(np.asarray(two), second)
    ids = np.random.default_rng(1).integers(n, size=300)
    assert np.array_equal(one[ids], first[ids])
    assert all(one[client] == first[client] for client in ids.tolist())
    assert blocks.random() == whole.random()


def test_a_large_column_holds_a_few_bytes_per_block() -> None:
    """A column of a million clients holds block states and a few drawn blocks, not a value per client."""
    column = DrawnColumn(np.random.default_rng(0), 1_000_000, _normal, _scaled)
    column[np.arange(0, 1_000_000, 997)]
    assert column.nbytes < 1_000_000


def test_clients_out_of_range_are_refused() -> None:
    """A client id outside the column is an IndexError, one by one or in an array."""
    column = DrawnColumn(np.random.default_rng(0), 100, _normal, _scaled, eager_up_to=0, block=8)
    with pytest.raises(IndexError):
        column[100]
    with pytest.raises(IndexError):
        column[np.array([5, -1])]


def test_a_large_network_has_the_links_one_draw_gives() -> None:
    """Links of a population past the eager size equal the latencies and bandwidths drawn in one call each."""
    config = NetworkConfig(latency_sigma=0.5, bandwidth_sigma=0.5)
    n = EAGER_UP_TO + 5
    network = Network(config, n, 7)
    rng = seeding.numpy_stream(7, seeding.NETWORK)
    latency = config.latency_s * np.exp(rng.normal(0.0, config.latency_sigma, n))
    spread = np.exp(rng.normal(0.0, config.bandwidth_sigma, (2, n)))
    ids = [0, 1, n // 2, n - 1]
    assert [network.upload_seconds(c, 1000) for c in ids] == [
        float(latency[c] + 1000 / (config.upload_bytes_per_s * spread[0][c])) for c in ids
    ]
    assert [network.download_seconds(c, 1000) for c in ids] == [
        float(latency[c] + 1000 / (config.download_bytes_per_s * spread[1][c])) for c in ids
    ]


@pytest.mark.parametrize("eager_up_to", [10, EAGER_UP_TO])
def test_item_reads_a_clients_value_as_the_python_float_indexing_gives(eager_up_to: int) -> None:
    """``item`` gives each client's value as a Python float equal to indexing's, for a column held whole or drawn
    block by block."""
    column = DrawnColumn(np.random.default_rng(8), 500, _normal, _scaled, eager_up_to=eager_up_to, block=33)
    item = column.item
    for client in np.random.default_rng(2).integers(500, size=100).tolist():
        value = item(client)
        assert type(value) is float and value == float(column[client])
