"""The aggregation node: admission and fold into a sink, partials, refusals; the edge's buffer sink."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flasync import codecs
from flasync.aggregation import (
    BufferedAggregator,
    ConstantStaleness,
    FlatSGD,
    PolynomialStaleness,
    SampleExampleWeight,
    UpdateBuffer,
)
from flasync.codecs.validation import UpdateValidator
from flasync.core.bus import EventBus
from flasync.core.events import CLOUD, ClientId, EdgeForwarded, UpdateRejected, UpdateUploaded, Version
from flasync.core.snapshots import ModelSnapshot
from flasync.server import Intake, Refused
from flasync.server.node import AggregationNode, BufferSink, Folded, PartialFolded

pytestmark = pytest.mark.timeout(30)

N = 4


def _upload(task_id: int, base: int, delta: torch.Tensor, *, num_samples: int = 10) -> UpdateUploaded:
    return UpdateUploaded(
        task_id=task_id,
        client_id=ClientId(task_id),
        base_version=Version(base),
        num_samples=num_samples,
        payload=codecs.Pipeline().encode(delta).payload,
        train_loss=0.0,
        simulated_s=0.0,
        sent_wall_s=0.0,
    )


def _partial(weighted_sum: torch.Tensor, *, count: int, base: int, example_weight: float = 3.0) -> EdgeForwarded:
    return EdgeForwarded(
        to=CLOUD,
        edge="e0",
        tier="edge1",
        count=count,
        num_samples=7,
        example_weight=example_weight,
        base_version=Version(base),
        payload=codecs.Pipeline().encode(weighted_sum).payload,
        simulated_s=0.0,
        sent_wall_s=0.0,
    )


class _Tasks:
    """A registry stand-in: every task is in flight once, and every version was published."""

    def __init__(self) -> None:
        self.released: set[int] = set()

    def base(self, version: Version) -> ModelSnapshot | None:
        weights = torch.zeros(N)
        return ModelSnapshot(version=version, weights=weights, exact=weights, download_bytes=0)

    def release(self, message: UpdateUploaded) -> bool:
        if message.task_id in self.released:
            return False
        self.released.add(message.task_id)
        return True


class _Sink:
    """A sink that records what it is given and weighs staleness ``tau`` as ``1 / (1 + tau)``."""

    def __init__(self) -> None:
        self.adds: list[tuple[list[float], int, int]] = []
        self.partials: list[tuple[list[float], float, int]] = []

    def add(self, delta: torch.Tensor, *, staleness: int, num_samples: int, base: torch.Tensor) -> float:
        self.adds.append((delta.tolist(), staleness, num_samples))
        return 1.0 / (1 + staleness)

    def add_partial(self, weighted_sum: torch.Tensor, *, example_weight: float, staleness: int) -> float:
        self.partials.append((weighted_sum.tolist(), example_weight, staleness))
        return 1.0 / (1 + staleness)


class _Plugin:
    """A server plug-in that records the extras of the updates folded in."""

    def __init__(self) -> None:
        self.folded_extras: list[torch.Tensor | None] = []

    def folded(self, extra: torch.Tensor | None) -> None:
        self.folded_extras.append(extra)


def _node(bus: EventBus, *, where: str = CLOUD, max_norm: float | None = None, plugins: Any = ()) -> AggregationNode:
    intake = Intake(
        registry=_Tasks(),  # type: ignore[arg-type]
        codec=codecs.Pipeline(),
        num_params=N,
        device=torch.device("cpu"),
        validator=UpdateValidator(N, max_norm=max_norm),
        max_staleness=None,
        clip_norm=None,
        wall=lambda: 0.0,
    )
    return AggregationNode(
        where=where,
        intake=intake,
        bus=bus,
        wall=lambda: 0.0,
        edge_codec=codecs.Pipeline(),
        num_params=N,
        device=torch.device("cpu"),
        plugins=plugins,
    )


def test_an_admitted_update_is_folded_into_the_sink_with_its_staleness() -> None:
    """A good upload reaches the sink with the staleness counted from the node's version, and its weight comes back."""
    sink = _Sink()
    folded = _node(EventBus()).admit(_upload(1, 2, torch.full((N,), 0.5), num_samples=6), version=5, into=sink)
    assert isinstance(folded, Folded)
    assert sink.adds == [([0.5] * N, 3, 6)]
    assert folded.admitted.staleness == 3 and folded.weight == 0.25


