"""Tests of flasync.training.local (flat models, local SGD, evaluation) and flasync.training.executors.threads
(per-thread models)."""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from flasync.core.errors import TrainingError
from flasync.training.executors.threads import ModelPool, ThreadTrainingExecutor
from flasync.training.local import FlatModel, LocalTraining, evaluate, flat_parameters, train
from flasync.training.models import MLP, SmallCNN
from tests.conftest import Focal

PROPERTY = settings(max_examples=25, deadline=None)
NUM_FEATURES = 16  # the CNN sees these as one 4x4 image
NUM_CLASSES = 3


pytestmark = pytest.mark.usefixtures("seeded_torch")


def _mlp() -> nn.Module:
    return MLP(NUM_FEATURES, [16], NUM_CLASSES)


def _cnn() -> nn.Module:
    return SmallCNN(in_channels=1, image_size=(4, 4), num_classes=NUM_CLASSES, channels=(2, 3))


def _batchnorm_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, NUM_CLASSES))


def _data(n: int, features: int = NUM_FEATURES, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=g), torch.randint(0, NUM_CLASSES, (n,), generator=g)


def _gen(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _reference_sgd(module: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: LocalTraining, seed: int) -> torch.Tensor:
    """Train ``module`` in place with torch.optim.SGD in the batch order of ``train`` and return its flat weights."""
    opt = torch.optim.SGD(module.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    generator = _gen(seed)
    n = int(y.shape[0])
    module.train()
    steps = 0
    for _ in range(cfg.epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, cfg.batch_size):
            if cfg.max_steps is not None and steps >= cfg.max_steps:
                return flat_parameters(module)
            idx = order[start : start + cfg.batch_size]
            opt.zero_grad()
            F.cross_entropy(module(x[idx]), y[idx]).backward()  # type: ignore[no-untyped-call]
            if cfg.clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.clip_norm)
            opt.step()
            steps += 1
    return flat_parameters(module)


def _train_both(cfg: LocalTraining, n: int = 50, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the flat weights after ``train`` and after the reference loop, from the same initial model."""
    module = _mlp()
    reference = copy.deepcopy(module)
    model = FlatModel(module)
    base = model.flat.clone()
    x, y = _data(n)
    train(model, base, x, y, cfg, _gen(seed))
    return model.flat.clone(), _reference_sgd(reference, x, y, cfg, seed)


# ------------------------------------------------------------------------------------------------ FlatModel
@pytest.mark.parametrize("factory", [_mlp, _cnn], ids=["mlp", "cnn"])
def test_flat_model_parameters_share_flat_storage(factory: Callable[[], nn.Module]) -> None:
    """Every parameter is a view into ``flat``: writing zeros to ``flat`` zeroes the module's outputs."""
    model = FlatModel(factory())
    x, _ = _data(5)
    assert model.module(x).abs().sum() > 0
    model.flat.zero_()
    assert torch.equal(model.module(x), torch.zeros(5, NUM_CLASSES))


@pytest.mark.parametrize("factory", [_mlp, _cnn], ids=["mlp", "cnn"])
def test_flat_model_keeps_initial_weights(factory: Callable[[], nn.Module]) -> None:
    """Wrapping copies the module's initial parameters into ``flat`` in ``parameters()`` order."""
    module = factory()
    before = flat_parameters(module)
    model = FlatModel(module)
    assert torch.equal(model.flat, before)
    assert model.num_trainable == model.flat.numel() == sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("factory", [_mlp, _cnn], ids=["mlp", "cnn"])
def test_flat_model_load_sets_state_dict_slices(factory: Callable[[], nn.Module]) -> None:
    """After ``load_(w)``, each entry of ``state_dict()`` equals its slice of ``w``, in parameter order."""
    model = FlatModel(factory())
    weights = torch.randn(model.flat.numel())
    model.load_(weights)
    state = model.module.state_dict()
    offset = 0
    for name, parameter in model.module.named_parameters():
        n = parameter.numel()
        assert torch.equal(state[name].reshape(-1), weights[offset : offset + n]), name
        offset += n
    assert offset == weights.numel()


def test_flat_model_load_rejects_wrong_length() -> None:
    """``load_`` of a vector of another length is a TrainingError."""
    model = FlatModel(_mlp())
    with pytest.raises(TrainingError, match="elements"):
        model.load_(torch.zeros(model.flat.numel() + 1))


@pytest.mark.parametrize("factory", [_mlp, _cnn], ids=["mlp", "cnn"])
def test_flat_model_gradients_land_in_grad(factory: Callable[[], nn.Module]) -> None:
    """After backward, ``grad`` holds the gradients an unwrapped copy of the module computes."""
    module = factory()
    reference = copy.deepcopy(module)
    model = FlatModel(module)
    x, y = _data(6)
    F.cross_entropy(model.module(x), y).backward()  # type: ignore[no-untyped-call]
    F.cross_entropy(reference(x), y).backward()  # type: ignore[no-untyped-call]
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters() if p.grad is not None])
    assert expected.numel() == model.grad.numel()
    assert torch.allclose(model.grad, expected, atol=1e-7)
    assert model.grad.abs().sum() > 0


def test_flat_model_puts_float_buffers_after_parameters() -> None:
    """BatchNorm running statistics follow the parameters in ``flat``; the int64 batch counter is left out."""
    module = _batchnorm_model()
    model = FlatModel(module)
    bn = module[1]
    assert isinstance(bn, nn.BatchNorm1d)
    num_params = sum(p.numel() for p in module.parameters())
    assert model.num_trainable == num_params
    assert model.flat.numel() == num_params + 2 * 5
    assert model.grad.numel() == num_params
    assert torch.equal(model.flat[num_params : num_params + 5], torch.zeros(5))
    assert torch.equal(model.flat[num_params + 5 :], torch.ones(5))


def test_flat_model_buffers_are_views_of_flat() -> None:
    """A training-mode forward updates the running statistics inside ``flat``."""
    module = _batchnorm_model()
    model = FlatModel(module)
    num_params = model.num_trainable
    x, _ = _data(16, features=4)
    module.train()
    module(x)
    bn = module[1]
    assert isinstance(bn, nn.BatchNorm1d)
    assert bn.running_mean is not None and bn.running_var is not None
    assert model.flat[num_params : num_params + 5].abs().sum() > 0
    assert torch.equal(model.flat[num_params : num_params + 5], bn.running_mean)
    assert torch.equal(model.flat[num_params + 5 :], bn.running_var)


def test_flat_model_rejects_float64() -> None:
    """A float64 model is a TrainingError telling the user to cast it."""
    with pytest.raises(TrainingError, match="float32"):
        FlatModel(_mlp().double())


# -------------------------------------------------------------------------------------- train vs reference
def test_train_matches_sgd_with_momentum_and_weight_decay() -> None:
    """One epoch with momentum 0.9 and weight decay 1e-3 ends at torch.optim.SGD's weights."""
    cfg = LocalTraining(epochs=1, batch_size=8, lr=0.1, momentum=0.9, weight_decay=1e-3)
    got, expected = _train_both(cfg)
    assert torch.allclose(got, expected, atol=1e-6)


def test_train_matches_sgd_over_several_epochs() -> None:
    """Three epochs (one permutation drawn per epoch) end at torch.optim.SGD's weights."""
    cfg = LocalTraining(epochs=3, batch_size=16, lr=0.05, momentum=0.9, weight_decay=1e-3)
    got, expected = _train_both(cfg)
    assert torch.allclose(got, expected, atol=1e-6)


def test_train_matches_sgd_with_max_steps() -> None:
    """``max_steps`` stops training mid-epoch at the same weights as the reference loop."""
    cfg = LocalTraining(epochs=3, max_steps=5, batch_size=16, lr=0.05, momentum=0.5)
    got, expected = _train_both(cfg)
    assert torch.allclose(got, expected, atol=1e-6)


