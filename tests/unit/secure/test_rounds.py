"""Tests of secure FedAvg rounds and FedBuff buffers with simulated clients (flasync.secure.rounds)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from flasync.aggregation import PolynomialStaleness, UpdateBuffer
from flasync.secure.group import Phase
from flasync.secure.rounds import ClientUpdate, Link, SecureAggregator, SecureBuffer, WaitingUpdate

_PARAMS = 40


def _aggregator(group_size: int = 10, *, dropout_rate: float = 0.0, threshold: int = 6) -> SecureAggregator:
    return SecureAggregator(
        bits=32,
        clip=1.0,
        group_size=group_size,
        threshold=threshold,
        neighbours=8,
        seed=5,
        link=Link(upload_bytes_per_s=1e5, download_bytes_per_s=1e6, latency_s=0.02),
        dropout_rate=dropout_rate,
    )


def _deltas(n: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(_PARAMS, generator=generator) * 0.1 for _ in range(n)]


def test_a_secure_fedavg_round_gives_the_sample_weighted_mean() -> None:
    """The unmasked round is the sample-weighted mean within the fixed-point step; each phase costs bytes."""
    aggregator = _aggregator()
    deltas, samples = _deltas(10), [float(20 + 7 * i) for i in range(10)]
    scale = max(samples)
    updates = [ClientUpdate(i, d, s / scale) for i, (d, s) in enumerate(zip(deltas, samples, strict=True))]
    report = aggregator.aggregate(0, updates)
    mean = report.mean()
    assert mean is not None
    expected = sum(s * d for s, d in zip(samples, deltas, strict=True)) / sum(samples)
    assert isinstance(expected, torch.Tensor)
    bound = 10 * aggregator.encoding.values.step * scale / sum(samples) + 1e-6
    assert (mean - expected).abs().max().item() <= bound
    assert set(report.phase_bytes) == {"advertise", "share", "mask", "unmask"}
    assert report.phase_bytes["mask"] == 10 * (1 + 8 + 4 * (_PARAMS + 1))
    assert all(seconds > 0.0 for seconds in report.phase_s.values())


def test_drawn_dropouts_are_recovered_counted_and_repeat() -> None:
    """Dropouts drawn from the seed repeat; those after sharing are recovered and the sum holds only survivors."""
    aggregator = _aggregator(dropout_rate=0.1)
    updates = [ClientUpdate(i, d, 1.0) for i, d in enumerate(_deltas(10))]
    drops = aggregator.drops(3, list(range(10)))
    assert drops == aggregator.drops(3, list(range(10)))
    assert 0 < len(drops) <= 2
    report = aggregator.aggregate(3, updates)
    assert not report.abandoned, report.reason
    assert report.dropped == frozenset(drops)
    arrived = {i for i in range(10) if drops.get(i, Phase.UNMASK + 1) > Phase.MASK}
    assert report.survivors == arrived
    assert report.recovered == {u for u, p in drops.items() if p == Phase.MASK}
    assert report.total_weight == pytest.approx(len(arrived), abs=1e-6)


def test_a_round_with_more_dropouts_than_tolerated_is_abandoned() -> None:
    """Three clients lost before unmasking out of 8 neighbours with threshold 6 abandon the round with a reason."""
    aggregator = _aggregator()
    updates = [ClientUpdate(i, d, 1.0) for i, d in enumerate(_deltas(10))]
    drops = {i: Phase.MASK for i in (0, 1, 2)}
    report = aggregator.aggregate(1, updates, drops=drops)
    assert report.abandoned and report.mean() is None
    assert "fewer than the threshold" in report.reason


def _arrivals(count: int) -> list[WaitingUpdate]:
    deltas = _deltas(count, seed=1)
    return [
        WaitingUpdate(
            client=i % 13,
            base_version=max(0, i // 5 - i % 2),
            delta=deltas[i],
            example_weight=1.0 + i % 4,
            arrived_s=1.5 * i,
        )
        for i in range(count)
    ]


def _buffer() -> SecureBuffer:
    return SecureBuffer(_aggregator(group_size=5, threshold=3), 5, PolynomialStaleness(a=0.5), example_weight_scale=4.0)


def test_a_secure_buffer_reveals_fedbuffs_pseudo_gradient() -> None:
    """A full buffer unmasks to UpdateBuffer's pseudo-gradient with the same staleness and sample weights."""
    buffer = _buffer()
    arrivals = [WaitingUpdate(i, i % 3, d, 1.0 + i % 4, 2.0 * i) for i, d in enumerate(_deltas(5))]
    buffer.version = 2
    outputs = [buffer.arrive(a) for a in arrivals]
    assert outputs[:4] == [None] * 4
    closed = outputs[4]
    assert closed is not None
    report, waits = closed
    plain = UpdateBuffer(_PARAMS)
    staleness = PolynomialStaleness(a=0.5)
    for a in arrivals:
        plain.add(a.delta, example_weight=a.example_weight, staleness_weight=staleness(2 - a.base_version))
    mean = report.mean()
    assert mean is not None
    assert (mean - plain.pseudo_gradient()).abs().max().item() <= 5 * _buffer().aggregator.encoding.values.step * 4
    assert waits == [8.0, 6.0, 4.0, 2.0, 0.0]
    assert buffer.version == 3


