"""Personalization end to end: FedBN's local layers never leave their clients, fine-tuning, Ditto; figures, resume."""

from __future__ import annotations

import asyncio
import io
from collections import defaultdict

import pytest
import torch
from torch import nn

import flasync
from flasync.codecs import decode
from flasync.core.events import ClientEvaluated, TaskAssigned, UpdateUploaded
from flasync.runtime import checkpoint
from flasync.runtime.prepare import RunInputs
from flasync.testing import EventRecorder, MemoryTracker, small_config
from tests.conftest import interrupt_at

NUM_PARAMS = 64 * 32 + 32 + 32 * 10 + 10  # the small config's MLP
FIRST_LAYER = 64 * 32 + 32  # layers.0's weight and bias lead the flat vector
_FEDBN = ("client.personal.kind=fedbn", "client.personal.layers=[layers.0]")
_EVAL = ("eval.clients.fraction=0.5", "eval.clients.min_reports=3")


def _config(*overrides: str) -> flasync.RunConfig:
    return small_config(*overrides, model={"kind": "mlp", "hidden": [32]})


async def test_local_layers_never_leave_and_stay_bit_identical_on_the_server() -> None:
    """Every upload is zero on the local layer; the final model's local layer is the initial one bit for bit, and
    the shared head has trained."""
    config = _config(*_FEDBN)
    initial = RunInputs(config).prepare().initial
    tracker = MemoryTracker()
    federation = flasync.Federation(config, tracker=tracker)
    recorder = EventRecorder(federation.bus)
    await federation.run()
    uploads = recorder.of(UpdateUploaded)
    assert uploads
    for event in uploads:
        delta = decode(event.payload, expected_elements=NUM_PARAMS)
        assert bool((delta[:FIRST_LAYER] == 0).all()) and bool((delta[FIRST_LAYER:] != 0).any())
    flat = torch.load(io.BytesIO(tracker.artifacts["weights.pt"]), weights_only=True)["flat"]
    assert torch.equal(flat[:FIRST_LAYER], initial[:FIRST_LAYER])
    assert not torch.equal(flat[FIRST_LAYER:], initial[FIRST_LAYER:])


@pytest.mark.slow
def test_personal_figures_are_reported_beside_the_global_ones() -> None:
    """Each report carries the client's own model's accuracy and loss (different from the global model's once the
    client trained its local layer); each closed version logs their sample-weighted mean beside the global one."""
    tracker = MemoryTracker()
    federation = flasync.Federation(_config(*_FEDBN, *_EVAL, "stop.max_versions=20"), tracker=tracker)
    recorder = EventRecorder(federation.bus)
    asyncio.run(federation.run())
    reports = recorder.of(ClientEvaluated)
    assert reports and all({"personal/accuracy", "personal/loss"} <= r.metrics.keys() for r in reports)
    assert any(r.metrics["personal/loss"] != r.loss for r in reports)
    by_version: dict[int, list[ClientEvaluated]] = defaultdict(list)
    for report in reports:
        by_version[int(report.version)].append(report)
    counts = dict(tracker.history("client_eval/version/reports"))
    personal = dict(tracker.history("client_eval/personal/accuracy/mean"))
    assert counts and set(personal) == set(counts) == set(dict(tracker.history("client_eval/accuracy/mean")))
    for version, count in counts.items():
        counted = by_version[version][: int(count)]
        samples = sum(r.num_samples for r in counted)
        expected = sum(r.num_samples * r.metrics["personal/accuracy"] for r in counted) / samples
        assert personal[version] == pytest.approx(expected)