def test_train_matches_sgd_with_clipping() -> None:
    """Norm clipping matches ``clip_grad_norm_`` before the SGD step."""
    cfg = LocalTraining(epochs=2, batch_size=8, lr=0.1, momentum=0.9, weight_decay=1e-3, clip_norm=0.1)
    got, expected = _train_both(cfg)
    assert torch.allclose(got, expected, atol=1e-5)


def test_train_matches_plain_sgd() -> None:
    """Without momentum, weight decay or clipping, training is plain SGD."""
    cfg = LocalTraining(epochs=2, batch_size=7, lr=0.2)
    got, expected = _train_both(cfg)
    assert torch.allclose(got, expected, atol=1e-6)


# --------------------------------------------------------------------------------------------- train result
def test_train_returns_base_minus_local_weights() -> None:
    """``delta`` is ``base - w_local``."""
    model = FlatModel(_mlp())
    base = model.flat.clone()
    x, y = _data(40)
    result = train(model, base, x, y, LocalTraining(batch_size=8), _gen())
    assert torch.equal(result.delta, base - model.flat)
    assert result.delta.abs().sum() > 0


def test_train_reports_samples_steps_loss_and_memory() -> None:
    """The result counts samples and steps, and reports a finite loss and memory above the model's own bytes."""
    model = FlatModel(_mlp())
    x, y = _data(50)
    cfg = LocalTraining(epochs=2, batch_size=16)
    result = train(model, model.flat.clone(), x, y, cfg, _gen())
    assert result.num_samples == 50
    assert result.steps == 2 * math.ceil(50 / 16)
    assert math.isfinite(result.loss)
    assert result.loss > 0
    assert result.peak_mem_bytes > model.nbytes


def test_train_steps_capped_by_max_steps() -> None:
    """``max_steps`` caps the number of steps reported."""
    model = FlatModel(_mlp())
    x, y = _data(50)
    result = train(model, model.flat.clone(), x, y, LocalTraining(epochs=4, max_steps=3, batch_size=16), _gen())
    assert result.steps == 3


@PROPERTY
@given(
    n=st.integers(min_value=1, max_value=20),
    batch_size=st.integers(min_value=1, max_value=8),
    epochs=st.integers(min_value=1, max_value=3),
    max_steps=st.none() | st.integers(min_value=1, max_value=10),
)
def test_train_steps_equal_steps_for(n: int, batch_size: int, epochs: int, max_steps: int | None) -> None:
    """``train`` takes exactly ``cfg.steps_for(n)`` steps."""
    model = FlatModel(MLP(2, (), 2))
    g = torch.Generator().manual_seed(n)
    x, y = torch.randn(n, 2, generator=g), torch.randint(0, 2, (n,), generator=g)
    cfg = LocalTraining(epochs=epochs, max_steps=max_steps, batch_size=batch_size)
    assert train(model, model.flat.clone(), x, y, cfg, _gen()).steps == cfg.steps_for(n)


def test_train_leaves_base_unchanged() -> None:
    """The base weights passed in are read, never written."""
    model = FlatModel(_mlp())
    base = model.flat.clone()
    snapshot = base.clone()
    x, y = _data(30)
    train(model, base, x, y, LocalTraining(epochs=2, batch_size=8, momentum=0.9), _gen())
    assert torch.equal(base, snapshot)


def test_train_is_deterministic_for_a_seed() -> None:
    """The same generator seed on a reused model gives a bit-identical delta (momentum is reset)."""
    model = FlatModel(_mlp())
    base = model.flat.clone()
    x, y = _data(30)
    cfg = LocalTraining(epochs=2, batch_size=8, momentum=0.9)
    first = train(model, base, x, y, cfg, _gen(3))
    second = train(model, base, x, y, cfg, _gen(3))
    assert torch.equal(first.delta, second.delta)
    assert first.loss == second.loss


