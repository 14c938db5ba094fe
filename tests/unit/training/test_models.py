"""Tests of flasync.training.models: the MLP, the small CNN and the parameter count."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, stack_module_state, vmap

from flasync.data import load_digits, train_test_split
from flasync.training.models import MLP, SmallCNN, num_parameters


@pytest.fixture(autouse=True)
def _seeded_torch() -> Iterator[None]:
    """Seed torch's default generator for each test and restore it afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield


def _inputs(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def _digits_mlp() -> nn.Module:
    return MLP(64, [32, 16], 10)


def _digits_cnn() -> nn.Module:
    return SmallCNN(in_channels=1, image_size=(8, 8), num_classes=10)


FACTORIES: dict[str, Callable[[], nn.Module]] = {"mlp": _digits_mlp, "cnn": _digits_cnn}


# ------------------------------------------------------------------------------------------------------ MLP
@pytest.mark.parametrize("hidden", [(), (32,), (64, 32, 16)])
def test_mlp_outputs_one_logit_per_class(hidden: tuple[int, ...]) -> None:
    """MLP maps (N, in_features) to (N, num_classes) for any number of hidden layers."""
    assert MLP(64, hidden, 10)(_inputs(5, 64)).shape == (5, 10)


def test_mlp_flattens_image_input() -> None:
    """MLP flattens (N, 1, 8, 8) to (N, 64) itself."""
    model = MLP(64, [16], 3)
    x = _inputs(4, 1, 8, 8)
    assert torch.equal(model(x), model(x.flatten(1)))


def test_mlp_stacks_linear_and_relu() -> None:
    """Each hidden layer is a Linear followed by a ReLU, and the output layer is a bare Linear."""
    kinds = [type(m) for m in MLP(8, [4, 3], 2).layers]
    assert kinds == [nn.Linear, nn.ReLU, nn.Linear, nn.ReLU, nn.Linear]


def test_mlp_rejects_zero_width() -> None:
    """A hidden width of 0 is a ValueError naming the sizes."""
    with pytest.raises(ValueError, match="hidden=\\(0,\\)"):
        MLP(64, [0], 10)


# ------------------------------------------------------------------------------------------------- SmallCNN
def test_cnn_accepts_flat_digits() -> None:
    """SmallCNN with in_channels=1 and image_size=(8, 8) takes digits rows of 64 pixels."""
    digits = load_digits()
    assert _digits_cnn()(digits.x[:7]).shape == (7, 10)


def test_cnn_flat_and_image_inputs_agree() -> None:
    """A flat row and the same pixels shaped (1, 8, 8) give the same logits."""
    model = _digits_cnn()
    x = _inputs(3, 64)
    assert torch.equal(model(x), model(x.reshape(3, 1, 8, 8)))


def test_cnn_handles_multichannel_rectangular_images() -> None:
    """SmallCNN works for 3-channel 12x10 images, flat or not."""
    model = SmallCNN(in_channels=3, image_size=(12, 10), num_classes=4, channels=(8, 6))
    assert model(_inputs(2, 3, 12, 10)).shape == (2, 4)
    assert model(_inputs(2, 3 * 12 * 10)).shape == (2, 4)


def test_cnn_handles_odd_image_size() -> None:
    """An odd image side is floored by the pooling, as the head's size expects."""
    model = SmallCNN(in_channels=1, image_size=(7, 5), num_classes=2)
    assert model(_inputs(2, 35)).shape == (2, 2)


@pytest.mark.parametrize("shape", [(2, 63), (2, 8, 8), (2, 3, 8, 8)])
def test_cnn_rejects_wrong_input_shape(shape: tuple[int, ...]) -> None:
    """Inputs that are neither (N, C*H*W) nor (N, C, H, W) raise a ValueError naming the shape."""
    with pytest.raises(ValueError, match="SmallCNN expects input"):
        _digits_cnn()(_inputs(*shape))


def test_cnn_has_no_batchnorm_or_dropout() -> None:
    """SmallCNN has no normalisation or dropout layers: no buffers, no train/eval difference."""
    model = _digits_cnn()
    forbidden = (nn.modules.batchnorm._BatchNorm, nn.Dropout, nn.Dropout2d)
    assert not any(isinstance(m, forbidden) for m in model.modules())
    assert list(model.buffers()) == []
    x = _inputs(4, 64)
    assert torch.equal(model.train()(x), model.eval()(x))


def test_cnn_rejects_image_smaller_than_pooling() -> None:
    """A 1-pixel-high image cannot be max-pooled by 2."""
    with pytest.raises(ValueError, match="at least 2x2"):
        SmallCNN(in_channels=1, image_size=(1, 8), num_classes=10)


def test_cnn_learns_digits() -> None:
    """Four epochs of SGD on digits reach over 90% test accuracy."""
    train, test = train_test_split(load_digits(), test_fraction=0.2, rng=np.random.default_rng(0))
    model = _digits_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    order = torch.Generator().manual_seed(0)
    for _ in range(4):
        for batch in torch.randperm(len(train), generator=order).split(64):
            loss = nn.functional.cross_entropy(model(train.x[batch]), train.y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        accuracy = float((model(test.x).argmax(1) == test.y).float().mean())
    assert accuracy > 0.9


# ------------------------------------------------------------------------------------------- torch.func
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_model_vmaps_over_stacked_parameters(name: str) -> None:
    """vmap of functional_call over stacked weights of 3 models matches calling each model."""
    models = [FACTORIES[name]() for _ in range(3)]
    params, buffers = stack_module_state(models)
    base = FACTORIES[name]().to("meta")
    x = _inputs(5, 64)

    def call(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = functional_call(base, (p, b), (x,))
        return out

    stacked = vmap(call)(params, buffers)
    expected = torch.stack([m(x) for m in models])
    torch.testing.assert_close(stacked, expected)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_model_gives_per_sample_gradients_under_vmap(name: str) -> None:
    """vmap(grad(...)) over single samples matches the gradient of each sample computed alone."""
    model = FACTORIES[name]()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = _inputs(4, 64), torch.tensor([0, 3, 9, 3])

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = functional_call(model, p, (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(logits, yi.unsqueeze(0))

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    for i in range(4):
        single = grad(loss)(params, x[i], y[i])
        for key in params:
            torch.testing.assert_close(per_sample[key][i], single[key])


# ----------------------------------------------------------------------------------------- num_parameters
def test_num_parameters_counts_weights_and_biases() -> None:
    """MLP(64, [32], 10) has 64*32 + 32 + 32*10 + 10 parameters."""
    assert num_parameters(MLP(64, [32], 10)) == 64 * 32 + 32 + 32 * 10 + 10


def test_num_parameters_of_cnn() -> None:
    """SmallCNN on digits counts both convolutions and the 32*4*4 -> 10 head."""
    expected = (1 * 9 * 16 + 16) + (16 * 9 * 32 + 32) + (32 * 4 * 4 * 10 + 10)
    assert num_parameters(_digits_cnn()) == expected


def test_num_parameters_counts_shared_parameters_once() -> None:
    """A layer used twice is counted once."""
    layer = nn.Linear(3, 3)
    assert num_parameters(nn.Sequential(layer, layer)) == 12


@pytest.mark.parametrize("hidden", [(), (16,), (16, 8)])
def test_mlp_cohort_gradients_equal_autograd(hidden: tuple[int, ...]) -> None:
    """The written-out backward pass of MLP.cohort_gradients gives autograd's gradients and losses through
    cohort_forward (to float rounding), weighted per sample: padding of weight 0 counts for nothing."""
    torch.manual_seed(0)
    k, batch = 5, 12
    model = MLP(10, hidden, 4)
    params = {
        name: (p.detach().unsqueeze(0) + 0.1 * torch.randn(k, *p.shape)).requires_grad_(True)
        for name, p in model.named_parameters()
    }
    x = torch.randn(k, batch, 10)
    y = torch.randint(0, 4, (k, batch))
    mask = torch.ones(k, batch)
    mask[1, 7:] = 0.0
    mask[3, 1:] = 0.0
    weights = mask / mask.sum(dim=1, keepdim=True)
    logits = model.cohort_forward(params, x)
    per_sample = nn.functional.cross_entropy(logits.reshape(k * batch, 4), y.reshape(-1), reduction="none")
    want_losses = (per_sample.view(k, batch) * weights).sum(dim=1)
    want = torch.autograd.grad(want_losses.sum(), list(params.values()))
    grads, losses = model.cohort_gradients({n: p.detach() for n, p in params.items()}, x, y, weights)
    assert sorted(grads) == sorted(params)
    torch.testing.assert_close(losses, want_losses.detach(), rtol=0, atol=1e-6)
    for name, expected in zip(params, want, strict=True):
        assert grads[name].shape == expected.shape
        torch.testing.assert_close(grads[name], expected, rtol=0, atol=1e-6)
    # A padded sample changes nothing.
    y_other = y.clone()
    y_other[1, 9] = (y[1, 9] + 1) % 4
    again, _ = model.cohort_gradients({n: p.detach() for n, p in params.items()}, x, y_other, weights)
    assert all(torch.equal(again[name], grads[name]) for name in grads)
