"""Client-side evaluation's plug-in: which tasks evaluate, and how the server closes a version's evaluation."""

from __future__ import annotations

from typing import Any

import pytest

from flasync.algorithms.client_eval import EvaluationSummary, Selection, evaluates
from flasync.core.events import ClientEvaluated, ClientId, RunFinished, Version


class _Log:
    """Keeps the lines it is given."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))

    def debug(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))

    def closed(self) -> list[tuple[int, int, str]]:
        """(version, reports, why) of each version closed, in order."""
        return [(f["version"], f["reports"], f["closed_by"]) for e, f in self.lines if e == "client_eval.version"]


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _report(version: int, accuracy: float, samples: int = 10, client: int = 0) -> ClientEvaluated:
    return ClientEvaluated(
        client_id=ClientId(client),
        task_id=0,
        version=Version(version),
        when="before",
        num_samples=samples,
        accuracy=accuracy,
        loss=1.0 - accuracy,
    )


def _summary(min_reports: int = 2, deadline_s: float | None = None) -> tuple[EvaluationSummary, _Log, _Clock]:
    log, clock = _Log(), _Clock()
    return (
        EvaluationSummary(["accuracy", "loss"], min_reports=min_reports, deadline_s=deadline_s, now=clock, log=log),
        log,
        clock,
    )


def test_a_fraction_of_tasks_evaluates_the_same_ones_every_time() -> None:
    """The draw is keyed by client and participation: repeatable, and about the fraction asked for."""
    selection = Selection(seed=3, fraction=0.1)
    chosen = [evaluates(selection, client, p) for client in range(100) for p in range(50)]
    assert chosen == [evaluates(selection, client, p) for client in range(100) for p in range(50)]
    assert 0.08 < sum(chosen) / len(chosen) < 0.12
    assert not any(evaluates(Selection(seed=3), client, 0) for client in range(100))


def test_every_nth_participation_evaluates() -> None:
    """every = 3: each client's 1st, 4th, 7th ... task."""
    assert [evaluates(Selection(seed=0, every=3), 5, p) for p in range(7)] == [1, 0, 0, 1, 0, 0, 1]


def test_reports_close_their_own_version_once_enough_arrived() -> None:
    """Reports count towards the version they evaluated, whatever arrives between; a late one is counted apart."""
    summary, log, _ = _summary(min_reports=2)
    for event in (_report(0, 0.5), _report(1, 0.6), _report(0, 0.7), _report(0, 0.9), _report(1, 0.8)):
        summary.event_published(event)
    assert log.closed() == [(0, 2, "min_reports"), (1, 2, "min_reports")]
    assert summary.late == 1
    means = [f["mean"] for e, f in log.lines if e == "client_eval.accuracy"]
    assert means == pytest.approx([0.6, 0.7])


def test_a_deadline_closes_a_version_with_the_reports_it_has() -> None:
    """A version published at t closes at the first report or version made at or after t + deadline_s."""
    summary, log, clock = _summary(min_reports=5, deadline_s=2.0)
    clock.t = 1.0
    summary.version_made(1, log)
    summary.event_published(_report(1, 0.4))
    clock.t = 2.5
    summary.event_published(_report(1, 0.6))
    assert log.closed() == []
    clock.t = 3.0
    summary.version_made(2, log)
    assert log.closed() == [(1, 2, "deadline")]


def test_the_run_end_closes_what_is_open_unless_it_was_interrupted() -> None:
    """Finishing closes open versions; an interrupted run keeps them open for the resumed one."""
    summary, log, _ = _summary(min_reports=5)
    summary.event_published(_report(3, 0.5))
    summary.event_published(RunFinished(reason="interrupted", versions=3, updates_accepted=0, simulated_s=0, wall_s=0))
    assert log.closed() == []
    state = summary.state_dict()
    resumed, resumed_log, _ = _summary(min_reports=5)
    resumed.load_state_dict(state)
    resumed.event_published(RunFinished(reason="max_versions", versions=4, updates_accepted=0, simulated_s=0, wall_s=0))
    assert resumed_log.closed() == [(3, 1, "end")]


def test_a_client_without_held_out_samples_does_not_evaluate() -> None:
    """A task is given an evaluation part only when chosen and when its client holds out a sample."""
    import torch

    from flasync.algorithms.client_eval import ClientEvaluation
    from flasync.core.events import TaskAssigned
    from flasync.core.snapshots import ModelSnapshot
    from flasync.training.metrics import MetricSet

    rows = {0: torch.arange(3), 1: torch.arange(0)}
    x, y = torch.zeros(3, 2), torch.zeros(3, dtype=torch.long)
    plugin = ClientEvaluation(
        Selection(seed=0, every=1),
        "before",
        lambda client: (x, y, rows[client]),
        models=None,  # type: ignore[arg-type]  # no evaluation runs here
        metrics=MetricSet(),
        publish=lambda event: None,
        now=lambda: 0.0,
    )
    weights = torch.zeros(4)
    model = ModelSnapshot(version=Version(0), weights=weights, exact=weights, download_bytes=16)

    def task(client: int) -> TaskAssigned:
        return TaskAssigned(
            task_id=client, client_id=ClientId(client), participation=0, base_version=Version(0), simulated_s=0.0
        )

    assert plugin.task(task(0), model) is not None
    assert plugin.task(task(1), model) is None