def _digest(buffer: SecureBuffer, arrivals: list[WaitingUpdate], h: hashlib._Hash) -> None:
    for arrival in arrivals:
        closed = buffer.arrive(arrival)
        if closed is not None and closed[0].weighted_sum is not None:
            h.update(closed[0].weighted_sum.numpy().tobytes())


def test_buffers_repeat_bit_for_bit_and_resume_mid_buffer() -> None:
    """Two runs give the same sha256; a run checkpointed with a half-full buffer and resumed gives it too."""
    arrivals = _arrivals(17)
    digests = []
    for _ in range(2):
        h = hashlib.sha256()
        _digest(_buffer(), arrivals, h)
        digests.append(h.hexdigest())
    h = hashlib.sha256()
    first = _buffer()
    _digest(first, arrivals[:7], h)
    assert len(first.waiting) == 2
    resumed = _buffer()
    resumed.load_state_dict(first.state_dict())
    _digest(resumed, arrivals[7:], h)
    assert digests[0] == digests[1] == h.hexdigest()
    assert resumed.version == 3


def test_an_update_from_a_future_version_is_refused() -> None:
    """A base version newer than the buffer's model is refused."""
    with pytest.raises(ValueError, match="base version"):
        _buffer().arrive(WaitingUpdate(0, 1, torch.zeros(_PARAMS), 1.0, 0.0))


def test_a_report_logs_bytes_and_seconds_per_round_and_its_dropouts() -> None:
    """One secagg line (metrics secagg/<field>) carries each round's bytes and seconds, dropouts, recoveries and
    abandonment."""
    import structlog
    from structlog.testing import capture_logs

    updates = [ClientUpdate(i, d, 1.0) for i, d in enumerate(_deltas(10))]
    report = _aggregator().aggregate(0, updates, drops={4: Phase.MASK})
    with capture_logs() as lines:
        report.log(structlog.get_logger(), step=7)
    (line,) = lines
    assert line["event"] == "secagg" and line["step"] == 7
    assert line["recovered"] == 1.0 and line["dropped"] == 1.0 and line["abandoned"] == 0.0
    assert line["mask_bytes"] == 9 * (1 + 8 + 4 * (_PARAMS + 1))
    assert line["bytes_ratio"] > 1.0
    assert sum(report.upload_bytes.values()) + sum(report.download_bytes.values()) == sum(report.phase_bytes.values())


def test_a_client_waits_in_a_buffer_once() -> None:
    """A client holding an update in the filling buffer cannot add a second one to it."""
    buffer = _buffer()
    buffer.arrive(WaitingUpdate(3, 0, torch.zeros(_PARAMS), 1.0, 0.0))
    with pytest.raises(ValueError, match="already waits"):
        buffer.arrive(WaitingUpdate(3, 0, torch.zeros(_PARAMS), 1.0, 1.0))


def test_protocol_bytes_follow_the_guides_formula() -> None:
    """Without dropouts each client sends and receives 128 + 546 k + 8 n + e (P + 1) bytes, as the guide says."""
    n, k = 10, 8
    report = _aggregator().aggregate(0, [ClientUpdate(i, d, 1.0) for i, d in enumerate(_deltas(n))], drops={})
    assert sum(report.phase_bytes.values()) == n * (128 + 546 * k + 8 * n + 4 * (_PARAMS + 1))


def test_a_buffer_charges_the_version_it_announces_to_each_member() -> None:
    """Each member of a buffer receives the version its buffer steps from: 8 bytes more in round 0 than a round."""
    deltas = _deltas(5)
    buffer = _buffer()
    closed = None
    for i, d in enumerate(deltas):
        closed = buffer.arrive(WaitingUpdate(i, 0, d, 4.0, float(i)))
    assert closed is not None
    updates = [ClientUpdate(i, d, 1.0, 1.0) for i, d in enumerate(deltas)]
    alone = _buffer().aggregator.aggregate(0, updates)
    assert closed[0].phase_bytes["advertise"] == alone.phase_bytes["advertise"] + 5 * 8
