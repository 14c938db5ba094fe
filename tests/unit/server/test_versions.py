"""The version maker: a step publishes the next version, evaluation keeps its figures, a broken step stops the run."""

from __future__ import annotations

import math
import random

import pytest
import torch

from flasync import codecs
from flasync.core.errors import TrainingError
from flasync.core.events import Aggregated, Evaluated, ModelPublished
from flasync.server import StopRules
from flasync.server.versions import Evaluator, VersionMaker, _checked_norm
from flasync.testing import EventRecorder, NullLog, ServerHarness
from flasync.training.local import EvalResult

pytestmark = pytest.mark.timeout(30)


async def _no_model(weights: torch.Tensor) -> EvalResult | None:
    return None


def _maker(
    harness: ServerHarness,
    evaluate: Evaluator = _no_model,
    keys: list[int] | None = None,
    codec: codecs.Pipeline | None = None,
) -> VersionMaker:
    def generator(key: int) -> torch.Generator:
        if keys is not None:
            keys.append(key)
        return torch.Generator().manual_seed(key + 100)

    return VersionMaker(
        harness.weights,
        aggregator=harness.aggregator,
        registry=harness.registry,
        policy=harness.policy,
        accounting=harness.accounting,
        bus=harness.bus,
        clock=harness.clock,
        wall=lambda: 0.0,
        log=harness.log,
        download_codec=harness.clients.codec if codec is None else codec,
        evaluate=evaluate,
        rules=StopRules(max_versions=3),
        download_generator=generator,
    )


def _fold(harness: ServerHarness, value: float) -> None:
    harness.aggregator.add(torch.full((4,), value), staleness=0, num_samples=1, base=harness.weights)


async def test_publishing_makes_the_current_model_the_base_of_new_tasks() -> None:
    """publish hands the registry a snapshot of the weights at the current version and announces it."""
    harness = ServerHarness()
    events = EventRecorder(harness.bus)
    maker = _maker(harness)
    await maker.publish()
    current = harness.registry.current
    assert current is not None and current.version == 0 and torch.equal(current.weights, harness.weights)
    assert [e.version for e in events.of(ModelPublished)] == [0]


async def test_a_step_makes_publishes_and_reports_the_next_version() -> None:
    """step applies what was folded in, counts version 1, publishes it and reports its updates."""
    harness = ServerHarness()
    events = EventRecorder(harness.bus)
    maker = _maker(harness)
    await maker.publish()
    _fold(harness, 1.0)
    _fold(harness, 3.0)
    await maker.step()
    assert maker.version == 1 and harness.accounting.stats.versions == 1
    assert torch.equal(harness.weights, torch.full((4,), -2.0))  # SGD, lr 1, on the mean delta
    assert [e.version for e in events.of(ModelPublished)] == [0, 1]
    assert [e.version for e in events.of(Aggregated)] == [1]


async def test_a_steps_snapshot_keeps_the_norm_its_finite_check_measured() -> None:
    """The version a step makes carries ||weights||, that of its own copy bit for bit, for the alert monitor to take;
    a model published without a step (the first, a resumed one) carries none."""
    harness = ServerHarness()
    maker = _maker(harness)
    await maker.publish()
    assert harness.registry.current is not None and harness.registry.current.norm is None
    _fold(harness, 0.1)
    _fold(harness, 0.7)
    await maker.step()
    current = harness.registry.current
    assert current is not None and current.version == 1 and current.norm is not None
    assert repr(current.norm) == repr(float(torch.linalg.vector_norm(current.exact)))
    assert current.norm == pytest.approx(0.8)


async def test_each_version_draws_its_download_stream_by_its_number() -> None:
    """The model of version v is encoded with the download stream of key v (by a codec that draws)."""
    harness = ServerHarness()
    keys: list[int] = []
    maker = _maker(harness, keys=keys, codec=codecs.Pipeline([codecs.Int8(stochastic=True)]))
    await maker.publish()
    _fold(harness, 1.0)
    await maker.step()
    assert keys == [0, 1]


async def test_a_lossless_download_is_sized_without_encoding_or_drawing() -> None:
    """The lossless model is published as it is, its size that of its payload, and no download stream is drawn."""
    harness = ServerHarness()
    keys: list[int] = []
    events = EventRecorder(harness.bus)
    maker = _maker(harness, keys=keys)
    await maker.publish()
    _fold(harness, 1.0)
    await maker.step()
    current = harness.registry.current
    assert current is not None and current.weights is current.exact
    assert current.download_bytes == len(codecs.encode(harness.weights))
    assert [e.download_bytes for e in events.of(ModelPublished)] == [len(codecs.encode(harness.weights))] * 2
    assert keys == []


async def test_a_lossy_download_publishes_what_clients_decode() -> None:
    """A lossy codec's model is what its payload decodes to, beside the exact weights, and its size the payload's."""
    harness = ServerHarness()
    codec = codecs.Pipeline([codecs.Float16()])
    maker = _maker(harness, codec=codec)
    _fold(harness, 1.0 / 3.0)
    await maker.step()
    current = harness.registry.current
    assert current is not None and torch.equal(current.exact, harness.weights)
    payload = codec.encode(harness.weights).payload
    assert torch.equal(current.weights, codecs.decode(payload, expected_elements=4))
    assert not torch.equal(current.weights, current.exact)
    assert current.download_bytes == len(payload)