def test_train_batch_order_depends_on_seed() -> None:
    """Another generator seed gives another batch order, hence another delta."""
    model = FlatModel(_mlp())
    base = model.flat.clone()
    x, y = _data(30)
    cfg = LocalTraining(batch_size=8)
    first = train(model, base, x, y, cfg, _gen(3))
    second = train(model, base, x, y, cfg, _gen(4))
    assert not torch.equal(first.delta, second.delta)


@pytest.mark.parametrize("max_steps", [None, 3])
def test_train_on_indices_equals_train_on_the_gathered_rows(max_steps: int | None) -> None:
    """``indices=`` trains on those rows of the data set, bit for bit as if they had been gathered first."""
    x, y = _data(60)
    rows = torch.tensor([5, 0, 41, 17, 33, 2, 59, 8, 21, 30, 12, 47, 3, 38, 26, 50, 9, 44, 1, 55])
    cfg = LocalTraining(epochs=2, batch_size=6, momentum=0.9, max_steps=max_steps)
    model = FlatModel(_mlp())
    base = model.flat.clone()
    gathered = train(model, base, x[rows], y[rows], cfg, _gen(3))
    direct = train(model, base, x, y, cfg, _gen(3), indices=rows)
    assert torch.equal(gathered.delta, direct.delta)
    assert (direct.num_samples, direct.steps, direct.loss) == (20, gathered.steps, gathered.loss)
    assert direct.peak_mem_bytes == gathered.peak_mem_bytes


def test_train_rejects_empty_indices() -> None:
    """No rows to train on is a TrainingError, like a client without samples."""
    model = FlatModel(_mlp())
    x, y = _data(10)
    with pytest.raises(TrainingError, match="no samples"):
        train(model, model.flat.clone(), x, y, LocalTraining(), _gen(), indices=torch.zeros(0, dtype=torch.int64))


def test_train_rejects_empty_client() -> None:
    """A client without samples is a TrainingError."""
    model = FlatModel(_mlp())
    x, y = _data(0)
    with pytest.raises(TrainingError, match="no samples"):
        train(model, model.flat.clone(), x, y, LocalTraining(), _gen())


def test_train_bf16_is_close_to_fp32_but_not_equal() -> None:
    """bf16 autocast runs on CPU, lands within 5% of the fp32 delta, and is not bit-identical to it."""
    model = FlatModel(_mlp())
    base = model.flat.clone()
    x, y = _data(48)
    fp32 = train(model, base, x, y, LocalTraining(epochs=2, batch_size=16, lr=0.05), _gen())
    bf16 = train(model, base, x, y, LocalTraining(epochs=2, batch_size=16, lr=0.05, precision="bf16"), _gen())
    assert math.isfinite(bf16.loss)
    assert not torch.equal(bf16.delta, fp32.delta)
    relative = torch.linalg.vector_norm(bf16.delta - fp32.delta) / torch.linalg.vector_norm(fp32.delta)
    assert relative < 0.05


# ---------------------------------------------------------------------------------------------- evaluate
def test_evaluate_accuracy_and_loss_by_hand() -> None:
    """Logistic regression with identity weights: accuracy is the hand count, loss is cross-entropy's mean."""
    model = FlatModel(MLP(3, (), 3))
    weights = torch.cat([torch.eye(3).reshape(-1), torch.zeros(3)])
    x = torch.tensor([[3.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 1.0], [1.0, 5.0, 0.0], [0.0, 0.0, 0.5]])
    y = torch.tensor([0, 1, 1, 1, 2])  # argmax of each row is 0, 1, 2, 1, 2: four of five correct
    result = evaluate(model, weights, x, y, batch_size=2)
    assert result.accuracy == 4 / 5
    assert result.num_samples == 5
    assert result.loss == pytest.approx(float(F.cross_entropy(x, y)), rel=1e-6)


