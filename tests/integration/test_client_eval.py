"""Client-side evaluation in whole runs: the figures, their versions, determinism, resume, and the batched path."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from collections import defaultdict
from typing import Any

import numpy as np
import pytest

import flasync
from flasync.algorithms import client_eval
from flasync.core.client_table import TABLE_ARTIFACT as CLIENT_TABLE
from flasync.core.events import ClientEvaluated, ClientsEvaluated, TaskAssigned
from flasync.runtime import checkpoint
from flasync.testing import EventRecorder, MemoryTracker, small_config
from tests.conftest import interrupt_at

pytestmark = pytest.mark.slow

_ON = ("eval.clients.fraction=0.4", "eval.clients.min_reports=3")
_EVAL_S = "client_eval/version/eval_s"
_BRIER = "eval.metrics=[f1, brier=tests.unit.training.user_metric:Brier]"


def _run(*overrides: str, **sections: Any) -> tuple[flasync.RunSummary, MemoryTracker, EventRecorder]:
    tracker = MemoryTracker()
    federation = flasync.Federation(small_config(*overrides, **sections), tracker=tracker)
    recorder = EventRecorder(federation.bus)
    summary = asyncio.run(federation.run())
    return summary, tracker, recorder


def _series(tracker: MemoryTracker) -> dict[str, list[tuple[int, float]]]:
    """Every client_eval series but the evaluations' real seconds."""
    keys = sorted(tracker.metric_keys())
    return {key: tracker.history(key) for key in keys if key.startswith("client_eval/") and key != _EVAL_S}


def test_the_logged_figures_are_the_reports_summed_up_per_version() -> None:
    """Each closed version's mean is the reports' sample-weighted mean, its p50 the median of the clients' figures,
    its worst decile the lowest accuracy (highest loss) of the reports, from the reports counted towards it."""
    summary, tracker, recorder = _run(*_ON)
    last = recorder.of(ClientsEvaluated)[-1]
    assert (summary.client_eval_version, summary.client_eval) == (last.version, last.figures)
    by_version: dict[int, list[ClientEvaluated]] = defaultdict(list)
    for report in recorder.of(ClientEvaluated):
        by_version[int(report.version)].append(report)
    counts = dict(tracker.history("client_eval/version/reports"))
    total = len(recorder.of(ClientEvaluated))
    assert counts and all(len(by_version[v]) >= count for v, count in counts.items())
    assert tracker.history("client_eval/version/late")[-1][1] <= total - sum(counts.values())
    mean, p50 = dict(tracker.history("client_eval/accuracy/mean")), dict(tracker.history("client_eval/accuracy/p50"))
    worst_acc = dict(tracker.history("client_eval/accuracy/worst10"))
    worst_loss = dict(tracker.history("client_eval/loss/worst10"))
    for version, count in counts.items():
        reports = by_version[version][: int(count)]  # reports after the version closed are late, not counted
        samples = sum(r.num_samples for r in reports)
        assert mean[version] == pytest.approx(sum(r.num_samples * r.accuracy for r in reports) / samples)
        assert p50[version] == pytest.approx(float(np.median([r.accuracy for r in reports])))
        assert worst_acc[version] == min(r.accuracy for r in reports)  # fewer than 10 reports: the worst one
        assert worst_loss[version] == max(r.loss for r in reports)


def test_each_report_counts_towards_the_version_its_client_downloaded() -> None:
    """In an asynchronous run, a report's version is its task's base version, and versions close in any order."""
    _, _, recorder = _run("eval.clients.fraction=1.0", server={"kind": "fedasync", "concurrency": 8})
    base = {task.task_id: int(task.base_version) for task in recorder.of(TaskAssigned)}
    reports = recorder.of(ClientEvaluated)
    assert reports and all(int(r.version) == base[r.task_id] for r in reports)
    assert len({int(r.version) for r in reports}) > 5
    assert any(a.version > b.version for a, b in itertools.pairwise(reports))  # stale reports arrive


def test_the_deadline_closes_a_version_in_simulated_time() -> None:
    """With a deadline and more reports needed than arrive, versions close by their deadline, the same in every run."""
    on = ("eval.clients.fraction=0.4", "eval.clients.min_reports=1000", "eval.clients.deadline_s=1.5")
    first, second = _run(*on), _run(*on)
    assert _series(first[1]) == _series(second[1])
    assert len(first[1].history("client_eval/version/reports")) > 2


def test_one_and_two_workers_give_the_same_weights_and_evaluation_series() -> None:
    """The weights and every client_eval series are the same with one worker thread and with two."""
    one = _run(*_ON, _BRIER, "executor.kind=thread", "executor.workers=1")
    two = _run(*_ON, _BRIER, "executor.kind=thread", "executor.workers=2")
    assert one[0].weights_sha256 == two[0].weights_sha256
    assert _series(one[1]) == _series(two[1])
    assert "client_eval/brier/mean" in _series(one[1]) and "client_eval/f1/p10" in _series(one[1])


