"""Magnitude pruning of the global model on a schedule, as a plug-in: a mask over the flat vector.

Every ``every_versions`` versions the server keeps the ``density`` share of each weight tensor's values of largest
magnitude and zeroes the rest (magnitude pruning, Han et al., NeurIPS 2015, layer by layer as Zhu and Gupta, 2017).
The density steps down geometrically to its target over ``steps`` pruning events (the ``i``-th keeps
``target ** (i / steps)``), then stays there while the mask is chosen again at each event among the weights still
kept. The mask goes out with every model (as a bitmap: ``ceil(n / 8)`` bytes); clients multiply each local gradient
by it, so the pruned weights stay exactly zero in their models and their updates, and the runtime sends weights and
updates in the sparse form (:class:`flasync.codecs.NonZero`), whose bytes fall with the density. The server zeroes
the pruned weights after every step, so a server optimizer's momentum cannot bring them back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from flasync.codecs import Pipeline
from flasync.core.events import TaskAssigned
from flasync.core.snapshots import ModelSnapshot
from flasync.training.plugins import ClientPlugin, Extra, ServerPlugin, TaskPart

__all__ = ["PruningClients", "PruningServer", "density_at", "layer_mask", "magnitude_mask"]


def magnitude_mask(weights: torch.Tensor, density: float, kept: torch.Tensor | None = None) -> torch.Tensor:
    """Return the 0/1 float32 mask that keeps the ``ceil(density * n)`` weights of largest magnitude.

    Ties go to the lower indices (a stable sort), so the mask is a deterministic function of the weights.

    Args:
        weights: The flat weights ``(n,)``.
        density: Share of the weights kept, in ``(0, 1]``.
        kept: The current mask (None: every weight); a weight it prunes stays pruned.

    Raises:
        ValueError: If ``density`` is outside ``(0, 1]``.
    """
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    n = weights.numel()
    k = min(n, math.ceil(density * n))
    magnitude = weights.detach().abs().to(torch.float32)
    if kept is not None:
        magnitude = torch.where(kept > 0, magnitude, torch.full_like(magnitude, -1.0))
    order = torch.sort(magnitude, descending=True, stable=True).indices
    mask = torch.zeros(n, dtype=torch.float32, device=weights.device)
    mask[order[:k]] = 1.0
    return mask


def layer_mask(
    weights: torch.Tensor, density: float, shapes: Sequence[tuple[int, ...]], kept: torch.Tensor | None = None
) -> torch.Tensor:
    """Return the 0/1 mask that prunes each weight tensor of the flat vector to ``density`` on its own.

    Each tensor of two or more dimensions (a linear layer's or a convolution's weights) keeps its own
    ``ceil(density * numel)`` values of largest magnitude (:func:`magnitude_mask`), as Zhu and Gupta (2017) prune
    every layer to the same sparsity: one global threshold would empty the layers whose initial scale is small and
    cut the network apart. Biases, normalization parameters and buffers (tensors of fewer dimensions) are kept.

    Args:
        weights: The flat weights ``(n,)``.
        density: Share of each weight tensor kept, in ``(0, 1]``.
        shapes: The shapes of the flat vector's tensors, in order (their sizes add up to ``n``); empty: the whole
            vector is one tensor.
        kept: The current mask (None: every weight).

    Raises:
        ValueError: If the shapes do not add up to the vector's length.
    """
    if not shapes:
        return magnitude_mask(weights, density, kept)
    sizes = [math.prod(shape) for shape in shapes]
    if sum(sizes) != weights.numel():
        raise ValueError(f"tensor shapes of {sum(sizes)} values do not fit {weights.numel()} weights")
    mask = torch.ones(weights.numel(), dtype=torch.float32, device=weights.device)
    offset = 0
    for shape, size in zip(shapes, sizes, strict=True):
        if len(shape) >= 2 and size:
            part = slice(offset, offset + size)
            mask[part] = magnitude_mask(weights[part], density, None if kept is None else kept[part])
        offset += size
    return mask


def density_at(event: int, *, target: float, steps: int) -> float:
    """Return the density the ``event``-th pruning (from 1) keeps: ``target ** (min(event, steps) / steps)``."""
    return float(target ** (min(event, steps) / steps))


class PruningServer(ServerPlugin):
    """The global model's pruning mask: chosen on schedule, applied after every step, sent with every model.

    Checkpoint component ``prune_mask``: the mask and the number of pruning events so far.

    Args:
        weights: The server's flat weights (pruned in place).
        target_density: Share of the weights kept in the end, in ``(0, 1)``.
        every_versions: Versions between two pruning events.
        steps: Pruning events that bring the density to its target.
        shapes: The shapes of the flat vector's tensors (each weight tensor is pruned on its own, see
            :func:`layer_mask`; empty: the vector as one).
    """

    name = "prune_mask"

    def __init__(
        self,
        weights: torch.Tensor,
        *,
        target_density: float,
        every_versions: int,
        steps: int = 1,
        shapes: Sequence[tuple[int, ...]] = (),
    ) -> None:
        """Start with no mask (every weight kept)."""
        self.weights = weights
        self.shapes = tuple(shapes)
        self.target_density = target_density
        self.every_versions = every_versions
        self.steps = steps
        self.mask: torch.Tensor | None = None
        self.events = 0
        self._pruned_at: int | None = None

    @property
    def density(self) -> float:
        """Return the share of weights the mask keeps (1.0 before the first pruning)."""
        if self.mask is None:
            return 1.0
        return float(self.mask.sum()) / max(self.mask.numel(), 1)

    def stepped(self, version: int) -> None:
        """Prune on schedule as the model of ``version + 1`` is made; zero the pruned weights after every step."""
        made = version + 1
        if made % self.every_versions == 0:
            self.events += 1
            density = density_at(self.events, target=self.target_density, steps=self.steps)
            self.mask = layer_mask(self.weights, density, self.shapes, self.mask)
            self._pruned_at = made
        if self.mask is not None:
            self.weights.mul_(self.mask)

    def published(self, version: int, codec: Pipeline, generator: torch.Generator | None) -> Extra:
        """Send the mask with the model, as a bitmap (nothing before the first pruning)."""
        if self.mask is None:
            return Extra(None, 0)
        return Extra(self.mask, math.ceil(self.mask.numel() / 8))

    def version_made(self, version: int, log: Any) -> None:
        """Log a pruning event's density when the version it made is published."""
        if self._pruned_at == version:
            self._pruned_at = None
            log.info("server.prune", step=version, density=self.density, events=self.events)

    def state_dict(self) -> dict[str, Any]:
        """Return the mask (a bool tensor, None before the first pruning) and the events so far."""
        return {"mask": None if self.mask is None else self.mask.bool().cpu(), "events": self.events}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        mask = state["mask"]
        self.mask = None if mask is None else mask.to(torch.float32).to(self.weights.device)
        self.events = int(state["events"])


class PruningClients(ClientPlugin):
    """The clients' side of pruning: each task trains only the weights the downloaded mask keeps (no state)."""

    name = "prune"

    def task(self, task: TaskAssigned, model: ModelSnapshot) -> TaskPart | None:
        """Return the task's gradient mask (None before the first pruning)."""
        if model.extra is None:
            return None
        return _MaskPart(model.extra)


class _MaskPart(TaskPart):
    """A task's gradient mask: the pruning mask that came with its model."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask
