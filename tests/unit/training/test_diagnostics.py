"""Training diagnostics: the pure alert checks and per-layer gradient statistics."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import nn

import flasync
from flasync.config import DiagnosticsConfig
from flasync.core.events import Aggregated, ClientFailed, ClientId, TaskDiagnosis, UpdateUploaded, Version
from flasync.core.snapshots import ModelSnapshot
from flasync.training.diagnostics import (
    AlertMonitor,
    DivergedTraining,
    TrainingDiagnostics,
    is_diverging,
    layer_layout,
    task_alerts,
)
from flasync.training.local import FlatModel, LocalResult, LocalTraining

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


def test_diverged_training_carries_its_diagnosis() -> None:
    """The training error of a non-finite update keeps the diagnosis for the ClientFailed event."""
    error = DivergedTraining("boom", TaskDiagnosis(update_finite=False))
    assert isinstance(error, flasync.core.errors.TrainingError)
    assert error.diagnosis.update_finite is False


def _random_upload(rng: random.Random, task_id: int) -> UpdateUploaded:
    """An upload whose diagnosis is, at random, missing, plain, exploding, non-finite, norm-less or per-layer."""
    pick = rng.random()
    norm = rng.lognormvariate(0.0, 0.3) * (30.0 if rng.random() < 0.04 else 1.0)
    if pick < 0.05:
        diagnosis = None
    elif pick < 0.1:
        diagnosis = TaskDiagnosis(loss_finite=False, update_norm=norm)
    elif pick < 0.15:
        diagnosis = TaskDiagnosis(update_finite=False)
    elif pick < 0.2:
        diagnosis = TaskDiagnosis()  # level off: no norm
    elif pick < 0.25:
        diagnosis = TaskDiagnosis(update_norm=math.inf)
    elif pick < 0.3:
        peaks = (rng.choice([1.0, 5e3]), 1.0)
        diagnosis = TaskDiagnosis(
            update_norm=norm, layer_grad_norm_max=peaks, layer_grad_norm_mean=(rng.choice([1.0, 1e-9]), 0.5)
        )
    else:
        diagnosis = TaskDiagnosis(update_norm=norm)
    return UpdateUploaded(
        task_id=task_id,
        client_id=ClientId(rng.randrange(40)),
        base_version=Version(0),
        num_samples=10,
        payload=b"",
        train_loss=0.5,
        simulated_s=float(task_id),
        sent_wall_s=0.0,
        diagnosis=diagnosis,
    )


@pytest.mark.parametrize("seed", range(8))
def test_observe_many_raises_and_keeps_what_observe_of_each_does(seed: int) -> None:
    """Random batches of uploads (quiet and exploding norms, NaN/Inf, no norm, per-layer figures, no diagnosis)
    raise the same alerts, from the same uploads, in the same order, and leave the same series, as one at a time."""
    rng = random.Random(seed)
    names = ("a", "b")
    together = AlertMonitor(CONFIG, layer_names=names, rng=random.Random(seed))
    alone = AlertMonitor(CONFIG, layer_names=names, rng=random.Random(seed))
    task_id, raised = 0, 0
    for version in range(40):
        batch = [_random_upload(rng, task_id + k) for k in range(rng.choice([0, 1, 2, 7, 30, 120]))]
        task_id += len(batch)
        expected = [(index, alert) for index, event in enumerate(batch) for alert in alone.observe(event, version)]
        assert together.observe_many(batch, version) == expected
        raised += len(expected)
    assert raised > 0
    assert together.summary() == alone.summary()
    assert list(together._recent) == list(alone._recent)
    assert together.series.norms.sample == alone.series.norms.sample


def _alike_batch(rng: random.Random, task_id: int, size: int) -> list[UpdateUploaded]:
    """A batch whose diagnoses are mostly alike: all plain (quiet norms, at times an exploding one, a NaN or Inf norm,
    no norm at all), all with the same per-layer figures, all non-finite alike, or, now and then, one odd upload."""
    mode = rng.randrange(6)
    plain: list[TaskDiagnosis | None] = [TaskDiagnosis(update_norm=rng.lognormvariate(0.0, 0.3)) for _ in range(size)]
    if mode == 1 and size:  # one exploding norm, one NaN norm, one Inf norm among plain ones
        for value in (rng.uniform(20.0, 80.0), math.nan, math.inf):
            plain[rng.randrange(size)] = TaskDiagnosis(update_norm=value)
    elif mode == 2:
        plain = [TaskDiagnosis() for _ in range(size)]  # level off: no norm
    elif mode == 3:
        layers = {"layer_grad_norm_max": (rng.choice([1.0, 5e3]), 1.0), "layer_grad_norm_mean": (1.0, 0.5)}
        plain = [TaskDiagnosis(update_norm=rng.random(), **layers) for _ in range(size)]  # type: ignore[arg-type]
    elif mode == 4:
        plain = [TaskDiagnosis(update_finite=False) for _ in range(size)]
    elif mode == 5 and size:  # one odd upload among plain ones
        plain[rng.randrange(size)] = rng.choice([TaskDiagnosis(loss_finite=False), None])
    return [
        UpdateUploaded(
            task_id=task_id + k,
            client_id=ClientId(rng.randrange(40)),
            base_version=Version(0),
            num_samples=10,
            payload=b"",
            train_loss=0.5,
            simulated_s=float(task_id + k),
            sent_wall_s=0.0,
            diagnosis=diagnosis,
        )
        for k, diagnosis in enumerate(plain)
    ]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.slow
def test_observe_many_of_batches_alike_raises_and_keeps_what_observe_of_each_does(seed: int) -> None:
    """Batches whose diagnoses are alike (all plain, with or without an exploding, NaN or Inf norm, all without a norm,
    all with the same per-layer figures, all non-finite) or all but one alike raise the same alerts from the same
    uploads in the same order, and keep the same series and the same sample of norms (the same draws), as one at a
    time; past the sketch's capacity too."""
    rng = random.Random(seed)
    names = ("a", "b")
    together = AlertMonitor(CONFIG, layer_names=names, rng=random.Random(seed))
    alone = AlertMonitor(CONFIG, layer_names=names, rng=random.Random(seed))
    task_id, raised, kinds = 0, 0, set[str]()
    for version in range(100):
        batch = _alike_batch(rng, task_id, rng.choice([0, 1, 2, 7, 30, 600, 1500]))
        task_id += len(batch)
        expected = [(index, alert) for index, event in enumerate(batch) for alert in alone.observe(event, version)]
        assert together.observe_many(batch, version) == expected
        raised += len(expected)
        kinds.update(alert.kind for _, alert in expected)
    assert kinds == {"nan", "exploding_update", "exploding_gradient"} and raised > 0
    assert together.series.norms.count > 4096  # past the sketch's capacity: random draws made
    assert together.summary() == alone.summary()
    assert list(together._recent) == list(alone._recent)
    assert together.series.norms.sample == alone.series.norms.sample
    assert together.series.update_norms.items() == alone.series.update_norms.items()