def test_the_vectorized_path_evaluates_as_the_threads_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cohort's evaluations, batched together, report what one evaluation per task reports (a user's metric too)."""
    threads = _run(*_ON, _BRIER, "executor.kind=thread")
    segments: list[int] = []
    batched = client_eval.evaluate_segments

    def counted(*args: Any, **kwargs: Any) -> Any:
        segments.append(len(args[4]))
        return batched(*args, **kwargs)

    monkeypatch.setattr(client_eval, "evaluate_segments", counted)
    cohorts = _run(*_ON, _BRIER, "executor.kind=vectorized")
    assert max(segments) > 1  # some cohort's members evaluated in one call

    def reports(recorder: EventRecorder) -> dict[int, ClientEvaluated]:
        return {r.task_id: r for r in recorder.of(ClientEvaluated)}

    a, b = reports(threads[2]), reports(cohorts[2])
    assert a.keys() == b.keys() and len(a) > 5
    for task_id, report in a.items():
        other = b[task_id]
        assert (other.version, other.num_samples, other.accuracy) == (
            report.version,
            report.num_samples,
            report.accuracy,
        )
        assert other.loss == pytest.approx(report.loss, rel=1e-5)
        assert other.metrics["brier"] == pytest.approx(report.metrics["brier"], rel=1e-5)


def test_evaluating_after_training_reports_the_trained_model() -> None:
    """when = "after" evaluates the model each client trained: on its own data it beats the downloaded one."""
    before = _run(*_ON, "executor.kind=thread")[2].of(ClientEvaluated)
    after = _run(*_ON, "executor.kind=thread", "eval.clients.when=after")[2].of(ClientEvaluated)
    assert [r.task_id for r in before] == [r.task_id for r in after]
    assert all(r.when == "after" for r in after)
    assert sum(r.loss for r in after) < sum(r.loss for r in before)


def test_client_evaluation_off_changes_nothing_and_on_changes_only_the_split() -> None:
    """With the split but no evaluation, a run trains as with evaluation on 40% of tasks (the reports cost no
    training), and logs no client_eval key."""
    split_only = _run("eval.clients.held_out=0.2")
    evaluated = _run(*_ON)
    assert split_only[0].weights_sha256 == evaluated[0].weights_sha256
    assert not _series(split_only[1]) and _series(evaluated[1])


def test_the_best_version_by_a_client_side_figure_is_kept() -> None:
    """eval.select on client_eval/accuracy/p10 keeps the version whose closed evaluation had the best p10 (the
    first to reach it), with that version's weights."""
    summary, _, recorder = _run(*_ON, "eval.select=client_eval/accuracy/p10:max")
    best_version, best_value = -1, -1.0
    for closed in recorder.of(ClientsEvaluated):
        if closed.figures["accuracy"]["p10"] > best_value:
            best_version, best_value = int(closed.version), closed.figures["accuracy"]["p10"]
    assert (summary.best_version, summary.best_value) == (best_version, best_value)
    assert summary.best_metric == "client_eval/accuracy/p10:max"
    stopped = flasync.run(small_config(*_ON, f"stop.max_versions={best_version}"))
    assert summary.best_weights_sha256 == stopped.weights_sha256


def test_a_resumed_run_gives_the_uninterrupted_weights_and_evaluation_series() -> None:
    """Stopped mid-way and resumed from its checkpoint, a run ends with the same weights, and its evaluation series
    (the stopped part's points, then the resumed part's) are those of the run uninterrupted."""
    config = small_config(*_ON, "stop.max_versions=16")
    full, full_tracker, _ = _run(*_ON, "stop.max_versions=16")
    stopped = asyncio.run(interrupt_at(config, 6))[0]
    saved, state = checkpoint.decode(checkpoint.latest(stopped.artifacts))
    resumed_tracker = MemoryTracker()
    resumed = flasync.run(saved, resume=checkpoint.ResumePoint(None, state), tracker=resumed_tracker)
    assert resumed.weights_sha256 == full.weights_sha256
    assert (resumed.client_eval_version, resumed.client_eval) == (full.client_eval_version, full.client_eval)
    joined: dict[str, Any] = {}
    for key in _series(full_tracker):
        joined[key] = stopped.history(key) + resumed_tracker.history(key)
    assert joined == _series(full_tracker)
    assert not math.isnan(full_tracker.history("client_eval/accuracy/mean")[-1][1])


def test_each_clients_last_report_is_its_row_in_the_client_table() -> None:
    """With the per-client table on, a client's row holds the figures of its last client-side evaluation report
    (late ones included), and clients that never reported have no figure."""
    _, tracker, recorder = _run(*_ON, "tracking.client_table=true")
    last: dict[int, ClientEvaluated] = {}
    for report in recorder.of(ClientEvaluated):
        last[int(report.client_id)] = report
    assert last
    table = json.loads(tracker.artifacts[CLIENT_TABLE])
    columns = table["columns"]
    accuracy, loss = columns.index("eval.accuracy"), columns.index("eval.loss")
    rows = {int(row[columns.index("client_id")]): row for row in table["data"]}
    for client, row in rows.items():
        report = last.get(client)
        if report is None:
            assert row[accuracy] is None or (isinstance(row[accuracy], float) and math.isnan(row[accuracy]))
        else:
            assert (row[accuracy], row[loss]) == pytest.approx((report.accuracy, report.loss))
    assert set(last) <= set(rows)
