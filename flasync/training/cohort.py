"""Vectorized local training: a cohort of K clients that start from the same weights trains as one batched job.

Every client keeps what it has in :func:`flasync.training.local.train`: its own samples, its own batch order (drawn from
its own generator exactly as the per-client path draws it), its own SGD momentum, weight decay and gradient
clipping. What changes is how the work is laid out: the K weight vectors are rows of one ``(K, P)`` tensor, and
one step of the cohort is one call of ``vmap(loss)`` over the rows - a batched matrix multiply instead of K small
ones - and one autograd pass over the sum of the K losses, which gives each row its own gradient (the rows never
mix), followed by the optimizer as a handful of ``(K, P)`` tensor operations.

Ragged clients are handled in two ways at once:

* a short last batch of an epoch is padded to ``batch_size`` with a mask, and the loss is the masked mean, which
  is the per-client mean over the real samples;
* clients are ordered by their number of steps (most first), so the clients still training at step ``s`` are a
  prefix of the rows and step ``s`` works on a view ``W[:k_s]``, never on finished clients.

A custom :class:`~flasync.training.local.LocalObjective` is batched too when it says it is ``vectorizable``.

A model may also batch itself: a method ``cohort_forward(params, x)`` that takes every parameter with a leading
axis of K clients and their batches ``(K, B, ...)`` and returns ``(K, B, ...)`` outputs, each client's exactly as
its ``forward`` would compute them (the built-in MLP has one: a ``baddbmm`` per layer). The trainer then calls it
instead of ``vmap`` over ``forward``, whose Python costs more per step than a small cohort's arithmetic.

Models whose layers ``vmap`` cannot batch (BatchNorm in training mode, dropout and other random layers, buffers
that training updates) are detected up front or by the first vectorized call, and the cohort is trained one client
at a time instead, with the reason returned in :attr:`CohortResult.fallback_reason`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from flasync.core.errors import TrainingError
from flasync.training.exchange import Exchanged
from flasync.training.local import (
    FlatModel,
    LocalObjective,
    LocalResult,
    LocalTraining,
    LossScaler,
    _mean_loss,
    _SavedBytes,
    _unpack,
    after_default_stream,
    autocast,
    objective_name,
    train,
)

__all__ = ["CohortMember", "CohortResult", "CohortTrainer", "unsupported_reason"]

_RANDOM_LAYERS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_NORM_LAYERS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


def unsupported_reason(module: nn.Module) -> str | None:
    """Return why ``module`` cannot be trained vectorized (None if nothing is known against it).

    A ``None`` is not a promise: a layer ``vmap`` has no batching rule for is found by the first vectorized step.
    """
    if isinstance(module, Exchanged):
        return "only part of the model trains (model.exchange): a cohort stacks whole models"
    for name, sub in module.named_modules():
        if isinstance(sub, _RANDOM_LAYERS) and sub.p > 0:
            return f"layer {name or type(sub).__name__} ({type(sub).__name__}) draws random numbers in training"
        if isinstance(sub, _NORM_LAYERS) and (sub.track_running_stats or sub.training):
            return f"layer {name or type(sub).__name__} ({type(sub).__name__}) updates running statistics"
    floating = [n for n, b in module.named_buffers() if b.is_floating_point()]
    if floating:
        return f"the model has floating-point buffers that training may update ({', '.join(floating[:3])})"
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class CohortMember:
    """One client of a cohort.

    Attributes:
        indices: The client's sample indices into the cohort's data tensors (int64, on the data's device).
        generator: The client's task stream; batch order is drawn from it as :func:`train` draws it.
        correction: Added to each of the client's gradients (a plug-in's correction; None: nothing).
        base: The flat weights this client starts from, when not the cohort's ``base`` (an asynchronous client
            dispatched at another model version; None: the cohort's).
    """

    indices: torch.Tensor
    generator: torch.Generator
    correction: torch.Tensor | None = None
    base: torch.Tensor | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CohortResult:
    """What a cohort produced: one :class:`LocalResult` per member, in member order.

    A vectorized cohort's deltas are the rows of one tensor: a member's delta kept after the others are dropped keeps
    them all alive, unless it is cloned.
    """

    results: list[LocalResult]
    vectorized: bool
    fallback_reason: str | None
    train_s: float
    deltas: torch.Tensor | None = None
    """The members' deltas as the rows of one tensor, in member order (a vectorized cohort's; None otherwise)."""


class CohortTrainer:
    """Train cohorts of clients of one model architecture, vectorized when the model allows it.

    Args:
        module: An instance of the model (its weights are never used; its structure is). It is also the model the
            per-client fallback trains, through a :class:`FlatModel` built from it.
    """

    def __init__(self, module: nn.Module) -> None:
        """Record parameter names and shapes, and check the model's layers."""
        module.train()
        self.reason = unsupported_reason(module)
        self.flat_model = FlatModel(module)
        self.module = module
        named = list(module.named_parameters())
        self._names = [name for name, _ in named]
        self._shapes = [tuple(p.shape) for _, p in named]
        self._sizes = [p.numel() for _, p in named]
        self.num_params = sum(self._sizes)
        self.device = self.flat_model.flat.device
        self._precision = "fp32"
        self._objective: LocalObjective | None = None
        forward = getattr(module, "cohort_forward", None)
        self._cohort_forward: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor] | None = (
            forward if callable(forward) else None
        )
        # Written-out gradients stand for the forward pass only if the class that wrote them also wrote the forward
        # (a subclass with a forward of its own inherits gradients that no longer match it).
        gradients = getattr(module, "cohort_gradients", None)
        self._cohort_gradients: Callable[..., tuple[dict[str, torch.Tensor], torch.Tensor]] | None = (
            gradients
            if callable(gradients)
            and self._cohort_forward is not None
            and _defined_by(module, "cohort_gradients") is _defined_by(module, "cohort_forward")
            else None
        )
        self._activations: dict[tuple[object, ...], int] = {}

    # ------------------------------------------------------------------------------------------------ public
    def train(
        self,
        base: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        members: Sequence[CohortMember],
        cfg: LocalTraining,
        *,
        timer: Callable[[], float] = time.perf_counter,
        deltas_on: torch.device | None = None,
    ) -> CohortResult:
        """Train every member from its base on its own samples of ``(x, y)``; return their deltas and figures.

        Args:
            base: Flat global weights the members start from, unless a member names its own (read only).
            x: Inputs of all members' samples ``(N, *features)``; on the model's device, or on the host (pinned
                or not) when the data does not fit on the device - batches are then prefetched one step ahead.
            y: Labels ``(N,)``, int64, where ``x`` is.
            members: The clients; each member's generator is consumed as :func:`train` would consume it.
            cfg: Local hyper-parameters (shared by the cohort).
            timer: Monotonic seconds.
            deltas_on: Where a vectorized cohort's deltas are returned (None: the model's device). A caller that
                encodes them on the host asks for ``cpu``: the cohort's rows then cross in one copy, not one
                transfer and one wait per member.

        Raises:
            TrainingError: If a member has no samples (before anything is trained).
        """
        start = timer()
        after_default_stream(self.device)
        for k, member in enumerate(members):
            if member.indices.numel() == 0:
                raise TrainingError(f"cohort member {k} has no samples")
        reason = self.reason
        if reason is None and cfg.objective is not None and not cfg.objective.vectorizable:
            reason = f"the objective {objective_name(cfg.objective)} is not vectorizable"
        if reason is None and cfg.checkpoint_segments:
            reason = "gradient checkpointing trains one client at a time"
        if reason is None and self.flat_model.flat.numel() != self.num_params:
            reason = "the model has buffers outside its parameters"
        if reason is None:
            states = [m.generator.get_state() for m in members]
            try:
                results, deltas = self._train_vectorized(base, x, y, members, cfg, timer, start, deltas_on)
            except _Unsupported as exc:
                reason = str(exc)
                for member, state in zip(members, states, strict=True):
                    member.generator.set_state(state)
            else:
                return CohortResult(
                    results=results, vectorized=True, fallback_reason=None, train_s=timer() - start, deltas=deltas
                )
        results = [self._train_one(base, x, y, member, cfg, timer) for member in members]
        return CohortResult(results=results, vectorized=False, fallback_reason=reason, train_s=timer() - start)

    # ----------------------------------------------------------------------------------------------- private
    def _train_one(
        self,
        base: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        member: CohortMember,
        cfg: LocalTraining,
        timer: Callable[[], float],
    ) -> LocalResult:
        device = self.device
        xb, yb = x[member.indices.to(x.device)], y[member.indices.to(y.device)]
        return train(
            self.flat_model,
            base if member.base is None else member.base,
            xb.to(device),
            yb.to(device),
            cfg,
            member.generator,
            timer=timer,
            correction=None if member.correction is None else member.correction.to(device),
        )

    def _loss(self, flat: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Return one client's masked mean loss over its batch (``flat`` is one row of the cohort)."""
        params = {
            name: chunk.view(shape)
            for name, chunk, shape in zip(self._names, torch.split(flat, self._sizes), self._shapes, strict=True)
        }
        with autocast(self._precision, self.device):
            out = functional_call(self.module, params, (xb,))
        objective = self._objective
        if objective is None:
            losses = F.cross_entropy(out.float(), yb, reduction="none")
        else:
            losses = objective.loss(out.float(), yb)
        return (losses * mask).sum() / mask.sum()

    def _written_out_step(
        self, rows: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return each row's masked mean loss ``(k,)`` and its gradient ``(k, P)`` from the model's own
        ``cohort_gradients`` (what autograd gives through :meth:`_cohort_losses`, to float rounding)."""
        assert self._cohort_gradients is not None
        k = rows.shape[0]
        grads, losses = self._cohort_gradients(self._views(rows), xb, yb, mask / mask.sum(dim=1, keepdim=True))
        return losses, torch.cat([grads[name].reshape(k, -1) for name in self._names], dim=1)

    def _views(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Return each parameter's part of the rows ``(k, P)``, as views ``(k, *shape)``."""
        k = rows.shape[0]
        return {
            name: chunk.view(k, *shape)
            for name, chunk, shape in zip(self._names, torch.split(rows, self._sizes, dim=1), self._shapes, strict=True)
        }

    def _cohort_losses(
        self, rows: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Return the masked mean loss ``(k,)`` of each row, through the model's own ``cohort_forward``."""
        assert self._cohort_forward is not None
        k = rows.shape[0]
        params = self._views(rows)
        with autocast(self._precision, self.device):
            out = self._cohort_forward(params, xb)
        objective = self._objective
        if objective is None:
            flat = out.float().reshape(k * out.shape[1], *out.shape[2:])
            losses = F.cross_entropy(flat, yb.reshape(-1), reduction="none").view(k, -1)
        else:  # the objective sees one client's batch at a time, as in forward's path
            losses = vmap(objective.loss)(out.float(), yb)
        return (losses * mask).sum(dim=1) / mask.sum(dim=1)

    def _orders(
        self,
        members: Sequence[CohortMember],
        cfg: LocalTraining,
        steps: list[int],
        order: list[int],
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return global sample indices ``(S, K, B)`` and a float mask ``(S, K, B)`` in cohort (sorted) order."""
        batch = cfg.batch_size
        total_steps = steps[order[0]]
        width = total_steps * batch
        rows = len(order)
        sizes = [int(members[k].indices.shape[0]) for k in order]
        limits = [steps[k] * batch for k in order]
        epoch_widths = [-(-n // batch) * batch for n in sizes]
        # Row r, position p: epoch p // padded of the client, slot p % padded of that epoch's permutation (slots
        # past the client's n samples, and positions past its own steps, are padding: index 0, mask 0).
        pieces, takes, offsets = [], [], []  # each epoch's permutation, its length, where it starts in the matrix
        for row, (k, n, limit, padded) in enumerate(zip(order, sizes, limits, epoch_widths, strict=True)):
            for start in range(0, limit, padded):  # the epochs _batches starts, drawn in its order
                perm = torch.randperm(n, generator=members[k].generator)
                take = min(n, limit - start)
                pieces.append(perm if take == n else perm[:take])
                offsets.append(row * width + start)
                takes.append(take)
        # Every permutation goes to its place in one scatter, not one copy per client: a cohort's per-client tensor
        # calls are what two training threads contend for.
        values = torch.cat(pieces)
        lengths = torch.tensor(takes)
        first = torch.cumsum(lengths, 0) - lengths  # where each piece starts in values
        where = torch.repeat_interleave(torch.tensor(offsets) - first, lengths) + torch.arange(values.numel())
        local_matrix = torch.zeros(rows * width, dtype=torch.int64)
        local_matrix[where] = values
        local_matrix = local_matrix.view(rows, width)
        position = torch.arange(width)
        per_row = torch.tensor([limits, epoch_widths, sizes])[:, :, None]
        valid = (position < per_row[0]) & (position % per_row[1] < per_row[2])
        # Positions within each client -> sample indices: one gather where the indices live (no per-client copy).
        starts = _slice_starts([members[k].indices for k in order])
        if starts is not None:  # slices of one index tensor (the engine's): position + where the slice starts
            shared, offsets_of = starts
            where_all = (local_matrix + offsets_of[:, None]).to(shared.device, non_blocking=True)
            index = shared.index_select(0, where_all.view(-1)).view(rows, total_steps, batch).transpose(0, 1)
        else:
            owned = nn.utils.rnn.pad_sequence([members[k].indices for k in order], batch_first=True)
            local_matrix = local_matrix.to(owned.device, non_blocking=True)
            index = owned.gather(1, local_matrix).view(rows, total_steps, batch).transpose(0, 1)
        mask = valid.to(torch.float32).view(rows, total_steps, batch).transpose(0, 1)
        return index.contiguous().to(device), mask.contiguous()

    def _train_vectorized(
        self,
        base: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        members: Sequence[CohortMember],
        cfg: LocalTraining,
        timer: Callable[[], float],
        start: float,
        deltas_on: torch.device | None = None,
    ) -> tuple[list[LocalResult], torch.Tensor]:
        """Train the cohort as rows of one tensor; return each member's result (``train_s``: its share of the
        cohort's time) and their deltas, the rows of one tensor."""
        device = self.device
        num = len(members)
        steps = [cfg.steps_for(int(m.indices.numel())) for m in members]
        order = sorted(range(num), key=lambda k: -steps[k])  # stable: ties keep member order
        index, mask = self._orders(members, cfg, steps, order, x.device)
        mask = mask.to(device)
        active_counts = [sum(1 for k in order if steps[k] > s) for s in range(steps[order[0]])]
        starts, weights = self._start_rows(base, members, order)
        self._precision = cfg.precision
        self._objective = cfg.objective
        rows = _RowOptimizer(cfg, starts, weights, mask, self._corrections(members, order))
        scaler = rows.scaler
        # vmap batches the forward pass and the loss only; one autograd pass over the sum of the clients' losses then
        # gives every row its own gradient (rows never mix), at a fraction of the cost of vmap(grad(...)), which
        # wraps every tensor of the backward pass too. The gradients are the same, bit for bit.
        losses_of = vmap(self._loss) if self._cohort_forward is None else self._cohort_losses
        # A model that writes its cohort's backward pass out (the built-in MLP) skips autograd's engine, for the plain
        # float32 cross-entropy; mixed precision and other objectives go through autograd.
        written_out = self._cohort_gradients is not None and cfg.precision == "fp32" and cfg.objective is None
        host_data = x.device != device
        activation_bytes = 0
        pending = self._fetch(x, y, index[0, : active_counts[0]], host_data) if active_counts else None
        for s, k in enumerate(active_counts):
            assert pending is not None
            xb, yb = pending
            if s == 0:
                activation_bytes = self._activation_bytes(xb[0], yb[0])
            if s + 1 < len(active_counts):  # prefetch the next batch while this one computes
                pending = self._fetch(x, y, index[s + 1, : active_counts[s + 1]], host_data)
            w, m = weights[:k], mask[s, :k]
            try:
                if written_out:
                    try:
                        loss, grads = self._written_out_step(w, xb, yb, m)
                    except Exception:
                        if s:
                            raise
                        written_out = False  # the model's own backward does not fit it: autograd from here on
                if not written_out:
                    with torch.enable_grad():
                        leaf = w.detach().requires_grad_(True)  # shares w's storage: no copy
                        loss = losses_of(leaf, xb, yb, m)
                        total = (loss * scaler.scale[:k]).sum() if scaler is not None else loss.sum()
                        (grads,) = torch.autograd.grad(total, leaf)
                    loss = loss.detach()
            except Exception as exc:
                if s == 0:
                    how = "vmap cannot batch the model" if self._cohort_forward is None else "cohort_forward failed"
                    raise _Unsupported(f"{how}: {type(exc).__name__}: {exc}") from exc
                raise
            rows.step(s, k, w, grads, loss)
        share = (timer() - start) / num
        return self._results(members, cfg, x, y, rows, mask, steps, order, share, activation_bytes, deltas_on)

    def _start_rows(
        self, base: torch.Tensor, members: Sequence[CohortMember], order: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the rows' starting weights (one row, broadcast, when every member starts from ``base``; else
        ``(K, P)`` in cohort order) and the weights ``(K, P)`` the cohort trains, a copy of them."""
        device = self.device
        if all(m.base is None or m.base is base for m in members):
            starts = base.to(device, torch.float32)  # one row, broadcast
            weights = starts.expand(len(members), -1).clone()
        else:
            own = [members[k].base for k in order]
            starts = torch.stack([base if b is None else b for b in own]).to(device, torch.float32)
            weights = starts.clone()
        return starts, weights

    def _corrections(self, members: Sequence[CohortMember], order: list[int]) -> torch.Tensor | None:
        """Return the members' gradient corrections ``(K, P)`` in cohort order (zero rows for members without one;
        None when no member has one)."""
        if not any(m.correction is not None for m in members):
            return None
        zero = torch.zeros(self.num_params)
        rows = [members[k].correction if members[k].correction is not None else zero for k in order]
        return torch.stack([r.to(self.device) for r in rows])  # type: ignore[union-attr]

    def _results(
        self,
        members: Sequence[CohortMember],
        cfg: LocalTraining,
        x: torch.Tensor,
        y: torch.Tensor,
        rows: _RowOptimizer,
        mask: torch.Tensor,
        steps: list[int],
        order: list[int],
        share: float,
        activation_bytes: int,
        deltas_on: torch.device | None,
    ) -> tuple[list[LocalResult], torch.Tensor]:
        """Return each member's result from the trained rows, in member order, and their deltas as one tensor."""
        num = len(members)
        deltas = rows.starts - rows.weights
        seen = mask.sum(dim=(0, 2)).tolist()
        losses = rows.loss_sum.tolist()
        if order != list(range(num)):  # rows back to member order: the deltas in one gather
            back = [0] * num  # member -> row
            for row, k in enumerate(order):
                back[k] = row
            deltas = deltas.index_select(0, torch.tensor(back, device=deltas.device))
            seen = [seen[row] for row in back]
            losses = [losses[row] for row in back]
        norms = torch.linalg.vector_norm(deltas, dim=1).tolist()  # every row's norm in one reduction
        if deltas_on is not None and deltas.device != deltas_on:
            deltas = deltas.to(deltas_on)
        per_client_bytes = 4 * self.num_params * 3 + activation_bytes  # weights, gradients, momentum (as train())
        batch_bytes = cfg.batch_size * (x[0].numel() * x.element_size() + y.element_size())
        # Each member's delta is a row of one tensor, not a copy of its own (a copy per member is one allocation and
        # one kernel each): a caller that keeps a member's delta after the cohort's others clones it, or the rest of
        # the cohort's rows stay alive with it (finish_job keeps none).
        results = [
            LocalResult(
                delta=delta,
                num_samples=int(member.indices.shape[0]),
                steps=step_count,
                loss=loss / max(count, 1.0),
                train_s=share,
                peak_mem_bytes=per_client_bytes + batch_bytes,
                update_norm=norm if math.isfinite(norm) else None,
            )
            for member, delta, step_count, loss, count, norm in zip(
                members, deltas.unbind(0), steps, losses, seen, norms, strict=True
            )
        ]
        return results, deltas

    def _activation_bytes(self, xb: torch.Tensor, yb: torch.Tensor) -> int:
        """Return the bytes autograd saves for one client's batch (one plain forward pass, cached by shape)."""
        key = (tuple(xb.shape), xb.dtype, self._precision)
        if key not in self._activations:
            saved = _SavedBytes()
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, _unpack):
                with autocast(self._precision, self.device):
                    out = self.module(xb)
                if self._objective is None:
                    F.cross_entropy(out.float(), yb)
                else:
                    _mean_loss(self._objective)(out.float(), yb)
            self._activations[key] = saved.total
        return self._activations[key]

    def _fetch(
        self, x: torch.Tensor, y: torch.Tensor, index: torch.Tensor, host_data: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather one step's batches ``(k, B, ...)``; from host data, through pinned memory, asynchronously."""
        flat = index.reshape(-1)  # index_select copies rows several times faster than indexing with a 2-D tensor
        xb = x.index_select(0, flat).view(*index.shape, *x.shape[1:])
        yb = y.index_select(0, flat).view(index.shape)
        if not host_data:
            return xb, yb
        if self.device.type == "cuda":
            xb, yb = xb.pin_memory(), yb.pin_memory()
        return xb.to(self.device, non_blocking=True), yb.to(self.device, non_blocking=True)


class _RowOptimizer:
    """SGD over the rows of a cohort's weights, as :func:`train` steps one client: each row's momentum, loss scale,
    gradient correction and loss sum.

    Args:
        cfg: Local hyper-parameters (shared by the cohort).
        starts: The rows' starting weights: one row, broadcast, or ``(K, P)`` in cohort order (FedProx's anchors).
        weights: The weights ``(K, P)`` the steps update in place.
        mask: Each step's real samples ``(S, K, B)`` (1.0) and padding (0.0).
        corrections: Added to each row's gradient ``(K, P)`` (a plug-in's correction; None: nothing).
    """

    def __init__(
        self,
        cfg: LocalTraining,
        starts: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor,
        corrections: torch.Tensor | None,
    ) -> None:
        """Start with zero momentum and zero loss sums."""
        num, device = weights.shape[0], weights.device
        self.cfg = cfg
        self.starts = starts
        self.weights = weights
        self.momentum = torch.zeros_like(weights) if cfg.momentum else None
        self.loss_sum = torch.zeros(num, dtype=torch.float32, device=device)
        self.scaler = LossScaler.for_rows(num, device) if cfg.precision == "fp16" else None
        self.counts = mask.sum(dim=2)  # each step's real samples per row (whole numbers: exact)
        self.corrections = corrections

    def step(self, s: int, k: int, w: torch.Tensor, grads: torch.Tensor, loss: torch.Tensor) -> None:
        """Step the first ``k`` rows ``w`` with their gradients ``(k, P)`` and add their step-``s`` losses ``(k,)``."""
        cfg, scaler, momentum, corrections = self.cfg, self.scaler, self.momentum, self.corrections
        with torch.no_grad():
            apply = None
            if scaler is not None:
                grads = grads / scaler.scale[:k, None]
                apply = scaler.update_rows(grads, k)
            if cfg.clip_norm is not None:
                norm = torch.linalg.vector_norm(grads, dim=1, keepdim=True)
                grads.mul_(torch.clamp(cfg.clip_norm / (norm + 1e-6), max=1.0))
            if corrections is not None:  # one row per client
                grads.add_(corrections[:k])
            if cfg.proximal_mu:  # FedProx: mu (w - w_base), every row from its own base
                starts = self.starts
                anchor = starts if starts.dim() == 1 else starts[:k]
                grads.add_(w, alpha=cfg.proximal_mu).sub_(anchor, alpha=cfg.proximal_mu)
            if cfg.weight_decay:
                grads.add_(w, alpha=cfg.weight_decay)
            if momentum is not None:
                mk = momentum[:k]
                if apply is None:
                    mk.mul_(cfg.momentum).add_(grads)
                    w.add_(mk, alpha=-cfg.lr)
                else:
                    mk.copy_(torch.where(apply[:, None], mk * cfg.momentum + grads, mk))
                    w.sub_(torch.where(apply[:, None], mk * cfg.lr, torch.zeros_like(mk)))
            elif apply is None:
                w.add_(grads, alpha=-cfg.lr)
            else:
                w.sub_(torch.where(apply[:, None], grads * cfg.lr, torch.zeros_like(grads)))
            self.loss_sum[:k].add_(loss * self.counts[s, :k])


def _slice_starts(parts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Return the whole index tensor ``parts`` are contiguous slices of, and where each part starts in it (int64, on
    the host); None when they are not all 1-D slices of the first part's storage (each part's indices then take a copy
    of their own).

    Live tensors share memory only on purpose (views, or one buffer wrapped twice), so a part whose elements lie
    inside the first part's storage is read correctly through it: an address comparison, cheaper than fetching each
    part's storage.
    """
    first = parts[0]
    storage = first.untyped_storage()
    size = first.element_size()
    begin = storage.data_ptr()
    end = begin + storage.nbytes()
    pointers = []
    for part in parts:
        pointer = part.data_ptr()
        if (
            part.stride() != (1,)  # 1-D, contiguous
            or part.dtype != first.dtype
            or part.device != first.device
            or not begin <= pointer < end
            or (pointer - begin) % size
            or pointer + part.shape[0] * size > end
        ):
            return None
        pointers.append(pointer - begin)
    whole = first.new_empty(0).set_(storage, 0, (storage.nbytes() // size,), (1,))
    return whole, torch.tensor(pointers, dtype=torch.int64) // size


def _defined_by(module: nn.Module, name: str) -> type | None:
    """Return the class of ``module``'s MRO that defines the attribute ``name`` (None: none does)."""
    return next((cls for cls in type(module).__mro__ if name in vars(cls)), None)


class _Unsupported(Exception):
    """The model cannot be trained vectorized (raised before any member has been trained)."""