def test_observe_many_of_other_events_is_observe_of_each() -> None:
    """A batch of events other than uploads is read one by one."""
    failed = [
        ClientFailed(
            task_id=k,
            client_id=ClientId(k),
            base_version=Version(0),
            error="boom",
            simulated_s=0.0,
            diagnosis=TaskDiagnosis(loss_finite=k % 2 == 0),
        )
        for k in range(4)
    ]
    found = AlertMonitor(CONFIG).observe_many(failed, 0)
    assert [(index, alert.kind) for index, alert in found] == [(1, "nan"), (3, "nan")]


class _OldWeightsMonitor:
    """The weights' figures and step alerts as norms of fresh differences (the step's base the norm the previous
    version recorded), to compare the monitor with."""

    def __init__(self, initial: torch.Tensor, limit: float) -> None:
        self.initial, self.limit = initial, limit
        self.previous: tuple[torch.Tensor, float] | None = None
        self.series: list[tuple[int, float, float]] = []

    def observe(self, version: int, weights: torch.Tensor) -> list[tuple[str, float]]:
        with torch.no_grad():
            norm = float(torch.linalg.vector_norm(weights))
            drift = float(torch.linalg.vector_norm(weights - self.initial))
        self.series.append((version, norm, drift))
        if not math.isfinite(norm):
            return [("nan", norm)]
        previous, self.previous = self.previous, (weights.detach().clone(), norm)
        if previous is None:
            return []
        with torch.no_grad():
            ratio = float(torch.linalg.vector_norm(weights - previous[0])) / max(previous[1], 1e-12)
        return [("step_ratio", ratio)] if ratio > self.limit else []