def test_a_client_first_evaluates_its_personal_model_as_the_global_one() -> None:
    """A client's first task evaluates its personal model as the downloaded one (it has no own layers yet: the
    same figures); later tasks evaluate its own layers (other figures)."""
    federation = flasync.Federation(_config(*_FEDBN, *_EVAL))
    recorder = EventRecorder(federation.bus)
    asyncio.run(federation.run())
    participation = {task.task_id: task.participation for task in recorder.of(TaskAssigned)}
    reports = recorder.of(ClientEvaluated)
    firsts = [r for r in reports if participation[r.task_id] == 0]
    laters = [r for r in reports if participation[r.task_id] > 0]
    assert firsts and laters
    for report in firsts:
        assert report.metrics["personal/accuracy"] == report.accuracy
        assert report.metrics["personal/loss"] == report.loss
    assert all(report.metrics["personal/loss"] != report.loss for report in laters)


@pytest.mark.slow
def test_fedbn_off_changes_nothing_and_a_fedbn_run_is_deterministic() -> None:
    """The same FedBN config gives the same weights twice and with 1 or 3 workers; it differs from FedAvg's."""
    one = flasync.run(_config(*_FEDBN))
    assert one.weights_sha256 == flasync.run(_config(*_FEDBN)).weights_sha256
    assert one.weights_sha256 == flasync.run(_config(*_FEDBN, "executor.workers=3")).weights_sha256
    assert one.weights_sha256 != flasync.run(_config()).weights_sha256


