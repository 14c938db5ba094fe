"""Tests of the server optimizers in flasync.aggregation.optimizers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from flasync.aggregation import FlatAdam, FlatSGD, ServerOptimizer, TorchServerOptimizer, fedavg

_VALUES = st.floats(min_value=-10.0, max_value=10.0, width=32)


@st.composite
def _vectors(draw: st.DrawFn, count: int) -> list[Tensor]:
    num_params = draw(st.integers(min_value=1, max_value=16))
    row = st.lists(_VALUES, min_size=num_params, max_size=num_params)
    return [torch.tensor(draw(row), dtype=torch.float32) for _ in range(count)]


def test_sgd_hand_computed() -> None:
    """SGD subtracts lr times the pseudo-gradient from the weights."""
    weights = torch.tensor([1.0, 2.0])
    ServerOptimizer.sgd(weights, lr=0.5).step(torch.tensor([2.0, -4.0]))
    assert torch.equal(weights, torch.tensor([0.0, 4.0]))


@given(vectors=_vectors(2))
def test_sgd_lr_one_is_w_minus_g(vectors: list[Tensor]) -> None:
    """SGD with lr = 1 and no momentum gives exactly w - g."""
    weights, gradient = vectors
    expected = weights - gradient
    ServerOptimizer.sgd(weights).step(gradient)
    assert torch.equal(weights, expected)


def test_sgd_lr_one_on_fedavg_is_fedavg() -> None:
    """A unit SGD step on the FedAvg delta lands on the sample-weighted mean of the local models."""
    weights = torch.tensor([1.0, 1.0])
    locals_ = [torch.tensor([0.0, 2.0]), torch.tensor([4.0, 2.0])]
    deltas = [weights - local for local in locals_]
    ServerOptimizer.sgd(weights).step(fedavg(deltas, [3, 1]))
    assert torch.allclose(weights, torch.tensor([1.0, 2.0]))


def test_step_updates_weights_in_place() -> None:
    """step writes into the weights tensor the optimizer was built on."""
    weights = torch.zeros(3)
    optimizer = ServerOptimizer.sgd(weights)
    storage = weights.data_ptr()
    optimizer.step(torch.ones(3))
    assert optimizer.weights is weights
    assert weights.data_ptr() == storage
    assert torch.equal(weights, -torch.ones(3))


def test_step_clears_grad_and_keeps_requires_grad() -> None:
    """step leaves no gradient attached and does not turn on requires_grad."""
    weights = torch.zeros(3)
    ServerOptimizer.sgd(weights).step(torch.ones(3))
    assert weights.grad is None
    assert not weights.requires_grad


def test_step_leaves_pseudo_gradient_unchanged() -> None:
    """step reads the pseudo-gradient without writing into it."""
    gradient = torch.tensor([1.0, 2.0])
    ServerOptimizer.sgd(torch.zeros(2), momentum=0.9).step(gradient)
    assert torch.equal(gradient, torch.tensor([1.0, 2.0]))


@given(
    vectors=_vectors(3),
    lr=st.floats(min_value=0.01, max_value=2.0),
    momentum=st.floats(min_value=0.0, max_value=0.99),
)
def test_momentum_matches_hand_unrolled_two_steps(vectors: list[Tensor], lr: float, momentum: float) -> None:
    """Two momentum steps match b1 = g1, b2 = mu b1 + g2, w2 = w0 - lr b1 - lr b2."""
    weights, first, second = vectors
    start = weights.clone()
    optimizer = ServerOptimizer.sgd(weights, lr=lr, momentum=momentum)
    optimizer.step(first)
    optimizer.step(second)
    buffer_1 = first
    buffer_2 = momentum * buffer_1 + second
    expected = start - lr * buffer_1 - lr * buffer_2
    assert torch.allclose(weights, expected, rtol=1e-5, atol=1e-4)


def test_nesterov_hand_computed() -> None:
    """Nesterov momentum steps with g + mu b."""
    weights = torch.tensor([0.0])
    optimizer = ServerOptimizer.sgd(weights, lr=1.0, momentum=0.5, nesterov=True)
    optimizer.step(torch.tensor([2.0]))  # b = 2, step 2 + 1 = 3
    optimizer.step(torch.tensor([2.0]))  # b = 1 + 2 = 3, step 2 + 1.5 = 3.5
    assert torch.allclose(weights, torch.tensor([-6.5]))


@pytest.mark.slow
@settings(deadline=None)  # the first torch.optim optimizer imports torch._dynamo, for seconds
@given(vectors=_vectors(4), lr=st.floats(min_value=1e-4, max_value=1.0))
def test_adam_matches_torch_adam(vectors: list[Tensor], lr: float) -> None:
    """ServerOptimizer.adam takes the very steps of torch.optim.Adam fed the same gradients (same bits on the CPU)."""
    weights, *gradients = vectors
    reference = weights.clone().requires_grad_(True)
    torch_adam = torch.optim.Adam([reference], lr=lr, betas=(0.8, 0.99), eps=1e-6)
    server = ServerOptimizer.adam(weights, lr=lr, betas=(0.8, 0.99), eps=1e-6)
    for gradient in gradients:
        server.step(gradient)
        reference.grad = gradient.clone()
        torch_adam.step()
    assert torch.equal(weights, reference.detach())


@settings(deadline=None)
@given(
    vectors=_vectors(4),
    lr=st.floats(min_value=1e-4, max_value=2.0),
    momentum=st.sampled_from([0.0, 0.5, 0.9]),
    nesterov=st.booleans(),
)
@pytest.mark.slow
def test_sgd_matches_torch_sgd(vectors: list[Tensor], lr: float, momentum: float, nesterov: bool) -> None:
    """ServerOptimizer.sgd takes the very steps of torch.optim.SGD (heavy ball or Nesterov)."""
    nesterov = nesterov and momentum > 0
    weights, *gradients = vectors
    reference = weights.clone().requires_grad_(True)
    torch_sgd = torch.optim.SGD([reference], lr=lr, momentum=momentum, nesterov=nesterov)
    server = ServerOptimizer.sgd(weights, lr=lr, momentum=momentum, nesterov=nesterov)
    for gradient in gradients:
        server.step(gradient)
        reference.grad = gradient.clone()
        torch_sgd.step()
    assert torch.equal(weights, reference.detach())


@pytest.mark.slow
def test_built_in_optimizers_do_not_import_dynamo() -> None:
    """Building and stepping sgd/adam never imports torch._dynamo (torch.optim does, for seconds)."""
    code = (
        "import sys, torch\n"
        "from flasync.aggregation import ServerOptimizer\n"
        "for make in (ServerOptimizer.sgd, ServerOptimizer.adam):\n"
        "    make(torch.zeros(3)).step(torch.ones(3))\n"
        "assert 'torch._dynamo' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.slow
def test_torch_server_optimizer_steps_a_torch_optimizer() -> None:
    """TorchServerOptimizer steps any torch optimizer over the weights and clears the gradient after."""
    weights = torch.tensor([1.0, 2.0])
    server = TorchServerOptimizer(weights, torch.optim.SGD([weights], lr=0.5, momentum=0.9))
    server.step(torch.tensor([2.0, -2.0]))
    assert torch.equal(weights, torch.tensor([0.0, 3.0]))
    assert weights.grad is None and server.state_nbytes == 8
    restored_weights = weights.clone()
    restored = TorchServerOptimizer(restored_weights, torch.optim.SGD([restored_weights], lr=0.5, momentum=0.9))
    restored.load_state_dict(server.state_dict())
    server.step(torch.ones(2))
    restored.step(torch.ones(2))
    assert torch.equal(restored_weights, weights)


def test_adam_first_step_hand_computed() -> None:
    """The first Adam step moves each weight by about lr against the sign of its gradient."""
    weights = torch.tensor([1.0, 1.0])
    ServerOptimizer.adam(weights, lr=0.1).step(torch.tensor([3.0, -0.5]))
    assert torch.allclose(weights, torch.tensor([0.9, 1.1]))


def test_state_nbytes_sgd_without_momentum_is_zero() -> None:
    """Plain SGD keeps no state."""
    optimizer = ServerOptimizer.sgd(torch.zeros(10))
    optimizer.step(torch.ones(10))
    assert optimizer.state_nbytes == 0


def test_state_nbytes_counts_momentum_buffer() -> None:
    """SGD with momentum keeps one model-sized buffer."""
    optimizer = ServerOptimizer.sgd(torch.zeros(10), momentum=0.9)
    optimizer.step(torch.ones(10))
    assert optimizer.state_nbytes == 40


def test_state_nbytes_counts_adam_moments() -> None:
    """Adam keeps two model-sized moments plus its step counter."""
    optimizer = ServerOptimizer.adam(torch.zeros(10))
    assert optimizer.state_nbytes == 0
    optimizer.step(torch.ones(10))
    assert optimizer.state_nbytes == 2 * 40


def test_state_dict_round_trip_continues_identically() -> None:
    """An optimizer restored from state_dict takes the same next step as the original."""
    original_weights = torch.tensor([1.0, -1.0])
    original = ServerOptimizer.adam(original_weights, lr=0.1)
    original.step(torch.tensor([0.5, 2.0]))
    restored_weights = original_weights.clone()
    restored = ServerOptimizer.adam(restored_weights, lr=0.1)
    restored.load_state_dict(original.state_dict())
    original.step(torch.tensor([-1.0, 1.0]))
    restored.step(torch.tensor([-1.0, 1.0]))
    assert torch.equal(restored_weights, original_weights)


def test_sgd_state_dict_round_trip_through_torch_save(tmp_path: Path) -> None:
    """A momentum state survives torch.save / torch.load(weights_only=True), as in a checkpoint."""
    original_weights = torch.tensor([1.0, -1.0])
    original = ServerOptimizer.sgd(original_weights, lr=0.5, momentum=0.9, nesterov=True)
    original.step(torch.tensor([0.5, 2.0]))
    torch.save(original.state_dict(), tmp_path / "state.pt")
    restored_weights = original_weights.clone()
    restored = ServerOptimizer.sgd(restored_weights, lr=0.5, momentum=0.9, nesterov=True)
    restored.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    original.step(torch.tensor([-1.0, 1.0]))
    restored.step(torch.tensor([-1.0, 1.0]))
    assert torch.equal(restored_weights, original_weights)


def test_load_state_dict_refuses_another_kind_or_size() -> None:
    """An Adam state does not load into SGD; moments of another size do not load at all."""
    adam = ServerOptimizer.adam(torch.zeros(2))
    adam.step(torch.ones(2))
    with pytest.raises(ValueError, match="not an SGD optimizer state"):
        ServerOptimizer.sgd(torch.zeros(2)).load_state_dict(adam.state_dict())
    with pytest.raises(ValueError, match=r"expected a tensor of shape \(3,\)"):
        ServerOptimizer.adam(torch.zeros(3)).load_state_dict(adam.state_dict())


def test_state_dict_is_a_snapshot() -> None:
    """state_dict copies the state tensors, so later steps do not change it."""
    optimizer = ServerOptimizer.sgd(torch.zeros(2), momentum=0.9)
    optimizer.step(torch.ones(2))
    state = optimizer.state_dict()
    optimizer.step(torch.ones(2))
    assert torch.equal(state["buffer"], torch.ones(2))


def test_step_rejects_wrong_shape() -> None:
    """step raises ValueError on a pseudo-gradient of another shape."""
    with pytest.raises(ValueError, match=r"pseudo_gradient has shape \(3,\), expected \(2,\)"):
        ServerOptimizer.sgd(torch.zeros(2)).step(torch.zeros(3))


def test_step_rejects_wrong_dtype() -> None:
    """step raises ValueError on a pseudo-gradient of another dtype."""
    with pytest.raises(ValueError, match="dtype"):
        ServerOptimizer.sgd(torch.zeros(2)).step(torch.zeros(2, dtype=torch.float64))


def test_rejects_non_flat_weights() -> None:
    """A server optimizer needs flat weights."""
    with pytest.raises(ValueError, match="flat"):
        ServerOptimizer.sgd(torch.zeros(2, 2))


def test_rejects_integer_weights() -> None:
    """A server optimizer needs floating-point weights."""
    weights = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="floating point"):
        ServerOptimizer.sgd(weights)


def test_rejects_optimizer_over_other_tensors() -> None:
    """A server optimizer refuses a torch optimizer that does not hold exactly its weights."""
    weights = torch.zeros(2)
    with pytest.raises(ValueError, match="another tensor"):
        TorchServerOptimizer(weights, torch.optim.SGD([torch.zeros(2)], lr=1.0))
    with pytest.raises(ValueError, match="2 tensors"):
        TorchServerOptimizer(weights, torch.optim.SGD([weights, torch.zeros(2)], lr=1.0))


@pytest.mark.parametrize(
    "kwargs",
    [{"lr": -1.0}, {"momentum": -0.5}, {"nesterov": True}],
)
def test_sgd_rejects_invalid_hyperparameters(kwargs: dict[str, float]) -> None:
    """sgd raises ValueError on a negative lr or momentum, or Nesterov without momentum."""
    with pytest.raises(ValueError, match=r"lr|momentum"):
        ServerOptimizer.sgd(torch.zeros(2), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [{"lr": -1.0}, {"eps": -1.0}, {"betas": (1.0, 0.999)}, {"betas": (0.9, -0.1)}],
)
def test_adam_rejects_invalid_hyperparameters(kwargs: dict[str, object]) -> None:
    """adam raises ValueError on a negative lr or eps, or a beta outside [0, 1)."""
    with pytest.raises(ValueError, match=r"lr|eps|beta"):
        ServerOptimizer.adam(torch.zeros(2), **kwargs)  # type: ignore[arg-type]


def test_config_builds_nesterov_sgd_and_adam() -> None:
    """server.optimizer configs become the flat optimizers with their hyperparameters."""
    from flasync.config import AdamServerOptimizer, SGDServerOptimizer
    from flasync.runtime.build import make_server_optimizer

    sgd = make_server_optimizer(torch.zeros(2), SGDServerOptimizer(lr=0.5, momentum=0.9, nesterov=True))
    assert isinstance(sgd, FlatSGD) and (sgd.lr, sgd.momentum, sgd.nesterov) == (0.5, 0.9, True)
    adam = make_server_optimizer(torch.zeros(2), AdamServerOptimizer(lr=0.1, beta1=0.8, beta2=0.9, eps=1e-4))
    assert isinstance(adam, FlatAdam) and (adam.lr, adam.beta1, adam.beta2, adam.eps) == (0.1, 0.8, 0.9, 1e-4)


# ------------------------------------------------------------------------------------------ FedAdagrad, FedYogi
def test_fedadagrad_follows_the_papers_equations() -> None:
    """Two steps of FedAdagrad against Reddi et al. 2021, Algorithm 2, computed by hand."""
    from flasync.aggregation import FlatAdaptive

    w = torch.tensor([1.0, -2.0])
    opt = ServerOptimizer.adagrad(w, lr=0.1, beta1=0.5, tau=0.01)
    assert isinstance(opt, FlatAdaptive)
    g1, g2 = torch.tensor([0.2, -0.4]), torch.tensor([0.1, 0.3])
    opt.step(g1)
    m = 0.5 * g1  # m0 = 0
    v = torch.full((2,), 0.01**2) + g1**2  # v starts at tau^2
    expected = torch.tensor([1.0, -2.0]) - 0.1 * m / (v.sqrt() + 0.01)
    torch.testing.assert_close(w, expected)
    opt.step(g2)
    m = 0.5 * m + 0.5 * g2
    v = v + g2**2
    expected = expected - 0.1 * m / (v.sqrt() + 0.01)
    torch.testing.assert_close(w, expected)


def test_fedyogi_follows_the_papers_equations() -> None:
    """Yogi's second moment moves by (1 - beta2) g^2 towards g^2, in the direction of sign(g^2 - v)."""
    w = torch.tensor([0.0, 0.0, 0.0])
    opt = ServerOptimizer.yogi(w, lr=0.5, beta1=0.9, beta2=0.75, tau=0.1)
    g = torch.tensor([1.0, -0.05, 0.0])
    opt.step(g)
    v0 = torch.full((3,), 0.01)
    v = v0 - 0.25 * g**2 * torch.sign(v0 - g**2)
    m = 0.1 * g
    torch.testing.assert_close(w, -0.5 * m / (v.sqrt() + 0.1))
    # The first coordinate's v grew (g^2 > v), the second's shrank (g^2 < v), the third's stayed.
    state = opt.state_dict()
    assert state["v"][0] > 0.01 and state["v"][1] < 0.01 and state["v"][2] == pytest.approx(0.01)