class _ModeProbe(nn.Module):
    """A linear layer whose submodule records the mode of every forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(NUM_FEATURES, NUM_CLASSES))
        self.modes: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.modes.append(self.inner.training)
        out: torch.Tensor = self.inner(x)
        return out


def test_train_and_evaluate_switch_every_submodule_mode_in_turn() -> None:
    """Training after evaluation runs in training mode, and evaluation after training in evaluation mode."""
    probe = _ModeProbe().eval()
    model = FlatModel(probe)
    x, y = _data(8)
    for _ in range(2):
        probe.modes.clear()
        train(model, model.flat.clone(), x, y, LocalTraining(batch_size=4), _gen())
        assert probe.modes == [True, True]
        probe.modes.clear()
        evaluate(model, model.flat.clone(), x, y)
        assert probe.modes == [False]


# --------------------------------------------------------------------------------------------- steps_for
@pytest.mark.parametrize(
    ("epochs", "batch_size", "max_steps", "num_samples", "expected"),
    [
        (1, 32, None, 100, 4),
        (1, 32, None, 32, 1),
        (1, 32, None, 33, 2),
        (3, 10, None, 25, 9),
        (2, 10, 5, 25, 5),
        (5, 4, 100, 10, 15),
        (1, 8, 1, 1000, 1),
        (2, 5, None, 0, 0),
    ],
)
def test_steps_for(epochs: int, batch_size: int, max_steps: int | None, num_samples: int, expected: int) -> None:
    """``steps_for`` is ``epochs * ceil(n / batch_size)`` capped by ``max_steps``."""
    cfg = LocalTraining(epochs=epochs, batch_size=batch_size, max_steps=max_steps)
    assert cfg.steps_for(num_samples) == expected


# ------------------------------------------------------------------------------------- ModelPool / executor
@pytest.fixture
def main_threads() -> Iterator[int]:
    """Yield the main thread's intra-op thread count and restore torch's process default afterwards."""
    main_threads = torch.get_num_threads()
    yield main_threads
    torch.set_num_threads(main_threads)


def test_model_pool_reuses_the_threads_model() -> None:
    """``get`` builds the calling thread's model once and returns the same object afterwards."""
    pool = ModelPool(_mlp)
    first = pool.get()
    assert pool.get() is first
    assert pool.built == 1


def test_model_pool_builds_one_model_per_thread() -> None:
    """Another thread gets its own model."""
    pool = ModelPool(_mlp)
    mine = pool.get()
    theirs: list[FlatModel] = []
    thread = threading.Thread(target=lambda: theirs.append(pool.get()))
    thread.start()
    thread.join()
    assert theirs[0] is not mine
    assert pool.built == 2


@pytest.mark.usefixtures("main_threads")
def test_executor_builds_at_most_one_model_per_worker() -> None:
    """Eight training jobs on two workers build at most two models and reuse them."""
    executor = ThreadTrainingExecutor(_mlp, workers=2)
    x, y = _data(20)
    cfg = LocalTraining(batch_size=8)

    def job(seed: int) -> int:
        model = executor.models.get()
        train(model, torch.zeros(model.flat.numel()), x, y, cfg, _gen(seed))
        return id(model)

    try:
        ids = {f.result() for f in [executor.pool.submit(job, seed) for seed in range(8)]}
    finally:
        executor.shutdown()
    assert 1 <= executor.models.built <= 2
    assert len(ids) == executor.models.built


def test_executor_sets_worker_threads_only(main_threads: int) -> None:
    """Workers run with ``threads_per_worker`` intra-op threads; the main thread keeps its own count."""
    per_worker = 1 if main_threads != 1 else 2
    executor = ThreadTrainingExecutor(_mlp, workers=2, threads_per_worker=per_worker)
    try:
        counts = [f.result() for f in [executor.pool.submit(torch.get_num_threads) for _ in range(6)]]
    finally:
        executor.shutdown()
    assert counts == [per_worker] * 6
    assert torch.get_num_threads() == main_threads


