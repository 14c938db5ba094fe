"""The best version of a run: which evaluation wins, and what a run without one logs and registers."""

from __future__ import annotations

import math

import pytest
import torch

from flasync.core.bus import EventBus
from flasync.core.events import Evaluated, Version
from flasync.core.snapshots import ModelSnapshot
from flasync.observe.summary import RunSummary
from flasync.runtime.selection import BEST_MODEL, LAST_MODEL, BestVersion, better, run_models, with_best
from flasync.testing import small_config


def _snapshot(version: int) -> ModelSnapshot:
    weights = torch.full((3,), float(version))
    return ModelSnapshot(version=Version(version), weights=weights, exact=weights.clone(), download_bytes=12)


def _evaluate(bus: EventBus, version: int, accuracy: float, loss: float = 1.0) -> None:
    bus.publish_nowait(Evaluated(version=Version(version), accuracy=accuracy, loss=loss, simulated_s=0.0, wall_s=0.0))


def _keeper(select: str) -> tuple[EventBus, BestVersion]:
    bus = EventBus()
    return bus, BestVersion(select, lambda version: _snapshot(int(version))).attach(bus)


def test_the_highest_accuracy_wins_and_a_tie_keeps_the_earlier_version() -> None:
    """With :max, a later version replaces the best only when strictly better."""
    bus, keeper = _keeper("server/eval/accuracy:max")
    for version, accuracy in [(0, 0.1), (1, 0.6), (2, 0.5), (3, 0.6), (4, 0.55)]:
        _evaluate(bus, version, accuracy)
    assert keeper.best is not None
    assert (keeper.best.version, keeper.best.value) == (1, 0.6)
    assert torch.equal(keeper.best.weights, torch.full((3,), 1.0))


def test_the_lowest_loss_wins_and_nan_never_does() -> None:
    """With :min, the smallest finite loss is kept; a NaN figure is passed over."""
    bus, keeper = _keeper("server/eval/loss:min")
    for version, loss in [(0, 2.0), (1, math.nan), (2, 0.7), (3, 0.9)]:
        _evaluate(bus, version, 0.5, loss)
    assert keeper.best is not None and keeper.best.version == 2


def test_the_weights_kept_are_a_copy() -> None:
    """The weights kept do not change when the published model's tensor does."""
    snapshot = _snapshot(5)
    bus = EventBus()
    keeper = BestVersion("server/eval/accuracy:max", lambda version: snapshot).attach(bus)
    _evaluate(bus, 5, 0.9)
    snapshot.exact.add_(1.0)
    assert keeper.best is not None and torch.equal(keeper.best.weights, torch.full((3,), 5.0))


@pytest.mark.parametrize(
    ("value", "than", "direction", "expected"),
    [(0.9, 0.8, "max", True), (0.8, 0.8, "max", False), (0.7, 0.8, "min", True), (math.nan, 0.1, "max", False)],
)
def test_better_is_strict(value: float, than: float, direction: str, expected: bool) -> None:
    """Only a strictly better, non-NaN value is better."""
    assert better(value, than, direction) is expected


def test_a_run_without_a_selection_logs_and_registers_its_last_model_by_accuracy() -> None:
    """Without eval.select, the last model alone is logged, rated by the final accuracy."""
    summary = RunSummary(**{**_SUMMARY, "accuracy": 0.8, "versions": 12})
    [last] = run_models(summary, torch.zeros(3), None, small_config().eval.select)
    assert (last.name, last.version, last.metric, last.direction, last.value) == (
        LAST_MODEL,
        12,
        "server/eval/accuracy",
        "max",
        0.8,
    )
    assert with_best(summary, None) is summary


def test_a_selection_puts_the_best_model_last_and_in_the_summary() -> None:
    """With a best version, both models are logged, the best one last (the one registered)."""
    bus, keeper = _keeper("server/eval/loss:min")
    _evaluate(bus, 3, 0.5, 0.25)
    summary = with_best(RunSummary(**{**_SUMMARY, "loss": 0.5}), keeper)
    assert (summary.best_version, summary.best_metric, summary.best_value) == (3, "server/eval/loss:min", 0.25)
    last, best = run_models(summary, torch.zeros(3), keeper.best, "server/eval/loss:min")
    assert (last.name, last.value, best.name, best.version) == (LAST_MODEL, 0.5, BEST_MODEL, 3)
    assert best.tags == {
        "flasync.version": "3",
        "flasync.metric": "server/eval/loss",
        "flasync.direction": "min",
        "flasync.value": "0.25",
    }


_SUMMARY = {
    "run_id": None,
    "accuracy": 0.5,
    "loss": 1.0,
    "updates_accepted": 0,
    "updates_dropped": 0,
    "updates_failed": 0,
    "tasks_dispatched": 0,
    "tasks_timed_out": 0,
    "tasks_abandoned": 0,
    "versions": 4,
    "wall_s": 1.0,
    "simulated_s": 1.0,
    "upload_bytes": 0,
    "download_bytes": 0,
    "staleness_mean": 0.0,
    "staleness_max": 0,
    "upload_compression": 1.0,
    "updates_per_s": 0.0,
    "stop_reason": "max_versions",
    "weights_sha256": "",
}


def test_a_client_side_metric_selects_the_version_whose_evaluation_closed_best() -> None:
    """The weights are copied at a version's first report (while current) and the best is decided when its
    evaluation closes, even after newer versions were made; a version that closes worse is forgotten."""
    from flasync.core.events import ClientEvaluated, ClientId, ClientsEvaluated

    current = {"version": 0}
    bus = EventBus()
    keeper = BestVersion(
        "client_eval/accuracy/p10:max",
        lambda v: _snapshot(int(v)) if int(v) == current["version"] else None,
    ).attach(bus)

    def report(version: int) -> None:
        bus.publish_nowait(
            ClientEvaluated(
                client_id=ClientId(0),
                task_id=0,
                version=Version(version),
                when="before",
                num_samples=3,
                accuracy=0.5,
                loss=1.0,
            )
        )

    def closed(version: int, p10: float) -> None:
        figures = {"accuracy": {"mean": 0.5, "p10": p10, "p50": 0.5, "p90": 0.5, "worst10": 0.1}}
        bus.publish_nowait(
            ClientsEvaluated(version=Version(version), reports=1, samples=3, figures=figures, closed_by="end")
        )

    report(0)
    current["version"] = 1
    report(1)
    current["version"] = 3
    closed(1, 0.4)  # closes after version 3 was made: its weights were copied at its first report
    closed(0, 0.3)
    assert keeper.best is not None and (keeper.best.version, keeper.best.value) == (1, 0.4)
    assert torch.equal(keeper.best.weights, torch.full((3,), 1.0))
    assert keeper._pending == {}