class _NormMLP(nn.Module):
    """An MLP with a BatchNorm layer (FedBN's default local layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layers(x)
        return out


async def test_normalization_layers_are_local_by_default() -> None:
    """Without patterns the BatchNorm's weight, bias and running statistics stay at their initial values on the
    server; the linear layers train."""
    config = _config("client.personal.kind=fedbn", "tracking.log_model=false")
    initial = RunInputs(config, model_factory=_NormMLP).prepare().initial
    tracker = MemoryTracker()
    await flasync.Federation(config, tracker=tracker, model_factory=_NormMLP).run()
    flat = torch.load(io.BytesIO(tracker.artifacts["weights.pt"]), weights_only=True)["flat"]
    params = 64 * 32 + 32 + 2 * 32 + 32 * 10 + 10
    norm = torch.cat([torch.arange(2080, 2080 + 64), torch.arange(params, params + 64)])  # weight, bias; mean, var
    assert torch.equal(flat[norm], initial[norm])
    assert not torch.equal(flat[:2080], initial[:2080])


@pytest.mark.slow
def test_a_resumed_run_keeps_each_clients_local_layers() -> None:
    """Stopped mid-way and resumed from its checkpoint (which holds the clients' local layers), a FedBN run ends with
    the uninterrupted weights."""
    config = _config(*_FEDBN, "stop.max_versions=16")
    full = flasync.run(config)
    tracker = asyncio.run(interrupt_at(config, 6))[0]
    saved, state = checkpoint.decode(checkpoint.latest(tracker.artifacts))
    assert state["personal"]["ids"] and state["personal"]["values"].shape[1] == FIRST_LAYER
    resumed = flasync.run(saved, resume=checkpoint.ResumePoint(None, state))
    assert resumed.weights_sha256 == full.weights_sha256


@pytest.mark.slow
def test_local_layers_spill_to_disk_beyond_the_bound() -> None:
    """With room for 2 clients' layers in memory the run spills the others and ends with the same weights."""
    bounded = flasync.run(_config(*_FEDBN, "client.personal.max_in_memory=2"))
    assert bounded.weights_sha256 == flasync.run(_config(*_FEDBN)).weights_sha256


_FINETUNE = ("client.personal.kind=finetune", "client.personal.steps=5")


@pytest.mark.slow
def test_fine_tuning_reports_personal_figures_and_leaves_training_unchanged() -> None:
    """Every report carries the fine-tuned model's figures (other than the downloaded model's for some); the run's
    weights are those of the same run without fine-tuning, and the same with 1 or 3 workers."""
    federation = flasync.Federation(_config(*_FINETUNE, *_EVAL))
    recorder = EventRecorder(federation.bus)
    summary = asyncio.run(federation.run())
    reports = recorder.of(ClientEvaluated)
    assert reports and all({"personal/accuracy", "personal/loss"} <= r.metrics.keys() for r in reports)
    assert any(r.metrics["personal/loss"] != r.loss for r in reports)
    assert summary.weights_sha256 == flasync.run(_config(*_EVAL)).weights_sha256
    three = flasync.Federation(_config(*_FINETUNE, *_EVAL, "executor.workers=3"))
    recorder_three = EventRecorder(three.bus)
    asyncio.run(three.run())
    by_task = {r.task_id: r.metrics["personal/loss"] for r in reports}
    assert by_task == {r.task_id: r.metrics["personal/loss"] for r in recorder_three.of(ClientEvaluated)}


_DITTO = ("client.personal.kind=ditto", "client.personal.lam=0.1")


@pytest.mark.slow
def test_ditto_reports_its_personal_models_and_leaves_the_global_training_unchanged() -> None:
    """Reports carry the personal models' figures (the download's at a client's first task); the global weights are
    those of the same run without Ditto."""
    federation = flasync.Federation(_config(*_DITTO, *_EVAL))
    recorder = EventRecorder(federation.bus)
    summary = asyncio.run(federation.run())
    participation = {task.task_id: task.participation for task in recorder.of(TaskAssigned)}
    reports = recorder.of(ClientEvaluated)
    firsts = [r for r in reports if participation[r.task_id] == 0]
    laters = [r for r in reports if participation[r.task_id] > 0]
    assert firsts and laters
    assert all(r.metrics["personal/loss"] == r.loss for r in firsts)
    assert all(r.metrics["personal/loss"] != r.loss for r in laters)
    assert summary.weights_sha256 == flasync.run(_config(*_EVAL)).weights_sha256


@pytest.mark.slow
def test_a_resumed_ditto_run_gives_the_uninterrupted_personal_figures() -> None:
    """Stopped mid-way and resumed from its checkpoint (which holds the personal models), a Ditto run reports the
    personal figures of the run uninterrupted."""
    config = _config(*_DITTO, *_EVAL, "stop.max_versions=16")
    full_tracker = MemoryTracker()
    flasync.run(config, tracker=full_tracker)
    stopped = asyncio.run(interrupt_at(config, 6))[0]
    saved, state = checkpoint.decode(checkpoint.latest(stopped.artifacts))
    assert state["ditto"]["ids"] and state["ditto"]["values"].shape[1] == NUM_PARAMS
    resumed = MemoryTracker()
    flasync.run(saved, resume=checkpoint.ResumePoint(None, state), tracker=resumed)
    key = "client_eval/personal/loss/mean"
    assert stopped.history(key) + resumed.history(key) == full_tracker.history(key)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ((*_FEDBN, "executor.kind=vectorized"), "client.personal: needs executor.kind = 'thread' or 'auto', not 'vect"),
        ((*_FEDBN, "scaffold.enabled=true"), "client.personal: cannot be combined with scaffold.enabled"),
        ((*_FEDBN, *_EVAL, "eval.clients.when=after"), "client.personal: evaluates the personal model before"),
        (_FINETUNE, "client.personal: reports through client-side evaluation"),
        ((*_FINETUNE, *_EVAL, "executor.kind=ray"), "client.personal: needs executor.kind = 'thread' or 'auto'"),
        ((*_DITTO, "remote.enabled=true"), "client.personal: cannot be combined with remote.enabled"),
    ],
)
def test_unsupported_combinations_are_one_line_errors(overrides: tuple[str, ...], expected: str) -> None:
    """FedBN with vectorized cohorts, SCAFFOLD or evaluation after training, fine-tuning without client-side
    evaluation or on Ray, Ditto with remote clients are refused before the run."""
    with pytest.raises(flasync.ConfigError, match=expected):
        _config(*overrides)


def test_a_model_without_normalization_layers_is_refused_in_one_line() -> None:
    """FedBN's default on the built-in MLP (no normalization layer) names the problem and a layer to use."""
    with pytest.raises(flasync.ConfigError, match="the model has no normalization layer"):
        flasync.run(_config("client.personal.kind=fedbn"))
