"""Personalization (flasync.algorithms.personal): FedBN's local positions, what a task starts from and keeps;
fine-tuning."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from flasync.algorithms.personal import Ditto, FineTune, LocalLayers, local_positions
from flasync.codecs.build import pipeline
from flasync.core.errors import ConfigError
from flasync.core.events import ClientId, TaskAssigned, Version
from flasync.core.snapshots import ModelSnapshot
from flasync.training.executors.threads import ModelPool
from flasync.training.jobs import start_of
from flasync.training.local import LocalResult, LocalTraining, flat_parameters
from flasync.training.residuals import ResidualStore


def _norm_model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2), nn.LayerNorm(2))


def _task(task_id: int, client_id: int) -> TaskAssigned:
    return TaskAssigned(
        task_id=task_id, client_id=ClientId(client_id), participation=0, base_version=Version(0), simulated_s=0.0
    )


def _snapshot(weights: torch.Tensor) -> ModelSnapshot:
    return ModelSnapshot(version=Version(0), weights=weights, exact=weights, download_bytes=0)


def test_normalization_layers_are_local_by_default() -> None:
    """The BatchNorm's and LayerNorm's parameters and float running statistics are local, nothing else."""
    positions = local_positions(_norm_model(), None)
    # parameters: 0.weight 12, 0.bias 4 | 1.weight 4, 1.bias 4 | 3.weight 8, 3.bias 2 | 4.weight 2, 4.bias 2 (= 38);
    # float buffers: 1.running_mean 4, 1.running_var 4 (num_batches_tracked is an integer, not in the flat vector)
    expected = [*range(16, 24), *range(34, 38), *range(38, 46)]
    assert positions.tolist() == expected
    assert flat_parameters(_norm_model()).numel() == 46


def test_name_patterns_pick_any_layer() -> None:
    """A module prefix picks its tensors; a dotted-part pattern picks every bias."""
    assert local_positions(_norm_model(), ["3"]).tolist() == list(range(24, 34))
    biases = local_positions(_norm_model(), ["bias"]).tolist()
    assert biases == [*range(12, 16), *range(20, 24), *range(32, 34), *range(36, 38)]


@pytest.mark.parametrize(
    ("model", "layers", "message"),
    [
        (nn.Sequential(nn.Linear(3, 2)), None, "the model has no normalization layer; name its local layers"),
        (_norm_model(), ["head"], "pattern 'head' selects nothing of the model"),
        (_norm_model(), ["*"], "selects every tensor of the model"),
    ],
)
def test_local_layers_that_cannot_work_are_one_line_errors(
    model: nn.Module, layers: list[str] | None, message: str
) -> None:
    """No local layer, a pattern that selects nothing, or everything local is refused."""
    with pytest.raises(ConfigError, match=message):
        local_positions(model, layers)


def _result(delta: torch.Tensor) -> LocalResult:
    return LocalResult(delta=delta, num_samples=1, steps=1, loss=0.0, train_s=0.0, peak_mem_bytes=0)


def _train(plugin: LocalLayers, task: TaskAssigned, weights: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """Run a task's part through the hooks as a job would, with ``trained`` the local result; return the sent delta."""
    part = plugin.task(task, _snapshot(weights))
    start = start_of((part,))
    base = weights if start is None else start
    delta = base - trained
    part.withhold(delta)
    codec = pipeline(())
    encoded = codec.encode(delta)
    part.keep(part.finish(delta, _result(delta), encoded, codec))
    plugin.released(task)
    return delta


def test_a_task_sends_nothing_of_its_local_layers_and_keeps_them() -> None:
    """A first task starts from the download; its delta is zero at the local positions, and its next task starts
    from the next download with the trained local values in (hand computed)."""
    positions = torch.tensor([1, 2])
    plugin = LocalLayers(ResidualStore(2), positions)
    weights = torch.tensor([1.0, 2.0, 3.0, 4.0])
    sent = _train(plugin, _task(1, 7), weights, torch.tensor([0.5, 1.5, 2.5, 3.5]))
    assert sent.tolist() == [0.5, 0.0, 0.0, 0.5]
    assert plugin.personal(7, torch.zeros(4)).tolist() == [0.0, 1.5, 2.5, 0.0]
    assert plugin.personal(8, weights) is weights  # no own layers yet: the download itself
    second = plugin.task(_task(2, 7), _snapshot(torch.tensor([10.0, 20.0, 30.0, 40.0])))
    assert second.start is not None and second.start.tolist() == [10.0, 1.5, 2.5, 40.0]
    sent = _train(plugin, _task(3, 7), torch.tensor([10.0, 20.0, 30.0, 40.0]), torch.tensor([9.0, 1.0, 2.0, 39.0]))
    assert sent.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert plugin.personal(7, torch.zeros(4)).tolist() == [0.0, 1.0, 2.0, 0.0]


