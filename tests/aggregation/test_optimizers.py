"""Tests of the server optimizers in flasync.aggregation.optimizers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

from flasync.aggregation import ServerOptimizer, fedavg

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


@given(vectors=_vectors(4), lr=st.floats(min_value=1e-4, max_value=1.0))
def test_adam_matches_torch_adam(vectors: list[Tensor], lr: float) -> None:
    """ServerOptimizer.adam follows torch.optim.Adam fed the same gradients."""
    weights, *gradients = vectors
    reference = weights.clone().requires_grad_(True)
    torch_adam = torch.optim.Adam([reference], lr=lr, betas=(0.8, 0.99), eps=1e-6)
    server = ServerOptimizer.adam(weights, lr=lr, betas=(0.8, 0.99), eps=1e-6)
    for gradient in gradients:
        server.step(gradient)
        reference.grad = gradient.clone()
        torch_adam.step()
    assert torch.allclose(weights, reference.detach(), rtol=1e-6, atol=1e-6)


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
    step = optimizer.optimizer.state[optimizer.weights]["step"]
    assert optimizer.state_nbytes == 2 * 40 + step.numel() * step.element_size()


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


def test_state_dict_is_a_snapshot() -> None:
    """state_dict copies the state tensors, so later steps do not change it."""
    optimizer = ServerOptimizer.sgd(torch.zeros(2), momentum=0.9)
    optimizer.step(torch.ones(2))
    state = optimizer.state_dict()
    optimizer.step(torch.ones(2))
    assert torch.equal(state["state"][0]["momentum_buffer"], torch.ones(2))


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
        ServerOptimizer(weights, torch.optim.SGD([torch.zeros(2)], lr=1.0))


def test_rejects_optimizer_over_other_tensors() -> None:
    """A server optimizer refuses a torch optimizer that does not hold exactly its weights."""
    weights = torch.zeros(2)
    with pytest.raises(ValueError, match="another tensor"):
        ServerOptimizer(weights, torch.optim.SGD([torch.zeros(2)], lr=1.0))
    with pytest.raises(ValueError, match="2 tensors"):
        ServerOptimizer(weights, torch.optim.SGD([weights, torch.zeros(2)], lr=1.0))


@pytest.mark.parametrize(
    "kwargs",
    [{"lr": -1.0}, {"momentum": -0.5}, {"nesterov": True}],
)
def test_sgd_rejects_invalid_hyperparameters(kwargs: dict[str, float]) -> None:
    """sgd raises ValueError on a negative lr or momentum, or Nesterov without momentum."""
    with pytest.raises(ValueError):  # noqa: PT011 - torch words these messages
        ServerOptimizer.sgd(torch.zeros(2), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [{"lr": -1.0}, {"eps": -1.0}, {"betas": (1.0, 0.999)}, {"betas": (0.9, -0.1)}],
)
def test_adam_rejects_invalid_hyperparameters(kwargs: dict[str, object]) -> None:
    """adam raises ValueError on a negative lr or eps, or a beta outside [0, 1)."""
    with pytest.raises(ValueError):  # noqa: PT011 - torch words these messages
        ServerOptimizer.adam(torch.zeros(2), **kwargs)  # type: ignore[arg-type]