def test_adaptive_optimizers_checkpoint_and_refuse_bad_settings() -> None:
    """state_dict round-trips (the next step is the same); tau <= 0 and beta out of range are refused."""
    w1, w2 = torch.zeros(3), torch.zeros(3)
    first, second = ServerOptimizer.yogi(w1, lr=0.1), ServerOptimizer.yogi(w2, lr=0.1)
    first.step(torch.tensor([0.3, -0.1, 0.2]))
    second.load_state_dict(first.state_dict())
    w2.copy_(w1)
    first.step(torch.tensor([0.1, 0.1, -0.4]))
    second.step(torch.tensor([0.1, 0.1, -0.4]))
    assert torch.equal(w1, w2)
    with pytest.raises(ValueError, match="tau"):
        ServerOptimizer.adagrad(torch.zeros(2), tau=0.0)
    with pytest.raises(ValueError, match="beta2"):
        ServerOptimizer.yogi(torch.zeros(2), beta2=1.0)
    with pytest.raises(ValueError, match="not a yogi"):
        second.load_state_dict(ServerOptimizer.adagrad(torch.zeros(3)).state_dict())


@pytest.mark.parametrize("kind", ["adagrad", "yogi"])
@pytest.mark.parametrize("server", ["fedavg", "fedbuff"])
@pytest.mark.slow
def test_fedadagrad_and_fedyogi_run_under_fedavg_and_fedbuff(kind: str, server: str) -> None:
    """The config picks them for either server; the run is deterministic and learns."""
    import flasync
    from flasync.testing import small_config

    section = {"kind": server, "optimizer": {"kind": kind, "lr": 0.03, "tau": 0.01}}
    if server == "fedavg":
        section["clients_per_round"] = 5
    config = small_config(server=section)
    first, second = flasync.run(config), flasync.run(config)
    assert first.weights_sha256 == second.weights_sha256
    assert first.accuracy > 0.3  # 10 classes: well above chance after 12 versions