def test_the_checkpoint_holds_each_clients_local_layers_as_its_task_in_flight_started() -> None:
    """A checkpoint taken while a task is in flight keeps the values it started from; restored, they are put in."""
    plugin = LocalLayers(ResidualStore(1), torch.tensor([0]))
    _train(plugin, _task(1, 3), torch.tensor([1.0, 1.0]), torch.tensor([0.25, 0.0]))
    in_flight = _task(2, 3)
    part = plugin.task(in_flight, _snapshot(torch.tensor([1.0, 1.0])))
    delta = torch.tensor([0.5, 0.5])
    part.withhold(delta)
    codec = pipeline(())
    part.keep(part.finish(delta, _result(delta), codec.encode(delta), codec))
    saved = plugin.state_dict([in_flight])
    assert saved["ids"] == [3] and saved["values"].tolist() == [[0.25]]
    restored = LocalLayers(ResidualStore(1), torch.tensor([0]))
    restored.load_state_dict(saved)
    assert restored.personal(3, torch.tensor([9.0, 9.0])).tolist() == [0.25, 9.0]


def test_fine_tuning_is_k_sgd_steps_on_the_clients_own_samples() -> None:
    """One full-batch step at lr 0.5 is w - 0.5 * grad of the mean cross-entropy on the client's rows (hand
    computed with autograd on a copy); the rows of other clients play no part; the weights given are not changed."""
    torch.manual_seed(0)
    template = nn.Linear(3, 2)
    pool = ModelPool(lambda: copy.deepcopy(template))
    x = torch.randn(10, 3)
    y = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1, 1, 0])
    rows = {4: torch.tensor([1, 3, 5, 7])}
    local = LocalTraining(epochs=1, batch_size=4, lr=0.1)
    tune = FineTune(lambda c: (x, y, rows[c]), local, pool, seed=0, steps=1, lr=0.5)
    weights = flat_parameters(template)
    kept = weights.clone()
    tuned = tune(4, 0, weights)
    reference = copy.deepcopy(template)
    loss = nn.functional.cross_entropy(reference(x[rows[4]]), y[rows[4]])
    loss.backward()
    assert reference.weight.grad is not None and reference.bias.grad is not None
    expected = weights - 0.5 * torch.cat([reference.weight.grad.reshape(-1), reference.bias.grad])
    assert torch.allclose(tuned, expected, atol=1e-6)
    assert torch.equal(weights, kept)


def test_fine_tuning_is_the_same_for_a_client_and_participation_whenever_asked() -> None:
    """Three steps of batch 2 over 4 rows: the same client and participation give the same weights bit for bit."""
    torch.manual_seed(1)
    template = nn.Linear(3, 2)
    pool = ModelPool(lambda: copy.deepcopy(template))
    x, y = torch.randn(8, 3), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
    tune = FineTune(lambda c: (x, y, torch.arange(4)), LocalTraining(batch_size=2, lr=0.3), pool, seed=3, steps=3)
    weights = flat_parameters(template)
    assert torch.equal(tune(1, 0, weights), tune(1, 0, weights))
    assert not torch.equal(tune(1, 0, weights), weights)


def _ditto_step(
    template: nn.Module, v: torch.Tensor, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """One full-batch Ditto step by hand: v - lr (grad f(v) + lambda (v - w)), lr 0.5, lambda 0.3."""
    reference = copy.deepcopy(template)
    torch.nn.utils.vector_to_parameters(v, reference.parameters())
    nn.functional.cross_entropy(reference(x), y).backward()
    grad = torch.cat([p.grad.reshape(-1) for p in reference.parameters() if p.grad is not None])
    return v - 0.5 * (grad + 0.3 * (v - w))


def test_ditto_trains_the_personal_model_towards_the_downloaded_one() -> None:
    """A first task's personal model is one step from the download; a second starts from it and is pulled towards
    the new download by lambda (v - w) (both hand computed); the global update is not touched."""
    torch.manual_seed(2)
    template = nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    tune = FineTune(
        lambda c: (x, y, torch.arange(4)),
        LocalTraining(batch_size=4, lr=0.5),
        ModelPool(lambda: copy.deepcopy(template)),
        seed=0,
        steps=1,
    )
    ditto = Ditto(ResidualStore(8), tune, lam=0.3)
    codec = pipeline(())
    first = flat_parameters(template)
    for task_id, download in ((1, first), (2, first + 0.1)):
        task = _task(task_id, 5)
        before = ditto.personal(5, download).clone()
        part = ditto.task(task, _snapshot(download))
        delta = torch.ones(8)
        part.keep(part.finish(delta, _result(delta), codec.encode(delta), codec))
        ditto.released(task)
        assert torch.equal(delta, torch.ones(8))
        assert torch.allclose(ditto.personal(5, download), _ditto_step(template, before, download, x, y), atol=1e-6)
    assert not torch.equal(ditto.personal(5, first), first)