@pytest.mark.parametrize("vectorized", [False, True])
def test_executor_starts_its_threads_where_it_is_made_and_no_more_later(main_threads: int, vectorized: bool) -> None:
    """start_threads starts one thread per worker, each with ``threads_per_worker`` intra-op threads, where it is
    called; the jobs after it start none (a run's event loop starts no thread), and a second call starts none."""
    per_worker = 1 if main_threads != 1 else 2
    executor = ThreadTrainingExecutor(_mlp, workers=3, threads_per_worker=per_worker, vectorized=vectorized)
    try:

        def workers() -> set[int | None]:
            return {t.ident for t in threading.enumerate() if t.name.startswith("flasync-train")}

        before = workers()
        executor.start_threads()
        started = workers() - before
        assert len(started) == 3
        executor.start_threads()
        counts = [f.result() for f in [executor.pool.submit(torch.get_num_threads) for _ in range(9)]]
        assert workers() - before == started and counts == [per_worker] * 9
    finally:
        executor.shutdown()


def test_executor_leaves_other_threads_default(main_threads: int) -> None:
    """A thread started after the workers ran still gets the main thread's intra-op thread count."""
    per_worker = 1 if main_threads != 1 else 2
    executor = ThreadTrainingExecutor(_mlp, workers=1, threads_per_worker=per_worker)
    try:
        executor.pool.submit(torch.get_num_threads).result()
    finally:
        executor.shutdown()
    counts: list[int] = []
    thread = threading.Thread(target=lambda: counts.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert counts == [main_threads]


def test_loss_scaler_backs_off_on_overflow_and_grows_after_good_steps() -> None:
    """A row with Inf is skipped and its scale halved; after growth_interval good steps a scale doubles."""
    from flasync.training.local import LossScaler

    scaler = LossScaler(2, torch.device("cpu"), init_scale=8.0, growth_interval=2)
    ok = scaler.update_rows(torch.tensor([[1.0, 2.0], [math.inf, 0.0]]), 2)
    assert ok.tolist() == [True, False]
    assert scaler.scale.tolist() == [8.0, 4.0]
    scaler.update_rows(torch.ones(2, 2), 2)
    assert scaler.scale.tolist() == [16.0, 4.0]  # row 0: two good steps in a row; row 1: one since its overflow


def test_gradient_checkpointing_gives_the_same_update_with_less_activation_memory() -> None:
    """checkpoint_segments recomputes Sequential blocks: same delta (to float rounding), smaller saved activations."""
    from flasync.training.local import FlatModel, LocalTraining, set_checkpointing, train
    from flasync.training.models import MLP

    torch.manual_seed(0)
    x = torch.randn(256, 32)
    y = torch.randint(0, 10, (256,))
    base_model = MLP(32, (256, 256, 256, 256), 10)
    base = FlatModel(base_model).flat.clone()
    results = {}
    for segments in (0, 2):
        model = FlatModel(MLP(32, (256, 256, 256, 256), 10))
        cfg = LocalTraining(epochs=1, batch_size=64, lr=0.05, momentum=0.9, checkpoint_segments=segments)
        results[segments] = train(model, base, x, y, cfg, torch.Generator().manual_seed(1))
    torch.testing.assert_close(results[2].delta, results[0].delta, rtol=1e-5, atol=1e-6)
    assert results[2].peak_mem_bytes < results[0].peak_mem_bytes
    # Switching it off restores the plain forward.
    module = MLP(32, (16,), 10)
    assert set_checkpointing(module, 3) == 1
    assert "forward" in vars(module.layers)
    set_checkpointing(module, 0)
    assert "forward" not in vars(module.layers)


def test_fedprox_adds_mu_times_the_distance_to_the_base_to_every_step() -> None:
    """Two full-batch steps with proximal_mu match w <- w - lr (grad L(w) + mu (w - w_base)), computed by hand."""
    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    base = flat_parameters(module)
    lr, mu = 0.5, 2.0
    cfg = LocalTraining(epochs=2, batch_size=8, lr=lr, proximal_mu=mu)
    result = train(FlatModel(nn.Linear(3, 2)), base, x, y, cfg, torch.Generator().manual_seed(1))

    w = base.clone()
    for _ in range(2):
        weight = w[:6].view(2, 3).clone().requires_grad_(True)
        bias = w[6:].clone().requires_grad_(True)
        loss = nn.functional.cross_entropy(x @ weight.T + bias, y)
        loss.backward()
        g = torch.cat([weight.grad.flatten(), bias.grad])  # type: ignore[union-attr]
        w = w - lr * (g + mu * (w - base))
    torch.testing.assert_close(result.delta, base - w, rtol=0, atol=1e-6)
    plain = train(FlatModel(nn.Linear(3, 2)), base, x, y, LocalTraining(epochs=2, batch_size=8, lr=lr), None)
    assert not torch.allclose(plain.delta, result.delta)  # the second step is pulled back towards the base


def test_a_gradient_correction_is_added_to_every_step() -> None:
    """SCAFFOLD: one SGD step with correction v moves the weights by -lr (g + v): the delta grows by lr v."""
    torch.manual_seed(0)
    model = FlatModel(nn.Sequential(nn.Linear(6, 3)))
    base = model.flat.clone()
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    cfg = LocalTraining(epochs=1, batch_size=8, lr=0.1)
    plain = train(model, base, x, y, cfg, torch.Generator().manual_seed(1))
    v = torch.linspace(-1, 1, base.numel())
    corrected = train(model, base, x, y, cfg, torch.Generator().manual_seed(1), correction=v)
    torch.testing.assert_close(corrected.delta - plain.delta, 0.1 * v)


# ------------------------------------------------------------------------------------------ local objectives


class _MeanOnly:
    """An objective that wrongly returns the batch mean instead of per-sample losses."""

    vectorizable = True

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets)


