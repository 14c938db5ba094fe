"""SCAFFOLD in whole runs: the variates' invariant, their bytes on the wire, determinism and bad input."""

from __future__ import annotations

import pytest
import torch

import flasync
from flasync.core.errors import ConfigError
from flasync.runtime import checkpoint
from flasync.testing import MemoryTracker, small_config

pytestmark = pytest.mark.timeout(60)

SERVERS = {
    "fedbuff": {"kind": "fedbuff", "buffer_size": 4, "concurrency": 8},
    "fedavg": {"kind": "fedavg", "clients_per_round": 5},
}


@pytest.mark.parametrize("server", sorted(SERVERS))
@pytest.mark.slow
def test_the_server_variate_is_the_mean_of_the_client_variates(server: str) -> None:
    """In a checkpoint taken mid-run, c plus its pending changes over N equals the mean of all N clients' c_i."""
    config = small_config(
        "scaffold.enabled=true", "stop.max_versions=9", "checkpoint.every_versions=4", server=SERVERS[server]
    )
    tracker = MemoryTracker()
    flasync.run(config, tracker=tracker)
    _, state = checkpoint.decode(checkpoint.latest(tracker.artifacts))
    n = config.population.num_clients
    controls, variates = state["controls"], state["variates"]
    assert len(variates["ids"]) > 0
    mean = torch.zeros_like(controls["value"])
    for row in variates["values"]:
        mean += row / n
    torch.testing.assert_close(controls["value"] + controls["pending"] / n, mean, rtol=1e-4, atol=1e-6)
    assert float(controls["value"].abs().sum()) > 0


@pytest.mark.slow
def test_variates_count_on_the_wire_and_the_run_is_deterministic() -> None:
    """Uploads carry the delta and Delta c_i, downloads the model and c: twice the dense bytes; same seed, same sha."""
    config = small_config("scaffold.enabled=true")
    first, second = flasync.run(config), flasync.run(config)
    assert first.weights_sha256 == second.weights_sha256
    assert first.upload_compression == pytest.approx(0.5)
    plain = flasync.run(small_config())
    assert plain.weights_sha256 != first.weights_sha256
    assert first.download_bytes / first.tasks_dispatched == pytest.approx(
        2 * plain.download_bytes / plain.tasks_dispatched
    )


@pytest.mark.slow
def test_variates_go_through_a_lossy_codec_and_training_still_improves() -> None:
    """With top-k uploads and int8 downloads the variates are compressed too, and the run still learns."""
    config = small_config(
        "scaffold.enabled=true",
        "codec.upload=[{kind: topk, ratio: 0.1}]",
        "codec.download=[{kind: int8}]",
        "stop.max_versions=20",
    )
    summary = flasync.run(config)
    assert summary.upload_compression > 2
    assert summary.accuracy > 0.5


@pytest.mark.parametrize(
    "overrides",
    [
        ("scaffold.enabled=true", "server={kind: fedasync}"),
        ("scaffold.enabled=true", "topology={kind: tree, fanout: [2]}"),
        ("scaffold.enabled=true", "privacy.enabled=true", "privacy.noise_multiplier=1"),
    ],
    ids=["fedasync", "tree", "privacy"],
)
def test_unsupported_combinations_are_one_line_errors(overrides: tuple[str, ...]) -> None:
    """SCAFFOLD with FedAsync, a tree or differential privacy is refused naming scaffold.enabled."""
    with pytest.raises(ConfigError, match=r"^scaffold\.enabled: ") as info:
        small_config(*overrides)
    assert "\n" not in str(info.value)
