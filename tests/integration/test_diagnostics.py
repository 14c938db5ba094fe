"""Training diagnostics in whole runs: alerts raised as events, metrics and tags, layer statistics, bounded memory."""

from __future__ import annotations

import math
from pathlib import Path

import mlflow
import pytest
import torch

import flasync
from flasync import tracking
from flasync.config import DiagnosticsConfig
from flasync.core.events import AlertRaised, ClientFailed, TaskDiagnosis
from flasync.data import ArrayData, load_digits
from flasync.testing import EventRecorder, MemoryTracker, small_config
from tests.conftest import NEEDS_DP_ACCOUNTING

CONFIG = DiagnosticsConfig()


def _nan_data() -> tuple[ArrayData, ArrayData]:
    digits = load_digits()
    x = digits.x.clone()
    x[7] = math.nan  # one training sample: exactly one client holds it
    train = ArrayData(x=x[:1400], y=digits.y[:1400], num_classes=digits.num_classes)
    test = ArrayData(x=digits.x[1400:], y=digits.y[1400:], num_classes=digits.num_classes)
    return train, test


@pytest.mark.slow
async def test_nan_client_raises_the_nan_alert_as_event_metric_and_tag(tmp_path: Path) -> None:
    """A client whose data holds a NaN fails its tasks; each failure is a NaN alert: bus event, metric and tag."""
    train, test = _nan_data()
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    config = small_config(
        "population.num_clients=8",
        "stop.max_versions=2",
        "tracking.enabled=true",
        f"tracking.uri={uri}",
        server={"kind": "fedavg", "clients_per_round": 8},
    )
    tracker = tracking.MlflowTracker(uri, writer_process=False)
    federation = flasync.Federation(config, dataset=train, test_dataset=test, tracker=tracker)
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    failed = recorder.of(ClientFailed)
    alerts = recorder.of(AlertRaised)
    assert summary.updates_failed == 2 and len(failed) == 2
    assert {f.client_id for f in failed} == {alerts[0].client_id}
    assert [a.kind for a in alerts] == ["nan", "nan"] and [a.count for a in alerts] == [1, 2]
    assert "NaN/Inf in loss" in alerts[0].message
    assert summary.alerts == 2
    run = mlflow.MlflowClient(uri).get_run(summary.run_id or "")
    assert run.data.tags["alert.nan"] == alerts[0].message
    assert run.data.tags["alerts"] == "nan=2"
    history = mlflow.MlflowClient(uri).get_metric_history(summary.run_id or "", "alert/nan/count")
    assert sorted(m.value for m in history) == [1.0, 2.0]


async def test_full_level_run_reports_layer_statistics() -> None:
    """At level full the profile lists every layer's gradient-norm statistics; weight norms and drift."""
    tracker = MemoryTracker()
    federation = flasync.Federation(small_config("diagnostics.level=full", "stop.max_versions=4"), tracker=tracker)
    await federation.run()
    assert federation.profile is not None
    diagnostics = federation.profile["diagnostics"]
    assert [layer["name"] for layer in diagnostics["layers"]] == federation.profile["layers"]
    assert all(layer["grad_norm_max"] >= layer["grad_norm_mean"] > 0 for layer in diagnostics["layers"])
    versions = [w["version"] for w in diagnostics["weights"]]
    assert versions == sorted(set(versions)) and versions[-1] == 4  # the latest version of each batch read
    assert all(w["drift"] > 0 for w in diagnostics["weights"])