def _aggregated(version: int) -> Aggregated:
    return Aggregated(
        version=Version(version), num_updates=1, mean_staleness=0.0, aggregate_s=0.0, simulated_s=0.0, wall_s=0.0
    )


def _snapshot(version: int, weights: torch.Tensor, norm: float | None = None) -> ModelSnapshot:
    return ModelSnapshot(version=Version(version), weights=weights, exact=weights, download_bytes=0, norm=norm)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("layout", ["plain", "offset", "strided", "requires_grad"])
@pytest.mark.parametrize("measured", [False, True])
def test_weights_figures_and_step_alerts_are_those_of_fresh_norms(seed: int, layout: str, measured: bool) -> None:
    """Random walks of the weights (small and huge steps, a NaN version, sizes around the vector width; each
    version's weights in a storage of their own, at an offset, strided, or requiring grad; their norm measured by the
    server or not) keep the same norms and drifts, bit for bit, and raise the same alerts with the same values as
    norms of fresh differences and copies, though the monitor keeps each version's own weights, not a copy."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    size = rng.choice([1, 7, 8, 9, 63, 64, 65, 1000, 2762, 70_001])

    def laid_out(values: torch.Tensor) -> torch.Tensor:
        storage = torch.randn(3 * size + 5, generator=generator)
        if layout == "offset":
            return storage[3 : 3 + size].copy_(values)
        if layout == "strided":
            return storage[1 : 1 + 3 * size : 3].copy_(values)
        fresh = values.clone()
        return fresh.requires_grad_() if layout == "requires_grad" else fresh

    values = torch.randn(size, generator=generator)
    initial = values.clone()
    config = DiagnosticsConfig(level="basic")
    snapshot: ModelSnapshot | None = None
    monitor = AlertMonitor(config, model=lambda: snapshot, initial=initial)
    assert monitor.observe(_aggregated(0), 0) == []  # nothing published yet
    old = _OldWeightsMonitor(initial, config.step_ratio_max)
    raised = []
    for version in range(1, 40):
        scale = rng.choice([1e-3, 0.1, 1.0, 5.0])
        values = values + scale * torch.randn(size, generator=generator)
        if rng.random() < 0.05:
            values[rng.randrange(size)] = math.nan
        elif not bool(torch.isfinite(values).all()):
            values = torch.randn(size, generator=generator)  # the run goes on from finite weights
        weights = laid_out(values)
        norm = float(torch.linalg.vector_norm(weights.detach())) if measured else None
        snapshot = _snapshot(version, weights, norm)
        found = [(alert.kind, alert.value) for alert in monitor.observe(_aggregated(version), version)]
        expected = old.observe(version, weights)
        assert repr(found) == repr(expected)  # float reprs round-trip: equal bits (NaN equal to NaN)
        raised += found
    assert repr(monitor.series.weights.items()) == repr(old.series)
    assert {kind for kind, _ in raised} <= {"nan", "step_ratio"}


@pytest.mark.parametrize("size", [1, 3, 8, 17, 64, 1000, 2762, 40_000, 300_000])
def test_dist_is_the_norm_of_the_difference(size: int) -> None:
    """torch.dist(a, b), which the monitor's drift and step use, is torch.linalg.vector_norm(a - b), bit for bit."""
    generator = torch.Generator().manual_seed(size)
    for scale in (1e-20, 1.0, 1e18):
        a, b = torch.randn(size, generator=generator) * scale, torch.randn(size, generator=generator)
        assert float(torch.dist(a, b)) == float(torch.linalg.vector_norm(a - b))
