"""Simulated clients: a group of tasks in one coroutine answers exactly as groups of one (a coroutine per task) do."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import pytest
import torch

import flasync
from flasync import tracking
from flasync.aggregation import BufferedAggregator
from flasync.clients.simulated import client as client_module
from flasync.core.bus import EventBus
from flasync.core.clock import VirtualClock, WallClock
from flasync.core.events import (
    TaskAssigned,
    TasksAssigned,
    UpdateReceived,
    UpdateRejected,
    UpdatesReceived,
    UpdatesUploaded,
    UpdateUploaded,
)
from flasync.core.instruments import Instrument
from flasync.core.loops import run_loop
from flasync.runtime import build as build_module
from flasync.server import TaskRegistry
from flasync.testing import EventRecorder, MemoryTracker, small_config
from flasync.training.executors.threads import CohortBatcher

pytestmark = pytest.mark.timeout(120)

# Every client online all the time: nothing changes for any task, but a fault model that decides per task makes the
# registry start each task in a group of its own.
_ONE_EACH = "faults.availability={period_s: 1000.0, online_fraction: 1.0}"


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(("executor.kind=vectorized",), id="fedbuff-vectorized"),
        pytest.param(("executor.kind=thread", "codec.upload=[{kind: topk, ratio: 0.05}]"), id="fedbuff-topk"),
        pytest.param(("executor.kind=vectorized", "resilience.task_timeout_s=1.0"), id="fedbuff-timeouts"),
        pytest.param(
            (
                "server={kind: fedavg, clients_per_round: 8}",
                "executor.kind=vectorized",
                "resilience.round_deadline_s=1.0",
            ),
            id="fedavg-deadline",
        ),
        pytest.param(
            (
                "server={kind: fedavg, clients_per_round: 8}",
                "resilience.over_selection=0.5",
                "population.speed={kind: constant}",
            ),
            id="fedavg-quorum-at-one-time",
        ),
        pytest.param(("server={kind: fedavg, clients_per_round: 10}", "faults.byzantine=0.2"), id="fedavg-byzantine"),
        pytest.param(("scaffold.enabled=true", "server={kind: fedavg, clients_per_round: 6}"), id="scaffold"),
    ],
)
@pytest.mark.slow
def test_tasks_run_as_a_group_give_the_weights_and_counts_of_one_coroutine_per_task(
    overrides: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same run with the tasks dispatched together in one :class:`CohortClients` coroutine and with each task in
    a group of its own: the same weights bit for bit, the same accepted, dropped and failed updates, and each path
    was the one taken."""
    grouped: list[int] = []
    run_group = client_module.CohortClients.run

    async def counted(self: client_module.CohortClients, tasks: Any, model: Any) -> None:
        grouped.append(len(tasks))
        await run_group(self, tasks, model)

    monkeypatch.setattr(client_module.CohortClients, "run", counted)
    group = flasync.run(small_config(*overrides))
    assert grouped and sum(grouped) >= group.updates_accepted
    seen = len(grouped)
    each = flasync.run(small_config(*overrides, _ONE_EACH))
    assert grouped[seen:] and all(size == 1 for size in grouped[seen:])  # the availability model: groups of one
    assert each.weights_sha256 == group.weights_sha256
    counts = ("updates_accepted", "updates_dropped", "updates_failed", "tasks_abandoned", "tasks_timed_out", "versions")
    assert [getattr(group, c) for c in counts] == [getattr(each, c) for c in counts]
    if "fedavg" in overrides[0]:
        assert max(grouped) > 1  # a round's cohort runs in one coroutine
    if "timeout" in " ".join(overrides):
        assert group.tasks_timed_out > 0  # a timed-out task's upload never comes, though its job trained
    if "deadline" in " ".join(overrides) or "over_selection" in " ".join(overrides):
        # Stragglers of a closed round never answer, even those whose uploads were due when the quorum was met.
        assert group.tasks_abandoned > 0 and group.updates_dropped == 0


