"""The best version of a whole run (eval.select): which version it keeps, and that keeping it changes nothing else."""

from __future__ import annotations

import asyncio

import pytest

import flasync
from flasync.core.events import Evaluated
from flasync.testing import EventRecorder, small_config

# The small run evaluated at every version: its accuracy peaks at version 11 (0.774) and falls at version 12 (0.735).
_EVERY_VERSION = "eval.every_versions=1"


@pytest.mark.slow
def test_the_best_version_is_kept_where_the_accuracy_is_not_monotone() -> None:
    """The best weights are those of the version with the highest accuracy: a run stopped there ends with them."""
    federation = flasync.Federation(small_config(_EVERY_VERSION, "eval.select=server/eval/accuracy:max"))
    recorder = EventRecorder(federation.bus)
    summary = asyncio.run(federation.run())
    accuracy = {int(e.version): e.accuracy for e in recorder.of(Evaluated)}
    best = max(accuracy, key=lambda version: (accuracy[version], -version))
    assert best < summary.versions and accuracy[summary.versions] < accuracy[best]  # the run is not monotone
    assert (summary.best_version, summary.best_value) == (best, accuracy[best])
    assert summary.best_metric == "server/eval/accuracy:max"
    stopped = flasync.run(small_config(_EVERY_VERSION, f"stop.max_versions={best}"))
    assert summary.best_weights_sha256 == stopped.weights_sha256 != summary.weights_sha256
    assert federation.best is not None and federation.best.version == best


@pytest.mark.slow
def test_selecting_changes_neither_the_training_nor_the_final_weights() -> None:
    """A run with a selection ends with the same weights as the same run without one."""
    selected = flasync.run(small_config(_EVERY_VERSION, "eval.select=server/eval/loss:min"))
    plain = flasync.run(small_config(_EVERY_VERSION))
    assert selected.weights_sha256 == plain.weights_sha256
    assert plain.best_version is None and plain.best_metric == ""
    assert selected.best_version is not None and selected.best_value <= selected.loss