def test_a_refused_update_folds_nothing() -> None:
    """An upload the intake refuses (here: above the norm bound) never reaches the sink."""
    sink = _Sink()
    verdict = _node(EventBus(), max_norm=1.0).admit(_upload(1, 0, torch.full((N,), 5.0)), version=0, into=sink)
    assert isinstance(verdict, Refused) and verdict.reason == "norm"
    assert sink.adds == []


def test_an_admitted_update_is_remembered_by_the_validator() -> None:
    """The intake learns the norm of each update folded in (the z-score's reference)."""
    node = _node(EventBus())
    node.admit(_upload(1, 0, torch.full((N,), 0.5)), version=0, into=_Sink())
    assert node.intake.validator.norms == pytest.approx([1.0])


def test_the_plugins_learn_of_each_update_folded_in() -> None:
    """Each plug-in's folded hook sees every admitted update's extra, and none of a refused one."""
    plugin = _Plugin()
    node = _node(EventBus(), max_norm=2.0, plugins=(plugin,))
    node.admit(_upload(1, 0, torch.full((N,), 0.5)), version=0, into=_Sink())
    node.admit(_upload(2, 0, torch.full((N,), 5.0)), version=0, into=_Sink())
    assert plugin.folded_extras == [None]


def _buffered() -> BufferedAggregator:
    weights = torch.zeros(N)
    return BufferedAggregator(
        weights,
        size=100,
        optimizer=FlatSGD(weights),
        staleness=PolynomialStaleness(),
        example_weight=SampleExampleWeight(),
    )


def test_a_run_of_plain_uploads_is_folded_as_each_admitted_in_turn_up_to_the_first_refused() -> None:
    """A run stops at the upload whose task is not in flight (its refusal returned, as admit's) and folds the ones
    before it as admit folds each; an upload that is not plain (too big alone) is left to admit, untouched."""
    node, alone = _node(EventBus(), max_norm=3.0), _node(EventBus(), max_norm=3.0)
    uploads = [_upload(k, k % 3, torch.full((N,), 0.1 * (k + 1)), num_samples=k + 1) for k in range(4)]
    uploads.insert(2, uploads[0])  # its task was answered: refused
    uploads.append(_upload(9, 0, torch.full((N,), 5.0)))  # over max_norm: not plain
    batch = list(zip(uploads, node.intake.decode(uploads), strict=True))
    together, one_by_one = _buffered(), _buffered()
    run = node.admit_run(batch, 0, version=4, into=together)
    assert run is not None and [m.task_id for m in run.uploads] == [0, 1]
    assert run.refused == Refused("unexpected", "client 0 has no task 0")
    assert run.staleness == [4, 3] and len(run.weights) == len(run.norms) == len(run.decode_s) == 2
    rest = node.admit_run(batch, 3, version=4, into=together)
    assert rest is not None and [m.task_id for m in rest.uploads] == [2, 3] and rest.refused is None
    assert node.admit_run(batch, 5, version=4, into=together) is None
    for upload in uploads[:5]:
        alone.admit(upload, version=4, into=one_by_one)
    assert torch.equal(together.buffer.weighted_sum, one_by_one.buffer.weighted_sum)
    assert together.count() == one_by_one.count() == 4
    assert node.intake.validator.norms == alone.intake.validator.norms


def test_a_node_with_plugins_takes_no_run() -> None:
    """Server plug-ins learn of each update folded in through admit: a node with any leaves every upload to it."""
    node = _node(EventBus(), plugins=(_Plugin(),))
    uploads = [_upload(k, 0, torch.full((N,), 0.5)) for k in range(3)]
    batch = list(zip(uploads, node.intake.decode(uploads), strict=True))
    aggregator = _buffered()
    assert node.admit_run(batch, 0, version=0, into=aggregator) is None
    assert aggregator.count() == 0 and not node.intake.registry.released  # type: ignore[attr-defined]


def test_a_partial_is_decoded_and_folded_with_its_staleness() -> None:
    """A partial's weighted sum and example weight reach the sink, its staleness counted from the node's version."""
    sink = _Sink()
    folded = _node(EventBus()).fold_partial(
        _partial(torch.arange(N, dtype=torch.float32), count=2, base=1), version=4, into=sink
    )
    assert isinstance(folded, PartialFolded)
    assert sink.partials == [([0.0, 1.0, 2.0, 3.0], 3.0, 3)]
    assert folded.staleness == 3 and folded.weight == 0.25


