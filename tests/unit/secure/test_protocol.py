"""Tests of one SecAgg+ group end to end (flasync.secure.protocol, server, group): sums, dropouts, what leaks."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flasync.secure.group import Phase, WeightedEncoding, run_group
from flasync.secure.keys import SeededRandom
from flasync.secure.messages import UnmaskRequest, UnmaskResponse
from flasync.secure.protocol import GroupParams, ProtocolAbort, SecAggClient, neighbour_graph
from flasync.secure.ring import RingVector, ring_sum
from flasync.secure.server import SecAggServer
from flasync.secure.shamir import PRIME

_CHI2_DF15_P999 = 37.697  # the 0.999 quantile of chi-square with 15 degrees of freedom


def _group(n: int, *, bits: int = 32, length: int = 50, threshold: int = 3, degree: int | None = None) -> GroupParams:
    ids = list(range(10, 10 + n))
    order = list(np.random.default_rng(n).permutation(n))
    return GroupParams(b"g", bits, length, threshold, neighbour_graph(ids, degree, order))


def _inputs(params: GroupParams, seed: int = 0) -> dict[int, RingVector]:
    rng = np.random.default_rng(seed)
    top = 1 << (params.bits - 8)  # small values: any group's sum is far from wrapping
    return {u: rng.integers(0, top, params.length, dtype=np.uint64) for u in params.neighbours}


def _rngs(params: GroupParams, seed: int = 1) -> dict[int, SeededRandom]:
    return {u: SeededRandom((seed, u)) for u in params.neighbours}


def test_unmasked_sum_is_the_plain_sum_exactly_in_the_ring() -> None:
    """With no dropout, the server's result equals the sum of the inputs in Z_{2^bits}, bit for bit."""
    params = _group(8, degree=4)
    inputs = _inputs(params)
    result = run_group(params, inputs, _rngs(params))
    assert result.outcome is not None
    assert np.array_equal(result.outcome.total, ring_sum(list(inputs.values()), params.bits))


@pytest.mark.parametrize(
    "drops",
    [
        {11: Phase.ADVERTISE, 12: Phase.SHARE},
        {11: Phase.MASK, 14: Phase.MASK},
        {13: Phase.UNMASK, 15: Phase.UNMASK},
        {10: Phase.SHARE, 12: Phase.MASK, 16: Phase.UNMASK},
    ],
)
def test_dropouts_up_to_the_tolerance_are_recovered(drops: Mapping[int, Phase]) -> None:
    """Up to degree - threshold dropouts at any round are recovered: the result is the exact sum of what arrived."""
    params = _group(10, threshold=4, degree=8)
    inputs = _inputs(params)
    result = run_group(params, inputs, _rngs(params), drops=drops)
    assert result.outcome is not None, result.reason
    arrived = [u for u in inputs if drops.get(u, Phase.UNMASK + 1) > Phase.MASK]
    assert sorted(result.outcome.survivors) == arrived
    assert np.array_equal(result.outcome.total, ring_sum([inputs[u] for u in arrived], params.bits))
    assert result.outcome.recovered == {u for u, p in drops.items() if p == Phase.MASK}


def test_more_dropouts_than_tolerated_abandon_the_group() -> None:
    """When fewer than threshold clients are left to answer, the group ends without a result and says why."""
    params = _group(6, threshold=4)
    drops = {10: Phase.UNMASK, 11: Phase.UNMASK, 12: Phase.UNMASK}
    result = run_group(params, _inputs(params), _rngs(params), drops=drops)
    assert result.outcome is None
    assert "fewer than the threshold" in result.reason


def test_weighted_encoding_gives_the_weighted_sum_within_quantization() -> None:
    """Client-side weights before masking: the unmasked sum is sum w_u delta_u and sum w_u, within the step."""
    n, num_params = 6, 30
    encoding = WeightedEncoding.create(32, 2.0, n)
    ids = list(range(n))
    params = GroupParams(b"w", 32, encoding.length(num_params), 3, neighbour_graph(ids, None, ids))
    generator = torch.Generator().manual_seed(0)
    deltas = {u: torch.randn(num_params, generator=generator) for u in ids}
    weights = {u: (u + 1) / n for u in ids}
    inputs = {u: encoding.encode(deltas[u], weights[u]) for u in ids}
    result = run_group(params, inputs, _rngs(params))
    assert result.outcome is not None
    weighted, total_weight = encoding.decode(result.outcome.total)
    expected = sum((weights[u] * deltas[u].double()).clamp(-2.0, 2.0) for u in ids)
    assert isinstance(expected, torch.Tensor)
    assert (weighted - expected).abs().max().item() <= n * encoding.values.step
    assert total_weight == pytest.approx(sum(weights.values()), abs=n * encoding.weights.step)


def _chi_square_nibbles(vector: RingVector, bits: int) -> float:
    """Return the larger chi-square statistic of the top and bottom 4 bits' counts against uniform."""
    statistics = []
    for shift in (0, bits - 4):
        counts = np.bincount(((vector >> np.uint64(shift)) & np.uint64(15)).astype(np.int64), minlength=16)
        expected = vector.size / 16
        statistics.append(float(((counts - expected) ** 2 / expected).sum()))
    return max(statistics)


