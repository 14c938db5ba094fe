"""Training diagnostics: the pure alert checks, per-layer gradient statistics, and alerts of real runs."""

from __future__ import annotations

import math
from pathlib import Path

import mlflow
import pytest
import torch
from torch import nn

import flasync
from flasync import tracking
from flasync.config import DiagnosticsConfig
from flasync.core.events import AlertRaised, ClientFailed, TaskDiagnosis
from flasync.data import ArrayData, load_digits
from flasync.testing import EventRecorder, MemoryTracker, small_config
from flasync.training.diagnostics import DivergedTraining, TrainingDiagnostics, is_diverging, layer_layout, task_alerts
from flasync.training.local import FlatModel, LocalResult, LocalTraining
from tests.conftest import NEEDS_DP_ACCOUNTING

CONFIG = DiagnosticsConfig()


def _alerts(diagnosis: TaskDiagnosis, recent: list[float] | None = None) -> list[str]:
    found = task_alerts(diagnosis, 3, layer_names=("a", "b"), recent_update_norms=recent or [], config=CONFIG)
    return [a.kind for a in found]


def test_task_alerts_nan_in_loss_gradients_or_update() -> None:
    """Any non-finite loss, gradient or update is one NaN alert naming where."""
    assert _alerts(TaskDiagnosis()) == []
    assert _alerts(TaskDiagnosis(loss_finite=False, update_finite=False)) == ["nan"]
    found = task_alerts(TaskDiagnosis(grad_finite=False), 3, layer_names=(), recent_update_norms=[], config=CONFIG)
    assert found[0].message == "client 3: NaN/Inf in gradients"


def test_task_alerts_exploding_update_against_the_running_median() -> None:
    """An update norm above exploding_factor times the recent median alerts; with fewer than 5 norms it cannot."""
    recent = [1.0, 1.1, 0.9, 1.0, 1.2]
    assert _alerts(TaskDiagnosis(update_norm=9.0), recent) == []
    assert _alerts(TaskDiagnosis(update_norm=11.0), recent) == ["exploding_update"]
    assert _alerts(TaskDiagnosis(update_norm=11.0), recent[:4]) == []


def test_task_alerts_exploding_and_vanishing_gradients() -> None:
    """Per-layer gradient norms beyond the configured bounds alert (level full)."""
    exploding = TaskDiagnosis(layer_grad_norm_mean=(1.0, 1.0), layer_grad_norm_max=(5.0, 2e3))
    assert _alerts(exploding) == ["exploding_gradient"]
    vanishing = TaskDiagnosis(layer_grad_norm_mean=(1.0, 1e-9), layer_grad_norm_max=(5.0, 1e-8))
    assert _alerts(vanishing) == ["vanishing_gradient"]


@pytest.mark.parametrize(
    ("losses", "expected"),
    [
        ([2.0, 1.0, 1.1, 1.2, 1.3], True),  # rose 3 times, 30% above the best
        ([2.0, 1.0, 1.01, 1.02, 1.03], False),  # rose 3 times, but within 10% of the best
        ([2.0, 1.0, 1.5, 1.4, 1.6], False),  # not rising every time
        ([1.0, 1.5, 2.0], False),  # too short for the window
        ([1.0, math.nan], True),  # NaN loss
        ([], False),
    ],
)
def test_is_diverging(losses: list[float], expected: bool) -> None:
    """Divergence: the loss rose in each of the last `window` evaluations and is clearly above its best."""
    assert is_diverging(losses, window=3, tolerance=0.1) is expected


def test_full_level_layer_norms_match_autograd() -> None:
    """With one full-batch step, the per-layer gradient norms are those autograd computes directly."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    reference = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    reference.load_state_dict(module.state_dict())
    layout = layer_layout(module)
    model = FlatModel(module)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    diagnostics = TrainingDiagnostics("full", layout)
    cfg = LocalTraining(epochs=1, batch_size=8, lr=0.1)
    _, diagnosis = diagnostics.train(model, model.flat.clone(), x, y, cfg, torch.Generator().manual_seed(0))
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    expected = [float(p.grad.norm()) for p in reference.parameters()]  # type: ignore[union-attr]
    assert layout.names == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert diagnosis.layer_grad_norm_mean == pytest.approx(expected, rel=1e-5)
    assert diagnosis.layer_grad_norm_max == pytest.approx(expected, rel=1e-5)
    assert diagnosis.update_norm == pytest.approx(0.1 * math.sqrt(sum(v * v for v in expected)), rel=1e-5)


def test_off_level_only_checks_finiteness() -> None:
    """Level off measures nothing but the NaN/Inf checks."""
    module = nn.Linear(4, 2)
    model = FlatModel(module)
    x, y = torch.randn(4, 4), torch.randint(0, 2, (4,))
    cfg = LocalTraining(epochs=1, batch_size=4)
    _, diagnosis = TrainingDiagnostics("off").train(model, model.flat.clone(), x, y, cfg, torch.Generator())
    assert diagnosis.update_finite and diagnosis.loss_finite
    assert math.isnan(diagnosis.update_norm) and diagnosis.layer_grad_norm_mean == ()


@pytest.mark.parametrize(
    ("values", "finite"),
    [
        ([1.0, -2.0, 3.0], True),
        ([3.0e38, 3.0e38, 1.0], True),  # the float32 sum overflows, every element is finite
        ([-3.0e38, -3.0e38, 1.0], True),
        ([1.0, math.nan, 2.0], False),
        ([1.0, math.inf, 2.0], False),
        ([math.inf, -math.inf, 0.0], False),  # the sum is NaN
        ([-math.inf, 1.0, 1.0], False),
    ],
)
def test_diagnose_tells_finite_deltas_from_non_finite_ones(values: list[float], finite: bool) -> None:
    """A delta is finite exactly when all its elements are, also when their sum overflows."""
    delta = torch.tensor(values, dtype=torch.float32)
    result = LocalResult(delta=delta, num_samples=1, steps=1, loss=0.5, train_s=0.0, peak_mem_bytes=0)
    assert TrainingDiagnostics("off").diagnose(result).update_finite is finite
    assert TrainingDiagnostics("basic").diagnose(result).update_finite is finite


def _nan_data() -> tuple[ArrayData, ArrayData]:
    digits = load_digits()
    x = digits.x.clone()
    x[7] = math.nan  # one training sample: exactly one client holds it
    train = ArrayData(x=x[:1400], y=digits.y[:1400], num_classes=digits.num_classes)
    test = ArrayData(x=digits.x[1400:], y=digits.y[1400:], num_classes=digits.num_classes)
    return train, test


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


def test_diverged_training_carries_its_diagnosis() -> None:
    """The training error of a non-finite update keeps the diagnosis for the ClientFailed event."""
    error = DivergedTraining("boom", TaskDiagnosis(update_finite=False))
    assert isinstance(error, flasync.core.errors.TrainingError)
    assert error.diagnosis.update_finite is False


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
    from flasync.training.diagnostics import AlertMonitor

    weights = torch.ones(4)
    monitor = AlertMonitor(CONFIG, weights=lambda: (version, weights), initial=torch.zeros(4))

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
