"""Synchronous local training and evaluation, run in executor threads, never on the event loop.

A worker owns one :class:`FlatModel`: a user ``nn.Module`` whose parameters (and floating-point buffers) have been
re-pointed at views of one flat float32 vector, and whose gradients are views of one flat gradient vector. Loading a
global model is then a single ``copy_``, the client delta is a single subtraction, and SGD with momentum, weight
decay and norm clipping is three or four fused vector ops per step instead of a loop over parameters. No
``deepcopy`` per client, no ``DataLoader``: batches are gathered by indexing the client's in-memory tensors.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from flasync.core.errors import TrainingError
from flasync.training.exchange import Exchanged

if TYPE_CHECKING:
    from flasync.training.metrics import MetricSet

__all__ = [
    "EvalResult",
    "FlatModel",
    "LocalObjective",
    "LocalResult",
    "LocalTraining",
    "LossScaler",
    "after_default_stream",
    "autocast",
    "evaluate",
    "evaluate_segments",
    "flat_layout",
    "flat_parameters",
    "objective_name",
    "set_checkpointing",
    "train",
]


class FlatLayout(NamedTuple):
    """The tensors of a module that make up its flat vector, in order: parameters, then floating-point buffers."""

    parameters: list[tuple[str, nn.Parameter]]
    buffers: list[tuple[str, torch.Tensor]]


def flat_layout(module: nn.Module) -> FlatLayout:
    """Return the named tensors of ``module``'s flat vector.

    For an :class:`~flasync.training.exchange.Exchanged` model they are its exchanged parameters (named as in the
    wrapped model) and the wrapped model's floating-point buffers; for any other module, all its parameters and
    floating-point buffers, in module order.
    """
    if isinstance(module, Exchanged):
        inner = module.model
        return FlatLayout(
            module.exchanged_parameters(), [(n, b) for n, b in inner.named_buffers() if b.is_floating_point()]
        )
    return FlatLayout(
        list(module.named_parameters()), [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]
    )


def flat_parameters(module: nn.Module) -> torch.Tensor:
    """Return a new flat float32 vector of ``module``'s parameters followed by its floating-point buffers.

    For an :class:`~flasync.training.exchange.Exchanged` model, the exchanged parameters only (see
    :func:`flat_layout`).
    """
    layout = flat_layout(module)
    tensors = [p.detach().reshape(-1) for _, p in layout.parameters]
    tensors += [b.detach().reshape(-1) for _, b in layout.buffers]
    return torch.cat(tensors).to(torch.float32) if tensors else torch.zeros(0)


class FlatModel:
    """A module whose state lives in one flat vector (``flat``) and whose gradients live in another (``grad``).

    Layout: parameters first (``flat[:num_trainable]``, in ``module.parameters()`` order), then floating-point
    buffers (e.g. BatchNorm statistics), which are averaged like weights but not trained by gradient. An
    :class:`~flasync.training.exchange.Exchanged` model's flat vector holds its exchanged parameters only (then its
    buffers); its frozen parameters keep their own storage, and no gradient.
    """

    def __init__(self, module: nn.Module) -> None:
        """Re-point ``module``'s parameters, buffers and gradients at flat storage (in place)."""
        layout = flat_layout(module)
        params = [p for _, p in layout.parameters]
        buffers = [b for _, b in layout.buffers]
        if any(p.dtype != torch.float32 for p in params) or any(b.dtype != torch.float32 for b in buffers):
            raise TrainingError("flasync trains float32 models; cast the model factory's output with .float()")
        self.module = module
        self.num_trainable = sum(p.numel() for p in params)
        total = self.num_trainable + sum(b.numel() for b in buffers)
        device = params[0].device if params else torch.device("cpu")
        self.flat = torch.zeros(total, dtype=torch.float32, device=device)
        self.grad = torch.zeros(self.num_trainable, dtype=torch.float32, device=device)
        self.momentum = torch.zeros_like(self.grad)
        self.params = self.flat[: self.num_trainable]  # the trainable prefix of ``flat`` (a view)
        self.checkpoint_segments = 0  # what set_checkpointing last applied to ``module``
        self._training: bool | None = None  # the mode set_mode last applied to ``module`` (None: not yet)
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                self.flat[offset : offset + n].copy_(p.reshape(-1))
                p.data = self.flat[offset : offset + n].view_as(p)
                p.grad = self.grad[offset : offset + n].view_as(p)
                offset += n
            for b in buffers:
                n = b.numel()
                self.flat[offset : offset + n].copy_(b.reshape(-1))
                b.data = self.flat[offset : offset + n].view_as(b)
                offset += n

    def set_mode(self, *, training: bool) -> None:
        """Put the module in training or evaluation mode (``module.train(training)``), unless it already is.

        Only this model's training and evaluation change its module's mode, so the last mode set is the mode it
        has, and the walk over every submodule that ``nn.Module.train`` does is made once per change.
        """
        if self._training is not training:
            self.module.train(training)
            self._training = training

    def load_(self, weights: torch.Tensor) -> None:
        """Copy a flat weight vector into the model."""
        if weights.shape != self.flat.shape:
            raise TrainingError(f"weights have {weights.numel()} elements, the model has {self.flat.numel()}")
        self.flat.copy_(weights)

    @property
    def nbytes(self) -> int:
        """Return bytes of weights, gradients and optimizer state."""
        return 4 * (self.flat.numel() + self.grad.numel() + self.momentum.numel())


