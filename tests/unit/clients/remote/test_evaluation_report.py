"""A remote client's evaluation report: what the server takes, what it refuses, and the event it makes of it."""

from __future__ import annotations

import math

import pytest

from flasync.clients.remote.transport import Report
from flasync.core.events import ClientId, TaskAssigned, Version

_GOOD = {"num_samples": 12, "accuracy": 0.75, "loss": 0.6, "when": "after", "eval_s": 0.01, "metrics": {"f1": 0.7}}


def _report(evaluation: object) -> Report:
    return Report.from_json(
        {"num_samples": 30, "train_loss": 1.0, "evaluation": evaluation}, max_num_samples=1000, metric_names=("f1",)
    )


def test_an_evaluation_becomes_a_report_of_the_tasks_version() -> None:
    """The report counts towards the task's base version, whatever the client might claim."""
    task = TaskAssigned(task_id=7, client_id=ClientId(3), participation=2, base_version=Version(5), simulated_s=0.0)
    evaluation = _report(_GOOD).evaluation
    assert evaluation is not None
    event = evaluation.event(ClientId(3), task, 9.5)
    assert (event.version, event.task_id, event.when, event.num_samples) == (5, 7, "after", 12)
    assert event.figures() == {"accuracy": 0.75, "loss": 0.6, "f1": 0.7}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"accuracy": 1.5}, "evaluation.accuracy must be in 0 .. 1"),
        ({"loss": math.nan}, "evaluation.loss must be a finite number"),
        ({"num_samples": -1}, "evaluation.num_samples must be an integer"),
        ({"when": "during"}, "evaluation.when must be 'before' or 'after'"),
        ({"metrics": {}}, "evaluation.metrics must hold exactly this run's metrics: ['f1']"),
        ({"metrics": {"f1": 0.5, "auc": 0.5}}, "exactly this run's metrics"),
        ({"metrics": {"f1": "high"}}, "evaluation.metrics.f1 must be a finite number"),
        ({"client_id": 4}, "unknown evaluation field 'client_id'"),
    ],
)
def test_a_bad_evaluation_is_refused(change: dict[str, object], message: str) -> None:
    """Out-of-range, non-finite, unknown or missing fields are refused with one line naming them."""
    with pytest.raises(ValueError, match="evaluation") as caught:
        _report({**_GOOD, **change})
    assert message in str(caught.value)


def test_a_report_without_an_evaluation_has_none() -> None:
    """An update without an evaluation is the plain report it was."""
    assert Report.from_json({"num_samples": 3, "train_loss": 0.5}, max_num_samples=10).evaluation is None
