"""Faults in whole runs: crashes, hangs, dropouts, availability and quorum rounds as the server accounts for them."""

from __future__ import annotations

import pytest

import flasync
from flasync.clients.simulated.faults import Fate, FaultModel
from flasync.core.errors import TrainingError
from flasync.core.events import (
    Aggregated,
    ClientFailed,
    ClientTimedOut,
    RoundDeadlinePassed,
    TaskAssigned,
    UpdateReceived,
    UpdateRejected,
)
from flasync.testing import EventRecorder, MemoryTracker, UntrainableModel, small_config

FAULTY = ("faults.crash=0.3", "faults.hang=0.1", "resilience.task_timeout_s=10")


# ------------------------------------------------------------------------------------------------ async runs
def _closing_events(recorder: EventRecorder) -> dict[int, object]:
    closed: dict[int, object] = {}
    for event in recorder.events:
        if isinstance(event, ClientFailed | ClientTimedOut | UpdateReceived | UpdateRejected):
            closed.setdefault(event.task_id, event)
    return closed


async def test_crashing_and_hanging_clients_give_exact_predicted_counts() -> None:
    """30% crashing and 10% hanging clients: the run finishes, and each closed task ended as its seeded fate says."""
    config = small_config(*FAULTY)
    tracker = MemoryTracker()
    federation = flasync.Federation(config, tracker=tracker)
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()

    assert summary.stop_reason == "max_versions" and summary.versions == 12
    assert tracker.status == "FINISHED"
    model = FaultModel(config.faults, config.seed, config.population.num_clients)
    assigned = recorder.of(TaskAssigned)
    assert len(assigned) == summary.tasks_dispatched
    closed = _closing_events(recorder)
    predicted = {fate: 0 for fate in Fate}
    for task in assigned:
        if task.task_id not in closed:
            continue  # still in flight when the run stopped (cancelled)
        fate = model.fate(task.client_id, task.participation).fate
        predicted[fate] += 1
        event = closed[task.task_id]
        expected = {
            Fate.CRASH: ClientFailed,
            Fate.HANG: ClientTimedOut,
            Fate.OK: UpdateReceived,
        }[fate]
        assert isinstance(event, expected), (task, fate, event)
    assert summary.tasks_dispatched - len(closed) <= config.server.concurrency  # type: ignore[union-attr]
    assert summary.updates_failed == predicted[Fate.CRASH] == recorder.count(ClientFailed) > 0
    assert summary.tasks_timed_out == predicted[Fate.HANG] == recorder.count(ClientTimedOut) > 0
    assert summary.updates_accepted == predicted[Fate.OK] == 12 * 4
    assert {e.kind for e in recorder.of(ClientFailed)} == {"crash"}
    # The figures are metrics and final tags too.
    assert tracker.history("server/timeout/timed_out")[-1][1] == summary.tasks_timed_out
    assert tracker.tags["finished.updates_failed"] == str(summary.updates_failed)


@pytest.mark.slow
def test_faulty_runs_are_deterministic() -> None:
    """The same faulty config gives the same weights and the same counts, with one or two training threads."""
    first = flasync.run(small_config(*FAULTY, "faults.dropout=0.1", "executor.workers=1"))
    second = flasync.run(small_config(*FAULTY, "faults.dropout=0.1", "executor.workers=2"))
    assert first.weights_sha256 == second.weights_sha256
    assert (first.updates_failed, first.tasks_timed_out) == (second.updates_failed, second.tasks_timed_out)


async def test_dropouts_are_failures_of_their_own_kind() -> None:
    """A client that leaves mid-training is a ClientFailed(kind="dropout") at a time before its training would end."""
    federation = flasync.Federation(small_config("faults.dropout=0.3"))
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    failed = recorder.of(ClientFailed)
    assert failed and {e.kind for e in failed} == {"dropout"}
    assert summary.updates_failed == len(failed)
    dispatched = {t.task_id: t for t in recorder.of(TaskAssigned)}
    assert all(e.simulated_s > dispatched[e.task_id].simulated_s for e in failed)


async def test_injected_faults_never_trip_the_broken_model_guard() -> None:
    """Even when most tasks crash, the run finishes: only genuine training errors count as a broken model."""
    federation = flasync.Federation(small_config("faults.crash=0.9", "stop.max_versions=3"))
    summary = await federation.run()
    assert summary.versions == 3
    assert summary.updates_failed > 40  # far beyond the guard's limit of 30 failures in a row