@pytest.mark.slow
async def test_a_destroying_server_step_alerts_between_evaluations() -> None:
    """A server learning rate of 30 moves the weights by more than half their norm in one version: a step_ratio
    alert, though no evaluation happens before the end; the default learning rate raises none."""
    import flasync
    from flasync.core.events import AlertRaised
    from flasync.testing import EventRecorder, small_config

    bad = flasync.Federation(small_config("server.optimizer.lr=30", "eval.every_versions=100"))
    bad_events = EventRecorder(bad.bus)
    await bad.run()
    alerts = [e for e in bad_events.of(AlertRaised) if e.kind == "step_ratio"]
    assert alerts and alerts[0].value > 0.5 and alerts[0].version <= 3
    assert "server.optimizer.lr?" in alerts[0].message
    good = flasync.Federation(small_config("eval.every_versions=100"))
    good_events = EventRecorder(good.bus)
    await good.run()
    assert not [e for e in good_events.of(AlertRaised) if e.kind == "step_ratio"]


@pytest.mark.slow
def test_alert_monitor_memory_does_not_grow_with_updates_or_versions() -> None:
    """The monitor keeps bounded series: 20,000 more updates and versions add almost nothing, and the divergence
    alert still compares against the best loss of the whole run."""
    import tracemalloc

    from flasync.core.events import Aggregated, ClientId, Evaluated, UpdateUploaded, Version
    from flasync.core.snapshots import ModelSnapshot
    from flasync.training.diagnostics import AlertMonitor

    weights = torch.ones(4)
    monitor = AlertMonitor(
        CONFIG,
        model=lambda: ModelSnapshot(version=Version(version), weights=weights, exact=weights, download_bytes=0),
        initial=torch.zeros(4),
    )

    def feed(first: int, count: int) -> None:
        nonlocal version
        for v in range(first, first + count):
            version = v
            monitor.observe(
                UpdateUploaded(
                    task_id=v,
                    client_id=ClientId(v % 100),
                    base_version=Version(v),
                    num_samples=1,
                    payload=b"",
                    train_loss=1.0,
                    simulated_s=0.0,
                    sent_wall_s=0.0,
                    diagnosis=TaskDiagnosis(update_norm=1.0 + v % 7),
                ),
                v,
            )
            monitor.observe(
                Aggregated(
                    version=Version(v), num_updates=1, mean_staleness=0.0, aggregate_s=0.0, simulated_s=0.0, wall_s=0.0
                ),
                v,
            )
            monitor.observe(
                Evaluated(version=Version(v), accuracy=0.5, loss=1.0, simulated_s=0.0, wall_s=0.0, eval_s=0.0), v
            )

    version = 0
    tracemalloc.start()
    try:
        feed(0, 6_000)  # past every bound (4,096 norms, 1,024 weight samples): what follows grows only by a leak
        before = tracemalloc.get_traced_memory()[0]
        feed(6_000, 20_000)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 256 * 1024, f"the monitor grew by {grown} bytes"
    summary = monitor.summary()
    assert summary["update_norm"] == pytest.approx({"p10": 1.0, "p50": 4.0, "p90": 7.0, "max": 7.0, "count": 26_000})
    assert len(summary["weights"]) <= 1025 and summary["weights"][-1]["version"] == 25_999  # type: ignore[index]
    rising = [
        Evaluated(version=Version(26_000 + i), accuracy=0.5, loss=1.0 + i, simulated_s=0.0, wall_s=0.0, eval_s=0.0)
        for i in range(1, CONFIG.divergence_window + 1)
    ]
    kinds = [alert.kind for event in rising for alert in monitor.observe(event, 26_000)]
    assert kinds == ["divergence"]


@NEEDS_DP_ACCOUNTING
async def test_under_differential_privacy_a_large_step_blames_the_noise() -> None:
    """With privacy on, the step_ratio alert names the noise, not the learning rate."""
    import flasync
    from flasync.core.events import AlertRaised
    from flasync.testing import EventRecorder, small_config

    private = flasync.Federation(
        small_config("privacy.enabled=true", "privacy.noise_multiplier=30", "eval.every_versions=100")
    )
    events = EventRecorder(private.bus)
    await private.run()
    alerts = [e for e in events.of(AlertRaised) if e.kind == "step_ratio"]
    assert alerts and "privacy noise" in alerts[0].message and "optimizer.lr" not in alerts[0].message