async def test_a_step_to_non_finite_weights_raises_and_keeps_the_version() -> None:
    """A step that leaves Inf in the weights raises TrainingError before the version counts or is published."""
    harness = ServerHarness()
    maker = _maker(harness)
    await maker.publish()
    _fold(harness, float("-inf"))
    with pytest.raises(TrainingError, match="NaN or Inf after the server step to version 1"):
        await maker.step()
    assert maker.version == 0 and harness.accounting.stats.versions == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
async def test_a_step_to_a_single_non_finite_weight_raises(bad: float) -> None:
    """One NaN, Inf or -Inf element among finite ones is caught, wherever it lies."""
    harness = ServerHarness()
    maker = _maker(harness)
    delta = torch.zeros(4)
    delta[2] = bad
    harness.aggregator.add(delta, staleness=0, num_samples=1, base=harness.weights)
    with pytest.raises(TrainingError, match="NaN or Inf"):
        await maker.step()


async def test_a_step_to_huge_finite_weights_publishes() -> None:
    """Finite weights whose L2 norm overflows float32 are finite: the step publishes them."""
    harness = ServerHarness()
    maker = _maker(harness)
    _fold(harness, -3e38)
    await maker.step()
    assert maker.version == 1 and float(torch.linalg.vector_norm(harness.weights)) == float("inf")


async def test_evaluation_keeps_the_figures_of_the_published_model() -> None:
    """evaluate scores the current model and keeps its accuracy, loss and version in the stats."""
    harness = ServerHarness()
    events = EventRecorder(harness.bus)
    seen: list[float] = []

    async def score(weights: torch.Tensor) -> EvalResult | None:
        seen.append(float(weights.sum()))
        return EvalResult(accuracy=0.75, loss=0.5, num_samples=1)

    maker = _maker(harness, evaluate=score)
    await maker.publish()
    await maker.evaluate()
    stats = harness.accounting.stats
    assert seen == [0.0]
    assert (stats.accuracy, stats.loss, stats.evaluated_version) == (0.75, 0.5, 0)
    assert [(e.version, e.accuracy) for e in events.of(Evaluated)] == [(0, 0.75)]


async def test_nothing_to_evaluate_on_leaves_the_stats() -> None:
    """An evaluator with nothing to evaluate on (None) leaves the stats unevaluated and reports nothing."""
    harness = ServerHarness()
    events = EventRecorder(harness.bus)
    maker = _maker(harness)
    await maker.publish()
    await maker.evaluate()
    assert harness.accounting.stats.evaluated_version == -1
    assert events.of(Evaluated) == []


@pytest.mark.parametrize("seed", range(20))
def test_the_finiteness_check_is_the_element_wise_test(seed: int) -> None:
    """_checked_norm gives a norm exactly when torch.isfinite(w).all(), for tiny, plain and overflowing magnitudes with
    NaN, Inf and -Inf anywhere (sizes around the vector width), and for a tensor that requires grad; the norm is
    torch.linalg.vector_norm's, bit for bit (infinite where the squares of finite elements overflow)."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(30):
        size = rng.choice([0, 1, 2, 7, 8, 9, 15, 16, 17, 64, 65, 1000, 2762, 70_001])
        weights = torch.randn(size, generator=generator) * rng.choice([1e-30, 1.0, 1e19, 3e38])
        for _ in range(rng.choice([0, 0, 1, 2]) if size else 0):
            weights[rng.randrange(size)] = rng.choice([math.nan, math.inf, -math.inf])
        if rng.random() < 0.2:
            weights.requires_grad_()
        norm = _checked_norm(weights)
        assert (norm is not None) == bool(torch.isfinite(weights).all())
        if norm is not None:
            assert repr(norm) == repr(float(torch.linalg.vector_norm(weights.detach())))


class _QuietLog(NullLog):
    """A logger set above debug, as structlog's filtering loggers tell it."""

    def is_enabled_for(self, level: int) -> bool:
        """Tell that debug (10) is not logged."""
        return level > 10


@pytest.mark.parametrize("quiet", [False, True])
async def test_the_version_line_is_logged_where_debug_reaches_a_logger(quiet: bool) -> None:
    """Each version's ``server.version`` debug line carries its figures; a logger above debug is not called."""
    harness = ServerHarness()
    log = harness.log = _QuietLog() if quiet else NullLog()
    maker = _maker(harness)
    await maker.publish()
    for value in (1.0, 2.0):
        _fold(harness, value)
        harness.accounting.accepted(1)
    await maker.step()
    lines = log.events("server.version")
    if quiet:
        assert lines == []
    else:
        assert [(line["step"], line["updates"], line["staleness_mean"]) for line in lines] == [(1, 2, 1.0)]