def test_a_partial_from_a_newer_version_than_known_has_no_staleness() -> None:
    """A partial whose edge knew a newer version than the receiver counts as staleness 0, never negative."""
    sink = _Sink()
    folded = _node(EventBus()).fold_partial(_partial(torch.ones(N), count=1, base=6), version=4, into=sink)
    assert folded is not None and folded.staleness == 0


def test_an_empty_partial_folds_nothing() -> None:
    """A partial of no update is neither decoded nor folded."""
    sink = _Sink()
    empty = _partial(torch.ones(N), count=0, base=0)
    assert _node(EventBus()).fold_partial(empty, version=0, into=sink) is None
    assert sink.partials == []


async def test_a_refusal_is_published_where_it_happened() -> None:
    """reject publishes an UpdateRejected naming the node, the reason and the time given."""
    bus = EventBus()
    rejected = bus.subscribe(UpdateRejected)
    upload = _upload(3, 1, torch.ones(N))
    await _node(bus, where="e1").reject(upload, Refused("stale", "too old"), simulated_s=2.5)
    event = rejected.receive_nowait()
    assert (event.task_id, event.client_id, event.base_version) == (3, 3, 1)
    assert (event.reason, event.detail, event.simulated_s, event.where) == ("stale", "too old", 2.5, "e1")


def test_the_buffer_sink_weighs_updates_by_samples_and_staleness() -> None:
    """An edge's sink adds e_k s(tau_k) delta_k and returns s(tau_k)."""
    buffer = UpdateBuffer(N)
    sink = BufferSink(buffer, example_weight=SampleExampleWeight(), staleness=PolynomialStaleness(a=1.0))
    weight = sink.add(torch.ones(N), staleness=1, num_samples=4, base=torch.zeros(N))
    assert weight == 0.5
    assert buffer.weighted_sum.tolist() == [2.0] * N and buffer.total_example_weight == 4.0


def test_the_buffer_sink_adds_partials_at_full_weight() -> None:
    """A sub-edge's partial is added undiscounted, whatever its staleness: the parent discounts the whole."""
    buffer = UpdateBuffer(N)
    sink = BufferSink(buffer, example_weight=SampleExampleWeight(), staleness=ConstantStaleness())
    assert sink.add_partial(torch.full((N,), 3.0), example_weight=6.0, staleness=5) == 1.0
    assert buffer.weighted_sum.tolist() == [3.0] * N and buffer.total_example_weight == 6.0


def test_a_fold_that_fails_mid_run_returns_the_updates_folded_before_it_and_the_error() -> None:
    """An error of the fold itself (not a refusal) ends the run: the updates folded before it come back, counted by
    the buffer, with the error for the receiver to raise once it has counted and logged them."""
    node = _node(EventBus())
    uploads = [_upload(k, 0, torch.full((N,), 0.1 * (k + 1))) for k in range(5)]
    batch = list(zip(uploads, node.intake.decode(uploads), strict=True))
    reference, weights = _buffered(), torch.zeros(N)

    class ThirdFails(BufferedAggregator):
        def add_rows(self, deltas: Any, *, example_weights: Any, staleness_weights: Any) -> None:
            super().add_rows(deltas[:2], example_weights=example_weights[:2], staleness_weights=staleness_weights[:2])
            raise RuntimeError("the third cannot be folded")

    aggregator = ThirdFails(
        weights,
        size=100,
        optimizer=FlatSGD(weights),
        staleness=PolynomialStaleness(),
        example_weight=SampleExampleWeight(),
    )
    run = node.admit_run(batch, 0, version=0, into=aggregator)
    assert run is not None and isinstance(run.failure, RuntimeError) and run.refused is None
    assert [m.task_id for m in run.uploads] == [0, 1]
    assert len(run.staleness) == len(run.weights) == len(run.norms) == len(run.decode_s) == 2
    reference.buffer.add_rows(
        [torch.full((N,), 0.1), torch.full((N,), 0.2)], example_weights=[10.0, 10.0], staleness_weights=[1.0, 1.0]
    )
    assert aggregator.count() == 2 and torch.equal(aggregator.buffer.weighted_sum, reference.buffer.weighted_sum)
