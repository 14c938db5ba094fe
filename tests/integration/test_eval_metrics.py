"""Metrics eval.metrics adds to the central evaluation, in a whole run: logged, summed up, selectable, harmless."""

from __future__ import annotations

import asyncio

import pytest

import flasync
from flasync.core.events import Evaluated
from flasync.testing import EventRecorder, MemoryTracker, small_config

_METRICS = "eval.metrics=[accuracy, f1, precision, brier=tests.unit.training.user_metric:Brier]"


@pytest.mark.slow
def test_added_metrics_are_logged_summed_up_and_selectable_without_changing_the_run() -> None:
    """A run adding f1, precision and a user's metric logs each per evaluation, keeps the last in the summary, can
    select the best version by the user's metric, and trains exactly as the same run without them."""
    tracker = MemoryTracker()
    config = small_config(_METRICS, "eval.select=server/eval/brier:min", "executor.kind=thread")
    federation = flasync.Federation(config, tracker=tracker)
    recorder = EventRecorder(federation.bus)
    summary = asyncio.run(federation.run())
    plain_tracker = MemoryTracker()
    plain = asyncio.run(flasync.Federation(small_config("executor.kind=thread"), tracker=plain_tracker).run())

    assert summary.weights_sha256 == plain.weights_sha256
    assert tracker.history("server/eval/accuracy") == plain_tracker.history("server/eval/accuracy")
    assert tracker.history("server/eval/loss") == plain_tracker.history("server/eval/loss")
    assert not {"server/eval/f1", "server/eval/brier"} & plain_tracker.metric_keys()
    evaluated = recorder.of(Evaluated)
    for name in ("f1", "precision", "brier"):
        logged = tracker.history(f"server/eval/{name}")
        assert logged == [(int(e.version), e.metrics[name]) for e in evaluated]
    assert summary.eval_metrics == evaluated[-1].metrics
    brier = {int(e.version): e.metrics["brier"] for e in evaluated}
    best = min(brier, key=lambda version: (brier[version], version))
    assert (summary.best_version, summary.best_value) == (best, brier[best])
    assert all(0.0 <= e.metrics["f1"] <= 1.0 and 0.0 <= e.metrics["brier"] <= 2.0 for e in evaluated)