def test_a_batching_executor_gets_every_training_job_as_a_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client coroutine hands a declared loop executor (the vectorized executor's batcher) every training job
    through its one batch method: a round's cohort as one batch, and each task of a run whose fault model decides
    per task as a batch of one."""
    sizes: list[int] = []
    submit = CohortBatcher.submit_many_async

    def counted(self: CohortBatcher, jobs: Any) -> Any:
        sizes.append(len(jobs))
        return submit(self, jobs)

    monkeypatch.setattr(CohortBatcher, "submit_many_async", counted)
    fedavg = ("server={kind: fedavg, clients_per_round: 8}", "executor.kind=vectorized", "stop.max_versions=3")
    grouped = flasync.run(small_config(*fedavg))
    assert sizes == [8, 8, 8] and grouped.updates_accepted == 24
    sizes.clear()
    each = flasync.run(small_config(*fedavg, _ONE_EACH))
    assert sizes == [1] * 24 and each.weights_sha256 == grouped.weights_sha256


def test_clients_failing_alike_are_warned_of_a_few_times_not_once_each(capsys: pytest.CaptureFixture[str]) -> None:
    """Every client failing with one error (a learning rate that overflows) gives FAILURE_WARNINGS warnings, the last
    saying the rest are debug lines; every failure is still counted, and the run ends with its one error."""
    with pytest.raises(flasync.core.errors.TrainingError, match="client tasks all failed"):
        flasync.run(small_config("client.lr=1e30", "stop.max_versions=5", "tracking.log_level=info"))
    output = capsys.readouterr()
    warnings = [line for line in (output.out + output.err).splitlines() if "client.failed" in line]
    assert len(warnings) == client_module.FAILURE_WARNINGS
    assert "further failures with this error are logged at debug level" in warnings[-1]
    assert all("DivergedTraining" in line for line in warnings)


def _upload_batches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Return a list that gets the size of every :class:`UpdatesUploaded` published from now on."""
    batches: list[int] = []
    publish = EventBus.publish

    async def counted(bus: EventBus, event: object) -> None:
        if isinstance(event, UpdatesUploaded):
            batches.append(len(event.uploads))
        await publish(bus, event)

    monkeypatch.setattr(EventBus, "publish", counted)
    return batches


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(
            ("server={kind: fedavg, clients_per_round: 8}", "population.speed={kind: constant}"),
            id="fedavg-rounds",
        ),
        pytest.param(
            (
                "server={kind: fedbuff, buffer_size: 3, concurrency: 8, max_staleness: 1}",
                "population.speed={kind: constant}",
            ),
            id="fedbuff-steps-and-refusals-inside-a-batch",
        ),
        pytest.param(
            (
                "server={kind: fedavg, clients_per_round: 6}",
                "population.speed={kind: constant}",
                "codec.upload=[{kind: fp16}]",
            ),
            id="fedavg-fp16",
        ),
        pytest.param(
            (
                "server={kind: fedavg, clients_per_round: 8}",
                "population.speed={kind: constant}",
                "faults.byzantine=0.3",
                "resilience.max_update_norm=3.0",
            ),
            id="fedavg-refusals-inside-a-batch",
        ),
    ],
)
def test_uploads_due_together_travel_as_one_batch_and_change_nothing(
    overrides: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uploads due at one time go to the server as one :class:`UpdatesUploaded` (decoded and checked together); the
    run ends with the weights, bit for bit, and the counts of one coroutine per task, whose uploads travel alone, even
    where a version steps and updates are refused between the members of one batch."""
    batches = _upload_batches(monkeypatch)
    config = small_config("executor.kind=vectorized", *overrides)
    together = flasync.run(config)
    assert batches and max(batches) > 2
    apart = flasync.run(small_config("executor.kind=vectorized", *overrides, _ONE_EACH))
    assert apart.weights_sha256 == together.weights_sha256
    counts = ("updates_accepted", "updates_dropped", "updates_failed", "versions")
    assert [getattr(together, c) for c in counts] == [getattr(apart, c) for c in counts]
    if "max_staleness" in overrides[0] or "byzantine" in " ".join(overrides):
        assert together.updates_dropped > 0  # members of a batch were refused between accepted ones


def test_a_batchs_debug_lines_give_a_tracked_run_the_metrics_of_uploads_that_travel_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A group's trained tasks and a batch's accepted updates reach a tracked run's metrics as one batch each, with
    the rows (keys, values, steps) and the constants of a run whose tasks and uploads go one by one."""
    batch_sizes: list[int] = []
    emit_many = tracking.MetricsProcessor.emit_many

    def counted(processor: tracking.MetricsProcessor, event: Any, many: Any) -> None:
        batch_sizes.append(len(many))
        emit_many(processor, event, many)

    monkeypatch.setattr(tracking.MetricsProcessor, "emit_many", counted)
    overrides = (
        "executor.kind=vectorized",
        "server={kind: fedavg, clients_per_round: 8}",
        "population.speed={kind: constant}",
        "faults.byzantine=0.3",
        "resilience.max_update_norm=3.0",
        "tracking.metrics=all",
    )

    def tracked(*more: str) -> MemoryTracker:
        tracker = MemoryTracker()
        run_loop(flasync.Federation(small_config(*overrides, *more), tracker=tracker).run())
        return tracker

    together = tracked()
    assert max(batch_sizes) >= 8
    batch_sizes.clear()
    apart = tracked(_ONE_EACH)
    assert max(batch_sizes) == 1

    def per_update(tracker: MemoryTracker) -> list[tuple[str, float, int]]:
        per = ("client/", "server/update/")
        rows = [(r.key, r.value, r.step) for r in tracker.metrics if r.key.startswith(per) and not r.key.endswith("_s")]
        return sorted(rows)  # without timings

    assert {key for key, _, _ in per_update(together)} >= {"client/loss", "server/update/norm"}
    assert per_update(together) == per_update(apart)
    constants = {k: v for k, v in together.tags.items() if k.startswith("constant/")}
    assert constants and constants == {k: v for k, v in apart.tags.items() if k.startswith("constant/")}


def test_a_batchs_debug_lines_reach_the_metrics_when_an_update_of_it_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error folding in an update of a batch ends the run, and the lines of the updates folded before it are
    still in the tracked run's metrics."""
    folded: list[int] = []
    add, add_rows = BufferedAggregator.add, BufferedAggregator.add_rows

    def failing(self: BufferedAggregator, delta: torch.Tensor, **kwargs: Any) -> float:
        if len(folded) == 5:
            raise RuntimeError("the sixth update cannot be folded")
        folded.append(1)
        return add(self, delta, **kwargs)

    def failing_rows(
        self: BufferedAggregator,
        deltas: Sequence[torch.Tensor],
        *,
        example_weights: Sequence[float],
        staleness_weights: Sequence[float],
    ) -> None:
        # A batch's uploads are folded as a run (AggregationNode.admit_run): the sixth fails there just the same.
        for delta, example, discount in zip(deltas, example_weights, staleness_weights, strict=True):
            if len(folded) == 5:
                raise RuntimeError("the sixth update cannot be folded")
            folded.append(1)
            add_rows(self, [delta], example_weights=[example], staleness_weights=[discount])

    monkeypatch.setattr(BufferedAggregator, "add", failing)
    monkeypatch.setattr(BufferedAggregator, "add_rows", failing_rows)
    tracker = MemoryTracker()
    config = small_config(
        "executor.kind=vectorized",
        "server={kind: fedavg, clients_per_round: 8}",
        "population.speed={kind: constant}",
        "tracking.metrics=all",
    )
    with pytest.raises(RuntimeError, match="sixth update"):
        run_loop(flasync.Federation(config, tracker=tracker).run())
    assert len(folded) == 5
    assert sorted(r.step for r in tracker.metrics if r.key == "server/update/norm") == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("per_round", "extra"),
    [
        pytest.param(8, (), id="fedavg"),
        pytest.param(8, ("faults.byzantine=0.3", "resilience.max_update_norm=3.0"), id="fedavg-refusals"),
        pytest.param(6, ("codec.upload=[{kind: fp16}]",), id="fedavg-fp16"),
    ],
)
def test_a_rounds_uploads_due_at_several_times_travel_as_one_batch_and_change_nothing(
    per_round: int, extra: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clients of their own speeds upload a round at as many times; a round that closes on its last answer takes
    them as one batch at the last of those times. Every upload, refusal and update received carries the virtual
    time it has when each upload travels alone (one coroutine per task), the weights are the same bit for bit, and
    so are the counts and the run's virtual duration."""
    batches = _upload_batches(monkeypatch)

    overrides = ("executor.kind=vectorized", f"server={{kind: fedavg, clients_per_round: {per_round}}}", *extra)

    def recorded(*more: str) -> tuple[flasync.RunSummary, EventRecorder]:
        federation = flasync.Federation(small_config(*overrides, *more))
        recorder = EventRecorder(federation.bus)
        return run_loop(federation.run()), recorder

    together, seen = recorded()
    assert batches and max(batches) == per_round  # a whole round in one batch
    apart, alone = recorded(_ONE_EACH)
    assert apart.weights_sha256 == together.weights_sha256
    counts = ("updates_accepted", "updates_dropped", "updates_failed", "versions", "simulated_s")
    assert [getattr(together, c) for c in counts] == [getattr(apart, c) for c in counts]

    def times(recorder: EventRecorder, kind: type[Any]) -> list[tuple[int, float]]:
        return sorted((event.task_id, event.simulated_s) for event in recorder.of(kind))

    uploads = times(seen, UpdateUploaded)
    assert len({at for _, at in uploads}) > len(uploads) // 2  # uploads of distinct times
    for kind in (UpdateUploaded, UpdateReceived, UpdateRejected):
        assert times(seen, kind) == times(alone, kind)
    if extra and "byzantine" in extra[0]:
        assert together.updates_dropped > 0  # refused between accepted members of a batch


async def test_uploads_wait_for_their_times_where_the_clock_has_anything_before_the_last() -> None:
    """_quiet_uploads takes a group's remaining uploads only when they are all uploads and the virtual clock fires
    nothing up to the last of them; otherwise it leaves the agenda as it was."""
    clock = VirtualClock()
    upload, failed = client_module._UPLOAD, client_module._FAILED

    async def body() -> None:
        agenda = [(3.0, 10, upload, 0), (4.0, 11, upload, 1)]
        assert client_module._quiet_uploads(agenda, clock) == [(3.0, 0), (4.0, 1)] and agenda == []
        other = asyncio.create_task(clock.sleep_until(5.0))
        await asyncio.sleep(0)
        for kept in (
            [(3.0, 10, upload, 0), (6.0, 11, upload, 1)],  # the other timer comes first
            [(3.0, 10, upload, 0), (5.0, 11, upload, 1)],  # or at the same time
            [(3.0, 10, upload, 0), (4.0, 2, failed, 1)],  # a failure is published at its own time
        ):
            before = list(kept)
            assert client_module._quiet_uploads(kept, clock) == [] and kept == before
        assert client_module._quiet_uploads([(1.0, 5, upload, 0)], WallClock()) == []
        await other

    async with asyncio.TaskGroup() as tg:
        tg.create_task(clock.drive())
        try:
            await body()
        finally:
            clock.stop()


def test_an_observer_that_wants_each_upload_gets_each_one() -> None:
    """An instrument that does not take batches keeps every upload, and every update received, an event of its own;
    the run's weights are the same either way."""

    class Uploads(Instrument):
        def __init__(self) -> None:
            self.seen: list[type[Any]] = []

        def event_published(self, event: object) -> None:
            if isinstance(event, UpdateUploaded | UpdatesUploaded | UpdateReceived | UpdatesReceived):
                self.seen.append(type(event))

    config = small_config(
        "executor.kind=vectorized", "server={kind: fedavg, clients_per_round: 8}", "population.speed={kind: constant}"
    )
    federation = flasync.Federation(config)
    uploads = Uploads()
    federation.bus.add_instrument(uploads)
    watched = run_loop(federation.run())
    assert set(uploads.seen) == {UpdateUploaded, UpdateReceived}
    assert uploads.seen.count(UpdateUploaded) == uploads.seen.count(UpdateReceived) == watched.updates_accepted
    assert flasync.run(config).weights_sha256 == watched.weights_sha256


def test_a_recorder_lists_the_uploads_of_a_batch_one_by_one() -> None:
    """An :class:`EventRecorder` takes batches and records their events one by one, in order: its record reads as
    if every upload, and every update received, had travelled alone."""
    config = small_config(
        "executor.kind=vectorized", "server={kind: fedavg, clients_per_round: 8}", "population.speed={kind: constant}"
    )
    federation = flasync.Federation(config)
    recorder = EventRecorder(federation.bus)
    summary = run_loop(federation.run())
    uploads = recorder.of(UpdateUploaded)
    assert len(uploads) == summary.updates_accepted + summary.updates_dropped
    assert len(recorder.of(UpdateReceived)) == summary.updates_accepted
    assert not recorder.of(UpdatesUploaded) and not recorder.of(UpdatesReceived) and not recorder.of(TasksAssigned)
    assert len(recorder.of(TaskAssigned)) == summary.tasks_dispatched
    assert federation.bus.statistics().published < len(recorder.events)  # some uploads did travel together
    assert [u.task_id for u in uploads] == sorted(u.task_id for u in uploads)  # a round's uploads in task order


@pytest.mark.parametrize("speed", ["constant", "lognormal"])
def test_a_groups_uploads_are_those_of_the_path_that_keeps_each_tasks_line(
    speed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group whose tasks all train, with nothing to keep and no window to miss, puts its uploads on its agenda in
    one pass: the uploads published (every field but the real-time ones, in order) and the weights are those of the
    same run whose debug lines send each task through the general path."""
    published: list[list[tuple[Any, ...]]] = [[], []]
    passes: list[int] = [0, 0]
    uploads, due = client_module._uploads, client_module._uploads_due
    timing = {"sent_wall_s", "compute_s", "encode_s"}

    def recorded(*args: Any) -> list[UpdateUploaded]:
        sent = uploads(*args)
        published[run].extend(tuple(getattr(m, f) for f in m.__dataclass_fields__ if f not in timing) for m in sent)
        return sent

    def counted(*args: Any) -> Any:
        passes[run] += 1
        return due(*args)

    monkeypatch.setattr(client_module, "_uploads", recorded)
    monkeypatch.setattr(client_module, "_uploads_due", counted)
    overrides = (
        "executor.kind=vectorized",
        "server={kind: fedavg, clients_per_round: 12}",
        f"population.speed={{kind: {speed}}}",
        "stop.max_versions=4",
    )
    run = 0
    plain = flasync.run(small_config(*overrides))
    run = 1
    general = flasync.run(small_config(*overrides, "tracking.log_level=debug"))
    assert passes[0] > 0 and passes[1] == 0  # each run took the path it stands for
    assert len(published[0]) == plain.updates_accepted == 48
    assert published[0] == published[1]
    assert plain.weights_sha256 == general.weights_sha256


_WALL_CLOCK = frozenset(
    {"sent_wall_s", "compute_s", "encode_s", "decode_s", "queue_wait_s", "wall_s", "eval_s", "aggregate_s"}
)
"""Event fields that read real time (they differ between any two runs)."""


def _event_stream(overrides: tuple[str, ...], *, share: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Run FedBuff with the registry told to ``share`` (or not) whatever the run's world; return every event (its
    type and every field but those of real time) in order, the run's summary and the size of each group started."""
    sizes: list[int] = []
    run_group = client_module.CohortClients.run
    registry = build_module.TaskRegistry

    async def counted(self: client_module.CohortClients, tasks: Any, model: Any) -> None:
        sizes.append(len(tasks))
        await run_group(self, tasks, model)

    def told(**kwargs: Any) -> TaskRegistry:
        return registry(**{**kwargs, "share": share})

    with monkeypatch.context() as patch:
        patch.setattr(client_module.CohortClients, "run", counted)
        patch.setattr(build_module, "TaskRegistry", told)
        federation = flasync.Federation(small_config("executor.kind=vectorized", *overrides))
        recorder = EventRecorder(federation.bus)
        summary = run_loop(federation.run())
    events = [
        (type(event).__name__, *((f.name, getattr(event, f.name)) for f in fields(event) if f.name not in _WALL_CLOCK))
        for event in recorder.events
    ]
    return events, summary, sizes


@pytest.mark.parametrize(
    ("overrides", "apart"),
    [
        pytest.param(("population.speed={kind: lognormal}",), True, id="lognormal"),
        pytest.param(("population.speed={kind: constant}",), False, id="constant"),
        pytest.param(
            ("population.speed={kind: lognormal}", "faults={crash: 0.15, dropout: 0.15}"), True, id="lognormal-faults"
        ),
        pytest.param(
            ("population.speed={kind: constant}", "faults={crash: 0.15, dropout: 0.15}"), False, id="constant-faults"
        ),
    ],
)
def test_a_fedbuff_runs_events_are_those_of_groups_of_one(
    overrides: tuple[str, ...], apart: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FedBuff with the tasks dispatched on one model before the first starts run in one coroutine, and with each
    task in a coroutine of its own: every event with every field but those of real time, in the same order, and the
    same weights, where no two uploads are due at one time (lognormal speeds). Where they are (constant speeds), a
    group publishes its uploads due at one time together, before the server takes the first of them, and the server
    takes them up to the next version before it announces the tasks that refilled their slots: each kind of event
    keeps its order, every field and its version (the same events between two versions). Crash and dropout faults,
    decided per task, leave the same events in a group as alone."""
    grouped, together, sizes = _event_stream(overrides, share=True, monkeypatch=monkeypatch)
    alone, apart_summary, alone_sizes = _event_stream(overrides, share=False, monkeypatch=monkeypatch)
    assert max(sizes) > 1 and set(alone_sizes) == {1}  # each run took the path it stands for
    assert together.weights_sha256 == apart_summary.weights_sha256
    assert together.updates_accepted == apart_summary.updates_accepted > 0
    if "faults" in overrides[-1]:
        assert together.updates_failed > 0
    for kind in {event[0] for event in alone}:
        assert [e for e in grouped if e[0] == kind] == [e for e in alone if e[0] == kind]
    assert _between_versions(grouped) == _between_versions(alone)
    assert (grouped == alone) is apart


def _between_versions(events: list[Any]) -> list[list[str]]:
    """The server's events of each stretch between two versions (each stretch ends at an ``Aggregated``), in a fixed
    order (uploads a group publishes together may precede a version the server makes before it takes them)."""
    stretches: list[list[str]] = [[]]
    for event in events:
        if event[0] != "UpdateUploaded":
            stretches[-1].append(repr(event))
        if event[0] == "Aggregated":
            stretches.append([])
    return [sorted(stretch) for stretch in stretches]