def _train_with(objective: Focal | None) -> torch.Tensor:
    model = FlatModel(_mlp())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        base = flat_parameters(_mlp())
    x, y = _data(60)
    cfg = LocalTraining(epochs=2, batch_size=16, lr=0.1, momentum=0.9, objective=objective)
    return train(model, base, x, y, cfg, _gen()).delta


def test_an_objective_equal_to_cross_entropy_trains_as_the_default() -> None:
    """Focal loss with gamma 0 (cross-entropy, per sample) ends within float tolerance of the default path."""
    torch.testing.assert_close(_train_with(Focal(0.0)), _train_with(None), rtol=0, atol=1e-6)


def test_a_custom_objective_changes_training_and_is_deterministic() -> None:
    """Focal loss with gamma 2 gives another delta than cross-entropy, and the same one bit for bit twice."""
    focal = _train_with(Focal(2.0))
    assert not torch.allclose(focal, _train_with(None), atol=1e-4)
    assert torch.equal(focal, _train_with(Focal(2.0)))


def test_an_objective_must_return_one_loss_per_sample() -> None:
    """A batch mean instead of per-sample losses is a TrainingError naming the objective."""
    with pytest.raises(TrainingError, match=r"_MeanOnly\.loss returned shape \(\): .* one loss per sample"):
        _train_with(_MeanOnly())  # type: ignore[arg-type]


def test_an_objective_is_not_hashed_with_the_hyper_parameters() -> None:
    """Any object can be an objective (cohorts group jobs by their LocalTraining's hash)."""

    class Unhashable(Focal):
        __hash__ = None  # type: ignore[assignment]

    cfg = LocalTraining(objective=Unhashable(1.0))
    assert hash(cfg) == hash(LocalTraining())
    assert cfg != LocalTraining()