class LocalObjective(Protocol):
    """The loss local training minimises instead of cross-entropy (a classification loss of your own).

    Local training minimises the mean of :meth:`loss` over each batch, with the same SGD, momentum, weight decay,
    clipping and FedProx term as the default. Labels are int64 class indices (the data checks insist on them), so
    a regression target is out of reach; a custom classification objective (focal loss, label smoothing, a class
    weighting) is not. The server's evaluation still reports accuracy and cross-entropy, one yardstick for every
    objective.

    An objective must be a pure function of its arguments (no random numbers, no state changed by a call), so the
    same seed gives the same weights, bit for bit, under the virtual clock. One objective object is shared by every
    worker thread.

    Example, focal loss (Lin et al., ICCV 2017, eq. 5: ``FL(p_t) = -(1 - p_t)^gamma log p_t``)::

        class Focal:
            vectorizable = True

            def loss(self, outputs, targets):
                log_p = outputs.log_softmax(dim=1).gather(1, targets[:, None]).squeeze(1)
                return -((1 - log_p.exp()) ** 2.0) * log_p
    """

    @property
    def vectorizable(self) -> bool:
        """Tell whether :meth:`loss` can run under ``torch.func.vmap`` (``executor.kind = "vectorized"``).

        True promises tensor operations only: no ``.item()``, no Python branch on a tensor's value, no in-place
        change of the inputs. The vectorized executor refuses an objective that says False.
        """
        ...

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Return the per-sample losses ``(B,)`` of a batch (not their mean: a padded cohort batch is masked).

        Args:
            outputs: The model's outputs ``(B, C)``, float32 (cast up from bf16/fp16 under mixed precision).
            targets: The labels ``(B,)``, int64.
        """
        ...


def objective_name(objective: object) -> str:
    """Return the name an objective (or any rule object) is known by in messages and tags: its class name."""
    return type(objective).__qualname__


def _mean_loss(objective: LocalObjective) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Return ``(outputs, targets) -> mean loss`` of ``objective``, checking that it gave one loss per sample."""

    def mean_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses = objective.loss(outputs, targets)
        if losses.shape != targets.shape:
            raise TrainingError(
                f"{objective_name(objective)}.loss returned shape {tuple(losses.shape)}: it must return one loss per "
                f"sample, shape {tuple(targets.shape)}"
            )
        return losses.mean()

    return mean_loss


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalTraining:
    """Hyper-parameters of one local training call (mirrors :class:`flasync.config.ClientConfig`).

    ``objective`` is the loss to minimise (None: cross-entropy); it is not hashed, so any object can be one.
    """

    epochs: int = 1
    max_steps: int | None = None
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    clip_norm: float | None = None
    proximal_mu: float = 0.0
    precision: str = "fp32"
    checkpoint_segments: int = 0
    objective: LocalObjective | None = field(default=None, hash=False)

    def steps_for(self, num_samples: int) -> int:
        """Return the number of optimizer steps a client with ``num_samples`` samples takes."""
        steps = self.epochs * math.ceil(num_samples / self.batch_size)
        return min(steps, self.max_steps) if self.max_steps is not None else steps


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalResult:
    """What one local training call produced.

    ``update_norm`` is the L2 norm of ``delta`` when the trainer computed it already and it is finite (a cohort
    computes its members' norms in one operation); None otherwise.
    """

    delta: torch.Tensor
    num_samples: int
    steps: int
    loss: float
    train_s: float
    peak_mem_bytes: int
    update_norm: float | None = None

    def without_delta(self, empty: torch.Tensor) -> LocalResult:
        """Return the same figures with ``empty`` (an empty tensor a caller shares among results) in place of
        ``delta``: what is kept once the delta has been encoded."""
        return LocalResult(
            delta=empty,
            num_samples=self.num_samples,
            steps=self.steps,
            loss=self.loss,
            train_s=self.train_s,
            peak_mem_bytes=self.peak_mem_bytes,
            update_norm=self.update_norm,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalResult:
    """Accuracy and mean cross-entropy over a data split, and the figures of the metrics ``eval.metrics`` adds."""

    accuracy: float
    loss: float
    num_samples: int
    metrics: Mapping[str, float] = field(default_factory=dict)


def autocast(precision: str, device: torch.device) -> AbstractContextManager[object]:
    """Return the autocast context of a ``client.precision`` (``fp32``: none)."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    if precision == "fp16":
        return torch.autocast(device_type=device.type, dtype=torch.float16)
    return nullcontext()


class LossScaler:
    """Dynamic loss scaling for fp16 training, one scale per row (client), as ``torch.amp.GradScaler`` does it.

    The loss is multiplied by ``scale`` before the backward pass and the gradient divided by it after; a step whose
    gradient has an Inf or NaN is skipped and its row's scale halved, and after ``growth_interval`` good steps in a
    row the scale doubles (GradScaler's defaults). flasync's optimizer is a few fused vector operations rather than
    a ``torch.optim`` optimizer, so the scaler works on gradient rows directly.

    Args:
        rows: Number of independent scales (1 for one client, K for a cohort).
        device: Where the scales live.
    """

    def __init__(
        self,
        rows: int,
        device: torch.device,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        """Start every row at ``init_scale``."""
        self.scale = torch.full((rows,), init_scale, dtype=torch.float32, device=device)
        self._good = torch.zeros(rows, dtype=torch.int64, device=device)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval

    @classmethod
    def for_rows(cls, rows: int, device: torch.device) -> LossScaler:
        """Return a scaler with GradScaler's defaults for ``rows`` clients."""
        return cls(rows, device)

    def update_rows(self, grads: torch.Tensor, k: int) -> torch.Tensor:
        """Update the first ``k`` scales from unscaled gradients ``(k, P)``; return which rows may step (bool)."""
        finite = torch.isfinite(grads).all(dim=1)
        scale, good = self.scale[:k], self._good[:k]
        good.copy_(torch.where(finite, good + 1, torch.zeros_like(good)))
        grow = good >= self.growth_interval
        scale.copy_(
            torch.where(
                finite,
                torch.where(grow, scale * self.growth_factor, scale),
                scale * self.backoff_factor,
            )
        )
        good.masked_fill_(grow, 0)
        return finite


class _SavedBytes:
    """Count the bytes autograd saves for backward (the activations' memory)."""

    def __init__(self) -> None:
        self.total = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.total += tensor.numel() * tensor.element_size()
        return tensor


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def after_default_stream(device: torch.device) -> None:
    """On CUDA, order the calling thread's current stream after the default stream's queued work.

    Global weights and data are written on the default stream (by the event loop's thread); a worker training on
    its own stream must not read them before that work is done. A no-op on the CPU or on the default stream.
    """
    if device.type == "cuda":
        current = torch.cuda.current_stream(device)
        default = torch.cuda.default_stream(device)
        if current != default:
            current.wait_stream(default)


def _batches(
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: LocalTraining,
    generator: torch.Generator,
    indices: torch.Tensor | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield the ``(inputs, labels)`` batches of local training, in the order ``generator`` draws.

    Each epoch draws a permutation of the samples, gathers them in that order once, and cuts the result into views
    of ``batch_size`` rows (the last one shorter), stopping after ``cfg.max_steps`` steps in all: the batches of
    ``x[perm[i : i + batch_size]]``, with two gathers per epoch instead of two per step. With ``indices`` the
    samples are the rows ``indices`` of ``x`` and ``y``, gathered straight from there in permuted order: the batches
    of ``x[indices][perm[...]]``, without a copy of the client's samples made first.
    """
    n = int(y.shape[0]) if indices is None else int(indices.shape[0])
    per_epoch = -(-n // cfg.batch_size)
    remaining = cfg.steps_for(n)
    for _ in range(cfg.epochs):
        if remaining <= 0:
            return
        order = torch.randperm(n, generator=generator)
        if remaining < per_epoch:
            order = order[: remaining * cfg.batch_size]
        remaining -= per_epoch
        rows = order if indices is None else indices[order]
        yield from zip(torch.split(x[rows], cfg.batch_size), torch.split(y[rows], cfg.batch_size), strict=True)


_CHECKPOINTED = "_flasync_checkpoint_segments"


def _checkpointed_forward(sequential: nn.Sequential, segments: int, x: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled():
        plain: torch.Tensor = nn.Sequential.forward(sequential, x)  # type: ignore[no-untyped-call]
        return plain
    out: torch.Tensor = checkpoint_sequential(  # type: ignore[no-untyped-call]
        sequential, min(segments, len(sequential)), x, use_reentrant=False
    )
    return out


def set_checkpointing(module: nn.Module, segments: int) -> int:
    """Turn gradient checkpointing of ``module``'s ``nn.Sequential`` blocks on (``segments`` >= 1) or off (0).

    Each outermost ``nn.Sequential`` of two or more layers keeps only the inputs of its ``segments`` segments
    during the forward pass and recomputes the rest in the backward pass (``torch.utils.checkpoint``, non-reentrant):
    activation memory falls from one tensor per layer to one per segment, for one more forward pass. Parameters are
    untouched, so the flat views of :class:`FlatModel` stay valid; the results are those of plain training.

    Returns:
        The number of blocks checkpointed (0: the model has no ``nn.Sequential`` of two or more layers).
    """
    count = 0
    pending = [module]
    while pending:
        node = pending.pop()
        if isinstance(node, nn.Sequential) and len(node) >= 2:
            if segments:
                node.forward = partial(_checkpointed_forward, node, segments)  # type: ignore[method-assign]
                setattr(node, _CHECKPOINTED, segments)
                count += 1
            elif hasattr(node, _CHECKPOINTED):
                del node.forward
                delattr(node, _CHECKPOINTED)
            continue
        pending.extend(node.children())
    return count


def train(
    model: FlatModel,
    base: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: LocalTraining,
    generator: torch.Generator,
    *,
    timer: Callable[[], float] = time.perf_counter,
    on_backward: Callable[[torch.Tensor], None] | None = None,
    indices: torch.Tensor | None = None,
    correction: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> LocalResult:
    """Train ``model`` from ``base`` on ``(x, y)`` with SGD and return the delta ``base - w_local``.

    SGD follows ``torch.optim.SGD`` (dampening 0): ``g <- clip(g) + wd * w``, ``m <- mu * m + g``,
    ``w <- w - lr * m`` (``m = g`` when ``mu = 0``); clipping scales ``g`` by ``min(1, c / ||g||)``. The loss is
    cross-entropy, or the mean of ``cfg.objective``'s per-sample losses.

    Args:
        model: The worker's reusable model; its weights are overwritten.
        base: Flat global weights the client starts from (read only).
        x: Client inputs ``(n, *features)``.
        y: Client labels ``(n,)``, int64.
        cfg: Local hyper-parameters.
        generator: The task's own random stream (batch order).
        timer: Monotonic seconds, for ``train_s``.
        on_backward: Called with the flat gradient after each backward pass, before clipping (diagnostics), with
            autograd on (the gradient does not require grad; a callback that reads the module's parameters wraps
            its work in ``torch.no_grad()``).
        indices: Train on the rows ``indices`` (int64, on ``x``'s device) of ``x`` and ``y`` only: the same result
            as ``train(..., x[indices], y[indices], ...)``, without that copy (each epoch gathers its batches
            straight from ``x`` and ``y``).
        correction: Added to every step's gradient after clipping (a plug-in's correction; None: nothing).
        mask: Multiplies every step's gradient last (after the correction, the proximal term and weight decay), so
            the weights where it is 0 keep their values from ``base`` (a pruning mask; None: nothing). Its bytes
            count in the peak memory.

    Returns:
        The delta, sample count, steps, mean training loss, seconds and peak tensor memory in bytes
        (weights + gradients + optimizer state + one batch + activations saved for backward, measured on
        the first step).

    Raises:
        TrainingError: If the client has no samples, or the objective does not return one loss per sample.
    """
    start = timer()
    n = int(y.shape[0]) if indices is None else int(indices.shape[0])
    if n == 0:
        raise TrainingError("client has no samples")
    _load_for_training(model, base, cfg)
    totals = _sgd_steps(model, base, x, y, cfg, generator, on_backward, indices, correction, mask)
    with torch.no_grad():
        delta = base - model.flat
    mean_loss = float(totals.loss_sum) / max(totals.seen, 1)
    mask_bytes = 0 if mask is None else mask.numel() * mask.element_size()
    return LocalResult(
        delta=delta,
        num_samples=n,
        steps=totals.steps,
        loss=mean_loss,
        train_s=timer() - start,
        peak_mem_bytes=model.nbytes + totals.batch_bytes + totals.activation_bytes + mask_bytes,
    )


class _StepTotals(NamedTuple):
    """What :func:`_sgd_steps` adds up: the sample-weighted loss sum, samples, steps and the first step's memory."""

    loss_sum: torch.Tensor
    seen: int
    steps: int
    activation_bytes: int
    batch_bytes: int


def _load_for_training(model: FlatModel, base: torch.Tensor, cfg: LocalTraining) -> None:
    """Put ``model`` in training mode with ``cfg``'s checkpointing, load ``base`` and zero the momentum."""
    model.set_mode(training=True)
    if model.checkpoint_segments != cfg.checkpoint_segments:
        set_checkpointing(model.module, cfg.checkpoint_segments)
        model.checkpoint_segments = cfg.checkpoint_segments
    after_default_stream(model.flat.device)
    model.load_(base)
    model.momentum.zero_()


def _sgd_steps(
    model: FlatModel,
    base: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: LocalTraining,
    generator: torch.Generator,
    on_backward: Callable[[torch.Tensor], None] | None,
    indices: torch.Tensor | None,
    correction: torch.Tensor | None,
    mask: torch.Tensor | None = None,
) -> _StepTotals:
    """Run :func:`train`'s SGD steps on ``model`` (loaded with ``base``); return what they add up."""
    module = model.module
    params, grad, momentum = model.params, model.grad, model.momentum
    device = model.flat.device
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    cast = cfg.precision in ("bf16", "fp16")
    scaler = LossScaler.for_rows(1, device) if cfg.precision == "fp16" else None
    criterion = F.cross_entropy if cfg.objective is None else _mean_loss(cfg.objective)
    steps = 0
    seen = 0
    peak_activation = 0
    batch_bytes = 0
    # The optimizer below runs with autograd on: ``flat``, ``grad`` and ``momentum`` are plain tensors that do
    # not require grad (the parameters are views of them), so no graph is recorded, and a ``no_grad`` block per
    # step would only add its cost.
    for xb, yb in _batches(x, y, cfg, generator, indices):
        rows = int(yb.shape[0])
        grad.zero_()
        if steps == 0:
            saved = _SavedBytes()
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, _unpack):
                with autocast(cfg.precision, device):
                    out = module(xb)
                loss = criterion(out.float(), yb)
            peak_activation = saved.total
            batch_bytes = xb.numel() * xb.element_size() + yb.numel() * yb.element_size()
        elif cast:
            with autocast(cfg.precision, device):
                out = module(xb)
            loss = criterion(out.float(), yb)
        else:
            loss = criterion(module(xb), yb)
        if scaler is not None:
            (loss * scaler.scale[0]).backward()  # type: ignore[no-untyped-call]
            grad.div_(scaler.scale[0])
            if not bool(scaler.update_rows(grad.view(1, -1), 1)[0]):  # an overflow: skip this step
                loss_sum.add_(loss.detach(), alpha=rows)
                seen += rows
                steps += 1
                continue
        else:
            loss.backward()  # type: ignore[no-untyped-call]
        if on_backward is not None:
            on_backward(grad)  # unscaled, before clipping
        if cfg.clip_norm is not None:
            norm = torch.linalg.vector_norm(grad)
            grad.mul_(torch.clamp(cfg.clip_norm / (norm + 1e-6), max=1.0))
        if correction is not None:
            grad.add_(correction)
        if cfg.proximal_mu:
            # FedProx (Li et al., MLSys 2020, eq. 2): the gradient of mu/2 ||w - w_base||^2 is mu (w - w_base).
            grad.add_(params, alpha=cfg.proximal_mu).sub_(base[: params.numel()], alpha=cfg.proximal_mu)
        if cfg.weight_decay:
            grad.add_(params, alpha=cfg.weight_decay)
        if mask is not None:
            grad.mul_(mask)
        if cfg.momentum:
            momentum.mul_(cfg.momentum).add_(grad)
            params.add_(momentum, alpha=-cfg.lr)
        else:
            params.add_(grad, alpha=-cfg.lr)
        loss_sum.add_(loss.detach(), alpha=rows)
        seen += rows
        steps += 1
    return _StepTotals(loss_sum, seen, steps, peak_activation, batch_bytes)


@torch.no_grad()
def evaluate(
    model: FlatModel,
    weights: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    batch_size: int = 1024,
    metrics: MetricSet | None = None,
) -> EvalResult:
    """Return accuracy and mean cross-entropy of ``weights`` on ``(x, y)``, and the figures of ``metrics`` (fresh
    instances of each, fed every batch's float32 outputs)."""
    after_default_stream(model.flat.device)
    model.load_(weights)
    module = model.module
    model.set_mode(training=False)
    n = int(y.shape[0])
    correct = torch.zeros((), dtype=torch.int64, device=x.device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=x.device)
    tally = metrics.tally(x.device) if metrics else None
    for start in range(0, n, batch_size):
        xb, yb = x[start : start + batch_size], y[start : start + batch_size]
        out = module(xb).float()
        loss_sum += F.cross_entropy(out, yb, reduction="sum").double()
        correct += (out.argmax(dim=1) == yb).sum()
        if tally is not None:
            tally.update(out, yb)
    figures = tally.compute() if tally is not None and n else {}
    return EvalResult(
        accuracy=int(correct) / max(n, 1), loss=float(loss_sum) / max(n, 1), num_samples=n, metrics=figures
    )


@torch.no_grad()
def evaluate_segments(
    model: FlatModel,
    weights: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    sizes: Sequence[int],
    *,
    batch_size: int = 1024,
    metrics: MetricSet | None = None,
) -> list[EvalResult]:
    """Evaluate ``weights`` on consecutive segments of ``(x, y)`` in shared batches: one result per segment.

    The rows of ``x`` are the segments one after another (``sizes[j]`` rows for segment ``j``, e.g. the held-out
    samples of a cohort's clients, all evaluating one model): the forward passes run over batches of up to
    ``batch_size`` rows whatever the segments, and each segment's accuracy, mean cross-entropy and ``metrics`` are
    those :func:`evaluate` gives on its rows alone (to float rounding of the loss's sum).
    """
    after_default_stream(model.flat.device)
    model.load_(weights)
    module = model.module
    model.set_mode(training=False)
    k = len(sizes)
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + int(size))
    n = bounds[-1]
    owner = torch.repeat_interleave(torch.arange(k, device=x.device), torch.tensor(list(sizes), device=x.device))
    correct = torch.zeros(k, dtype=torch.int64, device=x.device)
    loss_sum = torch.zeros(k, dtype=torch.float64, device=x.device)
    tallies = [metrics.tally(x.device) for _ in range(k)] if metrics else []
    for start in range(0, n, batch_size):
        stop = min(start + batch_size, n)
        xb, yb, ob = x[start:stop], y[start:stop], owner[start:stop]
        out = module(xb).float()
        loss_sum.index_add_(0, ob, F.cross_entropy(out, yb, reduction="none").double())
        correct.index_add_(0, ob, (out.argmax(dim=1) == yb).long())
        for j in range(int(ob[0]), int(ob[-1]) + 1) if tallies else ():
            lo, hi = max(bounds[j], start) - start, min(bounds[j + 1], stop) - start
            if hi > lo:
                tallies[j].update(out[lo:hi], yb[lo:hi])
    right, losses = correct.tolist(), loss_sum.tolist()
    results = []
    for j, size in enumerate(sizes):
        figures = tallies[j].compute() if tallies and size else {}
        count = max(int(size), 1)
        results.append(
            EvalResult(accuracy=right[j] / count, loss=losses[j] / count, num_samples=int(size), metrics=figures)
        )
    return results