async def test_a_genuinely_broken_model_still_fails_the_run() -> None:
    """With injected faults on, a model that cannot train still ends the run with TrainingError."""

    tracker = MemoryTracker()
    federation = flasync.Federation(small_config("faults.crash=0.3"), model_factory=UntrainableModel, tracker=tracker)
    with pytest.raises(TrainingError, match="cannot train"):
        await federation.run()
    assert tracker.status == "FAILED"


async def test_availability_windows_limit_who_is_sampled() -> None:
    """Only online clients get tasks; clients whose window closes mid-task fail as "offline"; the run finishes."""
    config = small_config("faults.availability.period_s=5", "faults.availability.online_fraction=0.4")
    model = FaultModel(config.faults, config.seed, config.population.num_clients)
    federation = flasync.Federation(config)
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    assert summary.versions == 12
    for task in recorder.of(TaskAssigned):
        assert model.online(task.client_id, task.simulated_s)
    failed = recorder.of(ClientFailed)
    assert {e.kind for e in failed} <= {"offline"}
    assert all(not model.online(e.client_id, e.simulated_s + 1e-6) for e in failed)


# ------------------------------------------------------------------------------------------------- sync rounds
def _fedavg(*overrides: str) -> flasync.RunConfig:
    return small_config(*overrides, server={"kind": "fedavg", "clients_per_round": 5})


async def test_sync_rounds_close_at_quorum_with_over_selection() -> None:
    """Over-selected rounds close once the quorum answered; the rest are abandoned, not failed."""
    federation = flasync.Federation(_fedavg("resilience.over_selection=0.6", "resilience.round_quorum=0.6"))
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    assert summary.versions == 12
    assert {e.num_updates for e in recorder.of(Aggregated)} == {3}  # ceil(0.6 * 5)
    assert summary.tasks_dispatched == 12 * 8  # ceil(1.6 * 5) per round
    assert summary.tasks_abandoned == 12 * 5
    assert summary.updates_failed == 0


async def test_sync_rounds_survive_hanging_clients_by_deadline() -> None:
    """With hanging clients and no quorum shortcut, each round closes at its deadline with those that answered."""
    federation = flasync.Federation(
        _fedavg("faults.hang=0.3", "resilience.task_timeout_s=100", "resilience.round_deadline_s=5")
    )
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    assert summary.versions == 12
    assert recorder.count(RoundDeadlinePassed) > 0
    assert summary.tasks_timed_out == 0  # the deadline came first; the hanging tasks were abandoned
    assert summary.tasks_abandoned > 0
    aggregated = recorder.of(Aggregated)
    assert all(1 <= e.num_updates <= 5 for e in aggregated) and min(e.num_updates for e in aggregated) < 5


async def test_sync_rounds_count_failures_and_refill_nothing() -> None:
    """Crashing members of a round are failures; the round aggregates the ones that answered."""
    federation = flasync.Federation(_fedavg("faults.crash=0.3"))
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    assert summary.versions == 12
    assert summary.updates_failed == recorder.count(ClientFailed) > 0
    assert summary.updates_accepted + summary.updates_failed == summary.tasks_dispatched == 60


@pytest.mark.slow
async def test_a_norm_bound_on_a_robust_reference_refuses_the_attackers_only() -> None:
    """10% sign-flip attackers (-20x): with resilience.norm_bound_factor every refused update is an attacker's,
    and the model ends better than without the defence."""
    from flasync.clients.simulated.faults import FaultModel
    from flasync.core.events import UpdateRejected

    attack = {"faults.byzantine": "0.1"}
    overrides = [f"{k}={v}" for k, v in attack.items()]
    undefended = await flasync.Federation(small_config(*overrides, "stop.max_versions=20")).run()
    federation = flasync.Federation(small_config(*overrides, "stop.max_versions=20", "resilience.norm_bound_factor=3"))
    recorder = EventRecorder(federation.bus)
    defended = await federation.run()
    attackers = FaultModel(federation.config.faults, federation.config.seed, 20).attackers
    refused = {e.client_id for e in recorder.of(UpdateRejected) if e.reason == "norm_bound"}
    assert refused and refused <= attackers
    assert defended.accuracy > undefended.accuracy