def test_a_bad_adaptive_setting_is_a_one_line_config_error() -> None:
    """tau must be > 0, named by its field."""
    import flasync
    from flasync.testing import small_config

    with pytest.raises(flasync.ConfigError, match=r"server\.optimizer\.yogi\.tau|server\.optimizer.*tau"):
        small_config("server.optimizer={kind: yogi, tau: 0}")


@given(
    vectors=_vectors(3),
    lr=st.floats(min_value=0.01, max_value=2.0),
    momentum=st.sampled_from([0.0, 0.9]),
    adam=st.booleans(),
)
def test_steps_on_tensors_outside_autograd_equal_steps_on_tensors_in_it(
    vectors: list[Tensor], lr: float, momentum: float, adam: bool
) -> None:
    """Weights or pseudo-gradients that require grad step to the same bits as plain ones, and stay out of a graph."""

    def build(weights: Tensor) -> ServerOptimizer:
        return ServerOptimizer.adam(weights, lr=lr) if adam else ServerOptimizer.sgd(weights, lr=lr, momentum=momentum)

    initial, first, second = vectors
    plain = initial.clone()
    tracked = initial.clone().requires_grad_()
    plain_optimizer, tracked_optimizer = build(plain), build(tracked)
    for gradient in (first, second):
        plain_optimizer.step(gradient)
        tracked_optimizer.step(gradient.clone().requires_grad_())
    assert torch.equal(plain, tracked.detach())
    assert not plain.requires_grad and tracked.requires_grad and tracked.grad_fn is None