def test_every_masked_input_the_server_receives_looks_uniform_in_the_ring() -> None:
    """An instrumented intake: each received vector passes a chi-square test of uniformity, its plain input fails."""
    params = _group(5, bits=16, length=8000, threshold=3)
    inputs = {u: np.full(params.length, 7 * u, dtype=np.uint64) for u in params.neighbours}  # far from uniform
    received: dict[int, RingVector] = {}
    result = run_group(params, inputs, _rngs(params, 9), observe=lambda u, v: received.__setitem__(u, v))
    assert result.outcome is not None
    assert sorted(received) == sorted(inputs)
    for u, vector in received.items():
        assert _chi_square_nibbles(vector, params.bits) < _CHI2_DF15_P999
        assert _chi_square_nibbles(inputs[u], params.bits) > _CHI2_DF15_P999


def test_server_never_holds_seed_and_key_shares_of_one_client() -> None:
    """Round 3 gives the server a client's seed shares or its key shares, never both, and refuses a forged request."""
    params = _group(6, threshold=3)
    clients = {u: SecAggClient(u, params, SeededRandom(u)) for u in params.neighbours}
    server = SecAggServer(params)
    broadcasts = server.broadcast_keys({u: c.advertise() for u, c in clients.items()})
    inboxes = server.relay_shares({u: c.share(broadcasts[u]) for u, c in clients.items()})
    for u, client in clients.items():
        client.receive_shares(inboxes[u])
    masked = {u: c.mask(_inputs(params)[u]) for u, c in clients.items() if u != 12}
    request = server.collect(masked)
    responses = [clients[u].unmask(request) for u in sorted(request.survivors)]
    seeds = {u for r in responses for u in r.seed_shares}
    keys = {u for r in responses for u in r.key_shares}
    assert keys == {12} and not seeds & keys
    forged = UnmaskRequest(frozenset(params.neighbours), frozenset({12}))
    with pytest.raises(ProtocolAbort, match="both"):
        SecAggClient(10, params, SeededRandom(0)).unmask(forged)


def test_a_relayed_share_altered_by_the_server_is_refused() -> None:
    """A share the server alters or sends to the wrong client fails authentication and stops that client."""
    params = _group(4, threshold=2)
    clients = {u: SecAggClient(u, params, SeededRandom(u)) for u in params.neighbours}
    server = SecAggServer(params)
    broadcasts = server.broadcast_keys({u: c.advertise() for u, c in clients.items()})
    inboxes = server.relay_shares({u: c.share(broadcasts[u]) for u, c in clients.items()})
    wrong = inboxes[11]
    with pytest.raises(ProtocolAbort, match="not meant"):
        clients[10].receive_shares(wrong)


def test_a_group_repeats_bit_for_bit_from_its_seeds() -> None:
    """The same seeds give the same masked inputs and bytes (sha256), another seed other masked inputs."""

    def digest(seed: int) -> str:
        params = _group(6, threshold=3)
        h = hashlib.sha256()
        run_group(params, _inputs(params), _rngs(params, seed), observe=lambda u, v: h.update(v.tobytes()))
        return h.hexdigest()

    assert digest(1) == digest(1)
    assert digest(1) != digest(2)


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(
    phases=st.lists(st.sampled_from(list(Phase)), min_size=7, max_size=7),
    chosen=st.sets(st.integers(10, 16), max_size=2),
)
def test_any_two_dropouts_among_seven_are_recovered_exactly(phases: list[Phase], chosen: set[int]) -> None:
    """Whichever two clients drop, at whichever rounds, the result is the exact ring sum of the inputs that arrived."""
    params = _group(7, threshold=4, length=12)
    inputs = _inputs(params, seed=3)
    drops = {u: phases[u - 10] for u in chosen}
    result = run_group(params, inputs, _rngs(params), drops=drops)
    assert result.outcome is not None, result.reason
    arrived = [u for u in sorted(inputs) if drops.get(u, Phase.UNMASK + 1) > Phase.MASK]
    assert np.array_equal(result.outcome.total, ring_sum([inputs[u] for u in arrived], params.bits))


def test_corrupt_shares_stop_the_unmasking() -> None:
    """A share altered between a client and the server makes the rebuilt seed invalid: the group stops, no sum."""
    params = _group(5, threshold=3)
    clients = {u: SecAggClient(u, params, SeededRandom(u)) for u in params.neighbours}
    server = SecAggServer(params)
    broadcasts = server.broadcast_keys({u: c.advertise() for u, c in clients.items()})
    inboxes = server.relay_shares({u: c.share(broadcasts[u]) for u, c in clients.items()})
    for u, client in clients.items():
        client.receive_shares(inboxes[u])
    request = server.collect({u: c.mask(_inputs(params)[u]) for u, c in clients.items()})
    responses = {u: clients[u].unmask(request) for u in sorted(request.survivors)}
    first = responses[10]
    forged = dict(first.seed_shares)
    forged[11] = (forged[11] + 1) % PRIME
    responses[10] = UnmaskResponse(10, forged, first.key_shares)
    with pytest.raises(ProtocolAbort, match="corrupt"):
        server.unmask(request, responses)
