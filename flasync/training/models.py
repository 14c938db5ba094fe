"""Build the small classifiers that federated clients train.

Both models are plain stacks of stateless layers: no BatchNorm (no running statistics to average or to race
on between threads), no dropout (training is a deterministic function of weights, data and batch order), no
in-place operations and no branching on values, so :func:`torch.func.functional_call` and
:func:`torch.func.vmap` work on them. Weights are initialised by PyTorch's default initialisers, which draw
from torch's default generator; callers that need reproducible weights seed it for the construction (as the
runtime does) or load a state dict.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["MLP", "CharGRU", "SmallCNN", "build", "num_parameters"]


class MLP(nn.Module):
    """Classify flattened inputs with a fully connected ReLU network.

    ``Linear(in_features, hidden[0]) -> ReLU -> ... -> Linear(hidden[-1], num_classes)``; with ``hidden=()``
    it is multinomial logistic regression. Inputs of shape ``(N, *shape)`` are flattened to
    ``(N, prod(shape))``.

    Args:
        in_features: Number of input features after flattening.
        hidden: Widths of the hidden layers, in order.
        num_classes: Number of output logits.

    Raises:
        ValueError: If a size is not positive.
    """

    def __init__(self, in_features: int, hidden: Sequence[int], num_classes: int) -> None:
        super().__init__()
        widths = [in_features, *hidden, num_classes]
        if any(width < 1 for width in widths):
            raise ValueError(
                f"MLP sizes must be >= 1; got in_features={in_features}, hidden={tuple(hidden)}, "
                f"num_classes={num_classes}."
            )
        layers: list[nn.Module] = []
        for fan_in, fan_out in itertools.pairwise(widths[:-1]):
            layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-2], widths[-1]))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits of shape ``(N, num_classes)`` for inputs of shape ``(N, *shape)``."""
        logits: torch.Tensor = self.layers(x.flatten(1))
        return logits

    def cohort_forward(self, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Return the logits ``(K, B, num_classes)`` of K clients' weights on their own batches ``(K, B, *shape)``.

        ``params`` maps each parameter's name to the K clients' values, stacked on a leading axis. One batched
        matrix product per layer (``baddbmm``) gives each client exactly what :meth:`forward` gives it alone; the
        vectorized cohort trainer (:mod:`flasync.training.cohort`) calls this instead of ``vmap`` over :meth:`forward`,
        which costs more in Python per step than a small cohort's arithmetic.
        """
        h = x.flatten(2)
        for index, layer in enumerate(self.layers):
            if isinstance(layer, nn.Linear):
                weight, bias = params[f"layers.{index}.weight"], params[f"layers.{index}.bias"]
                h = torch.baddbmm(bias.unsqueeze(1), h, weight.transpose(1, 2))
            else:
                h = layer(h)  # ReLU: elementwise
        return h

    def cohort_gradients(
        self, params: Mapping[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Return K clients' gradients and losses for the weighted cross-entropy of :meth:`cohort_forward`.

        Client ``k``'s loss is ``sum_b weights[k, b] * cross_entropy(logits[k, b], y[k, b])`` (the trainer's
        weights are a batch's mask over its real size: the mean over real samples). The backward pass is written
        out (softmax minus one-hot, then one batched product per layer and the ReLU masks), which costs about 40%
        less than autograd's engine on the small graphs of a cohort's step; the result equals autograd's to
        float rounding.

        Args:
            params: As for :meth:`cohort_forward`.
            x: Inputs ``(K, B, *shape)``.
            y: Labels ``(K, B)``, int64.
            weights: ``(K, B)`` weight of each sample in its client's loss.

        Returns:
            The gradient of each parameter (named as in ``params``, ``(K, *shape)``) and the losses ``(K,)``.
        """
        with torch.no_grad():
            inputs: list[torch.Tensor] = []  # each Linear layer's input
            h = x.flatten(2)
            for index, layer in enumerate(self.layers):
                if isinstance(layer, nn.Linear):
                    inputs.append(h)
                    weight, bias = params[f"layers.{index}.weight"], params[f"layers.{index}.bias"]
                    h = torch.baddbmm(bias.unsqueeze(1), h, weight.transpose(1, 2))
                elif isinstance(layer, nn.ReLU):
                    h = torch.relu(h)
                else:  # a layer put in place of one of the built-in ones: its derivative is not written out here
                    raise TypeError(f"cohort_gradients takes Linear and ReLU layers, not {type(layer).__name__}")
            # log-softmax written out: torch.log_softmax is slow over rows as short as a classifier's (10 logits),
            # and the exponentials serve the softmax too.
            shifted = h - h.amax(dim=2, keepdim=True)
            exp = shifted.exp()
            total = exp.sum(dim=2, keepdim=True)
            log_p = shifted - total.log()
            labels = y.unsqueeze(2)
            losses = -(log_p.gather(2, labels).squeeze(2) * weights).sum(dim=1)
            delta = exp.div_(total)  # d loss / d logits: (softmax - one-hot) * weight
            delta.scatter_add_(2, labels, torch.full_like(labels, -1, dtype=delta.dtype))
            delta.mul_(weights.unsqueeze(2))
            grads: dict[str, torch.Tensor] = {}
            linear = [index for index, layer in enumerate(self.layers) if isinstance(layer, nn.Linear)]
            for position in range(len(linear) - 1, -1, -1):
                index = linear[position]
                grads[f"layers.{index}.weight"] = torch.bmm(delta.transpose(1, 2), inputs[position])
                grads[f"layers.{index}.bias"] = delta.sum(dim=1)
                if position:  # through this layer's weights and the ReLU before it (zero where its output is 0):
                    # ReLU's own backward kernel, one pass instead of a comparison, a cast and a product
                    delta = torch.ops.aten.threshold_backward(
                        torch.bmm(delta, params[f"layers.{index}.weight"]), inputs[position], 0.0
                    )
        return grads, losses


class SmallCNN(nn.Module):
    """Classify small images with two 3x3 convolutions and a linear head.

    ``conv3x3(C -> c1, pad 1) -> ReLU -> maxpool 2 -> conv3x3(c1 -> c2, pad 1) -> ReLU -> flatten ->
    Linear(c2 * (H // 2) * (W // 2) -> num_classes)``. The head sees every spatial position instead of a
    global average: on 8x8 digits, 5 epochs of SGD reach about 95% test accuracy this way and under 50% with
    adaptive average pooling.

    Accepts images ``(N, C, H, W)`` or flat rows ``(N, C * H * W)``, which it reshapes itself, so the digits
    data set ``(N, 64)`` works with ``in_channels=1, image_size=(8, 8)``.

    Args:
        in_channels: Input channels ``C``.
        image_size: ``(H, W)``, each at least 2.
        num_classes: Number of output logits.
        channels: Output channels ``(c1, c2)`` of the two convolutions.

    Raises:
        ValueError: If a size is out of range.
    """

    def __init__(
        self,
        *,
        in_channels: int,
        image_size: tuple[int, int],
        num_classes: int,
        channels: tuple[int, int] = (16, 32),
    ) -> None:
        super().__init__()
        height, width = image_size
        if min(in_channels, num_classes, *channels) < 1 or min(height, width) < 2:
            raise ValueError(
                f"SmallCNN needs sizes >= 1 and an image of at least 2x2; got in_channels={in_channels}, "
                f"image_size={tuple(image_size)}, num_classes={num_classes}, channels={tuple(channels)}."
            )
        self.image_shape = (in_channels, height, width)
        first, second = channels
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, first, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(first, second, kernel_size=3, padding=1),
            nn.ReLU(),
        )
        self.head = nn.Linear(second * (height // 2) * (width // 2), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits of shape ``(N, num_classes)`` for inputs ``(N, C, H, W)`` or ``(N, C * H * W)``.

        Raises:
            ValueError: If the input is neither ``(N, C * H * W)`` nor 4-d with ``C`` channels.
        """
        channels, height, width = self.image_shape
        if x.dim() == 2 and x.shape[1] == channels * height * width:
            x = x.reshape(x.shape[0], channels, height, width)
        elif x.dim() != 4 or x.shape[1] != channels:
            raise ValueError(
                f"SmallCNN expects input of shape (N, {channels}, H, W) or (N, {channels * height * width}); "
                f"got {tuple(x.shape)}."
            )
        features: torch.Tensor = self.features(x)
        logits: torch.Tensor = self.head(features.flatten(1))
        return logits


class CharGRU(nn.Module):
    """Predict the next character from the ones before it: an embedding, a GRU and a linear head.

    ``Embedding(vocabulary, embed) -> GRU(embed, hidden, layers) -> Linear(hidden, vocabulary)`` on the GRU's last
    output. Inputs are character ids ``(N, context)``, as float32 (the data's feature type) or integers; the output
    is the logits ``(N, vocabulary)`` of the next character. No dropout: training stays a function of the weights,
    the data and the batch order.

    Args:
        vocabulary: Distinct characters (outputs).
        embed: Width of a character's embedding.
        hidden: Width of the GRU's state.
        layers: Stacked GRU layers.

    Raises:
        ValueError: If a size is not positive.
    """

    def __init__(self, vocabulary: int, embed: int = 32, hidden: int = 128, layers: int = 1) -> None:
        super().__init__()
        if min(vocabulary, embed, hidden, layers) < 1:
            raise ValueError(
                f"CharGRU sizes must be >= 1; got vocabulary={vocabulary}, embed={embed}, hidden={hidden}, "
                f"layers={layers}."
            )
        self.embedding = nn.Embedding(vocabulary, embed)
        self.gru = nn.GRU(embed, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocabulary)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the next character's logits ``(N, vocabulary)`` for character ids ``(N, context)``."""
        outputs, _ = self.gru(self.embedding(x.long()))
        logits: torch.Tensor = self.head(outputs[:, -1])
        return logits


def num_parameters(model: nn.Module) -> int:
    """Return the number of scalar parameters of ``model``, counting shared parameters once."""
    return sum(parameter.numel() for parameter in model.parameters())


def build(model: str, weights: str | None, **kwargs: Any) -> nn.Module:
    """Build a model of this module by class name and load flat weights into it.

    This is how MLflow's writer process rebuilds a run's trained model to log it (see
    :meth:`tracking.MlflowTracker.log_model_from`): only the name, the arguments and a file path cross the process
    boundary. Without weights it builds the model's structure, which the writer process exports while the run
    trains (see :meth:`tracking.MlflowTracker.prepare_model_from`).

    Args:
        model: ``"MLP"``, ``"SmallCNN"`` or ``"CharGRU"``.
        weights: A ``.npy`` file of the flat float32 weights: parameters, then floating-point buffers, in module
            order (the layout of :func:`flasync.training.local.flat_parameters`); None keeps the initial weights.
        **kwargs: The class's arguments (lists for sequences).

    Raises:
        ValueError: If ``model`` names no class here, or the weights do not fit the model.
    """
    classes: dict[str, type[nn.Module]] = {"MLP": MLP, "SmallCNN": SmallCNN, "CharGRU": CharGRU}
    if model not in classes:
        raise ValueError(f"no model {model!r} in flasync.training.models (one of {sorted(classes)})")
    if "image_size" in kwargs:
        kwargs["image_size"] = tuple(kwargs["image_size"])
    module = classes[model](**kwargs)
    if weights is None:
        return module
    flat = torch.from_numpy(np.load(weights, allow_pickle=False))
    tensors = [*module.parameters(), *(b for b in module.buffers() if b.is_floating_point())]
    if flat.numel() != sum(t.numel() for t in tensors):
        raise ValueError(f"{flat.numel()} weights do not fit a {model} of {sum(t.numel() for t in tensors)} values")
    offset = 0
    with torch.no_grad():
        for tensor in tensors:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
    return module
