"""A preallocated accumulator that folds client deltas into a FedBuff aggregate one at a time."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from functools import reduce
from typing import Any

import torch
from torch import Tensor

__all__ = ["UpdateBuffer"]

# The largest divisor a float32 scalar holds: a larger total weight divides as a Python number (see mean_).
_FLOAT32_MAX = torch.finfo(torch.float32).max


class UpdateBuffer:
    """Accumulate weighted client deltas in one flat tensor, in place, for FedBuff.

    Each `add` computes ``acc += e_k * s_k * delta_k`` and ``E += e_k``; `pseudo_gradient` returns
    ``acc / E``. After ``K`` updates this equals `flasync.aggregation.fedbuff` of the same deltas (Nguyen et
    al., "Federated Learning with Buffered Asynchronous Aggregation", AISTATS 2022, Algorithm 1)::

        acc / E = sum_k (e_k / sum_j e_j) * s(tau_k) * delta_k

    but never holds more than one model's worth of memory, however many updates it has taken. The buffer does
    not decide when it is full: the server steps its optimizer after ``K`` updates (``count``) and calls
    `reset`.

    An edge aggregator can forward ``pseudo_gradient()`` upstream with
    ``example_weight=total_example_weight``.

    Args:
        num_params: Length of the flat model vector, >= 1.
        dtype: Element type of the accumulator and of the deltas it accepts.
        device: Where the accumulator lives; deltas must be on the same device.

    Raises:
        ValueError: If ``num_params < 1``.
    """

    __slots__ = ("_acc", "_count", "_device", "_divisor", "_dtype", "_shape", "_total_example_weight")

    def __init__(
        self, num_params: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        if num_params < 1:
            raise ValueError(f"num_params must be >= 1, got {num_params}")
        self._acc = torch.zeros(num_params, dtype=dtype, device=device)
        # What a delta must match, read once: one comparison each per update instead of the tensor's attributes.
        self._shape, self._dtype, self._device = self._acc.shape, self._acc.dtype, self._acc.device
        self._count = 0
        self._total_example_weight = 0.0
        # mean_ divides by a 0-d tensor of the accumulator's dtype (None: by the Python number); see mean_.
        exact = dtype in (torch.float32, torch.float64) and self._device.type == "cpu"
        self._divisor = torch.zeros((), dtype=dtype) if exact else None

    def __repr__(self) -> str:
        return (
            f"UpdateBuffer(num_params={self.num_params}, dtype={self._acc.dtype}, device={self._acc.device}, "
            f"count={self._count}, total_example_weight={self._total_example_weight})"
        )

    @property
    def num_params(self) -> int:
        """Length of the flat model vector."""
        return self._acc.numel()

    @property
    def count(self) -> int:
        """Number of updates added since construction or the last `reset`."""
        return self._count

    @property
    def total_example_weight(self) -> float:
        """Sum of the example weights added since construction or the last `reset`."""
        return self._total_example_weight

    @property
    def weighted_sum(self) -> Tensor:
        """The accumulator ``sum_k e_k s_k delta_k`` itself (a read-only view: do not modify it)."""
        return self._acc

    @property
    def nbytes(self) -> int:
        """Size of the accumulator, in bytes."""
        return self._acc.numel() * self._acc.element_size()

    def add(self, delta: Tensor, *, example_weight: float, staleness_weight: float) -> None:
        """Fold one client delta into the buffer, in place.

        Args:
            delta: Flat client delta ``w_base - w_local`` of ``num_params`` elements, with the buffer's dtype
                and device. It is read, not kept.
            example_weight: The update's weight ``e_k`` (e.g. its number of samples), finite and > 0.
            staleness_weight: The discount ``s(tau_k)`` from a `StalenessWeight`, finite and >= 0.

        Raises:
            ValueError: If ``delta`` has the wrong shape, dtype or device, or a weight is out of range. The
                buffer is left unchanged.
        """
        if not (
            0 < example_weight < math.inf
            and 0 <= staleness_weight < math.inf
            and delta.shape == self._shape
            and delta.dtype == self._dtype
            and delta.device == self._device
        ):
            self._check(delta, example_weight, staleness_weight)  # names what is wrong
        self._acc.add_(delta, alpha=example_weight * staleness_weight)
        self._total_example_weight += example_weight
        self._count += 1

    def add_rows(
        self, deltas: Sequence[Tensor], *, example_weights: Sequence[float], staleness_weights: Sequence[float]
    ) -> None:
        """Fold client deltas in, one at a time and in order: :meth:`add` of each, bit for bit.

        The arguments are checked once for all of them (the rows of a batch decoded together share one shape, dtype
        and device), then each row is added as :meth:`add` adds it (``acc += e_k * s_k * delta_k``, never a sum of
        the rows first) and ``E`` grows by each ``e_k`` in turn. Rows of one weight on the CPU are added in one call
        that adds them in turn with the same kernel.

        Args:
            deltas: Flat client deltas, each as :meth:`add` takes it.
            example_weights: Their weights ``e_k``, finite and > 0.
            staleness_weights: Their discounts ``s(tau_k)``, finite and >= 0.

        Raises:
            ValueError: If the lengths differ, or a delta or weight is wrong as :meth:`add` says; nothing is added.
                An error of the fold itself leaves the rows folded before it counted (:attr:`count`); in the one call
                for rows of one weight, none is counted.
        """
        if not len(deltas) == len(example_weights) == len(staleness_weights):
            raise ValueError(
                f"{len(deltas)} deltas, {len(example_weights)} example weights and {len(staleness_weights)} "
                "staleness weights: one of each per update"
            )
        shape, dtype, device = self._shape, self._dtype, self._device
        # The weights' bounds in a few C loops (a NaN or an Inf makes the sum so), then each row's form.
        weights_ok = not deltas or (
            math.isfinite(sum(example_weights) + sum(staleness_weights))
            and min(example_weights) > 0
            and min(staleness_weights) >= 0
        )
        for delta, example_weight, staleness_weight in zip(deltas, example_weights, staleness_weights, strict=True):
            if not (weights_ok and delta.shape == shape and delta.dtype == dtype and delta.device == device):
                self._check(delta, example_weight, staleness_weight)  # names what is wrong, if anything is
        acc = self._acc
        alphas = list(map(operator.mul, example_weights, staleness_weights))
        if len(alphas) > 1 and alphas.count(alphas[0]) == len(alphas) and acc.device.type == "cpu":
            # Rows of one weight in one call: on the CPU, torch._foreach_add_ adds each row in turn with add_'s own
            # kernel (the same sums, bit for bit), releasing the GIL once for the batch instead of once a row. (On a
            # GPU its fused kernel would add the rows into the one accumulator at once: rows are folded one by one.)
            torch._foreach_add_([acc] * len(alphas), list(deltas), alpha=alphas[0])
            self._total_example_weight = reduce(operator.add, example_weights, self._total_example_weight)
            self._count += len(alphas)
            return
        fold, total, done = acc.add_, self._total_example_weight, 0
        try:
            for delta, example_weight, alpha in zip(deltas, example_weights, alphas, strict=True):
                fold(delta, alpha=alpha)
                total += example_weight
                done += 1
        finally:  # a fold that fails leaves the rows before it counted, as many calls of add would
            self._total_example_weight = total
            self._count += done

    def _check(self, delta: Tensor, example_weight: float, staleness_weight: float) -> None:
        if delta.dim() != 1:
            raise ValueError(f"delta must be flat (1-D), got shape {tuple(delta.shape)}")
        if delta.numel() != self._acc.numel():
            raise ValueError(f"delta has {delta.numel()} elements, expected {self._acc.numel()}")
        if delta.dtype != self._acc.dtype:
            raise ValueError(f"delta has dtype {delta.dtype}, expected {self._acc.dtype}")
        if delta.device != self._acc.device:
            raise ValueError(f"delta is on device {delta.device}, expected {self._acc.device}")
        if not example_weight > 0 or not math.isfinite(example_weight):
            raise ValueError(f"example_weight must be finite and > 0, got {example_weight}")
        if not staleness_weight >= 0 or not math.isfinite(staleness_weight):
            raise ValueError(f"staleness_weight must be finite and >= 0, got {staleness_weight}")

    def add_sum(self, weighted_sum: Tensor, *, example_weight: float, staleness_weight: float = 1.0) -> None:
        """Fold an edge's partial aggregate in: ``acc += s * weighted_sum`` and ``E += example_weight``.

        ``weighted_sum`` is ``sum_j e_j s_j delta_j`` over the updates an edge folded and ``example_weight`` their
        ``sum_j e_j``, so the pseudo-gradient is what the same updates added one by one would give. The partial
        counts as one arrival towards ``count`` (the server's ``K`` counts what reaches it).

        Args:
            weighted_sum: Flat tensor of ``num_params`` elements, the buffer's dtype and device; read, not kept.
            example_weight: The partial's total example weight, finite and > 0.
            staleness_weight: A further discount of the whole partial, finite and >= 0.

        Raises:
            ValueError: As for `add`; the buffer is left unchanged.
        """
        self._check(weighted_sum, example_weight, staleness_weight)
        self._acc.add_(weighted_sum, alpha=staleness_weight)
        self._total_example_weight += example_weight
        self._count += 1

    def add_stacked(self, deltas: Tensor, *, example_weights: Tensor, staleness_weights: Tensor) -> None:
        """Fold ``K`` client deltas, the rows of ``deltas``, into the buffer in one fused pass.

        Equal to calling :meth:`add` for each row in order, up to float rounding: ``acc += deltas^T (e * s)`` is
        one ``addmv_`` that reads each delta once, instead of ``K`` passes over the accumulator. A vectorized
        cohort's deltas arrive this way.

        Args:
            deltas: ``(K, num_params)`` with the buffer's dtype and device.
            example_weights: ``(K,)`` weights ``e_k``, finite and > 0.
            staleness_weights: ``(K,)`` discounts ``s(tau_k)``, finite and >= 0.

        Raises:
            ValueError: If a shape, dtype or device is wrong or a weight is out of range (nothing is changed).
        """
        if deltas.dim() != 2 or deltas.shape[1] != self._acc.numel():
            raise ValueError(f"deltas must have shape (K, {self._acc.numel()}), got {tuple(deltas.shape)}")
        if deltas.dtype != self._acc.dtype or deltas.device != self._acc.device:
            raise ValueError(
                f"deltas are {deltas.dtype} on {deltas.device}, expected {self._acc.dtype} on {self._acc.device}"
            )
        rows = deltas.shape[0]
        if example_weights.shape != (rows,) or staleness_weights.shape != (rows,):
            raise ValueError(f"weights must have shape ({rows},)")
        e = example_weights.detach().to("cpu", torch.float64)
        s = staleness_weights.detach().to("cpu", torch.float64)
        if not bool(torch.isfinite(e).all() and (e > 0).all()):
            raise ValueError("example_weights must be finite and > 0")
        if not bool(torch.isfinite(s).all() and (s >= 0).all()):
            raise ValueError("staleness_weights must be finite and >= 0")
        weights = (e * s).to(self._acc.device, self._acc.dtype)
        self._acc.addmv_(deltas.t(), weights)
        self._total_example_weight += float(e.sum())
        self._count += rows

    def pseudo_gradient(self) -> Tensor:
        """Return the aggregate ``acc / total_example_weight`` as a new tensor.

        The buffer is left as it is; call `reset` to start the next round of updates.

        Returns:
            A new flat tensor of ``num_params`` elements, the weighted mean delta, to feed a
            `ServerOptimizer`.

        Raises:
            ValueError: If no update has been added since construction or the last `reset`.
        """
        if self._count == 0:
            raise ValueError("the buffer is empty; add at least one update before taking its pseudo-gradient")
        return self._acc / self._total_example_weight

    def mean_(self) -> Tensor:
        """Turn the accumulator into the aggregate ``acc / total_example_weight``, in place, and return it.

        :meth:`pseudo_gradient` without a new tensor: the same values, bit for bit. The buffer then holds the mean,
        not the sum, until `reset` (call it before the next `add`); read the result before that.

        Returns:
            The accumulator itself, a flat tensor of ``num_params`` elements holding the weighted mean delta.

        Raises:
            ValueError: If no update has been added since construction or the last `reset`.
        """
        if self._count == 0:
            raise ValueError("the buffer is empty; add at least one update before taking its pseudo-gradient")
        total, divisor = self._total_example_weight, self._divisor
        if divisor is None or (self._dtype is torch.float32 and not total <= _FLOAT32_MAX):
            return self._acc.div_(total)
        # On the CPU a Python number divides a float32 or float64 tensor as that dtype rounds it; a 0-d tensor
        # holding the rounded value gives the same quotients without wrapping the number in a new tensor each call.
        divisor.fill_(total)
        return self._acc.div_(divisor)

    def reset(self) -> None:
        """Empty the buffer, zeroing the accumulator in place (no reallocation)."""
        self._acc.zero_()
        self._count = 0
        self._total_example_weight = 0.0

    def state_dict(self) -> dict[str, Any]:
        """Return a snapshot of the buffer for a checkpoint.

        The accumulator is copied, so later updates do not change the snapshot (it can be written from another
        thread while the buffer goes on filling).

        Returns:
            ``{"accumulator": Tensor, "count": int, "total_example_weight": float}``.
        """
        return {
            "accumulator": self._acc.detach().clone(),
            "count": self._count,
            "total_example_weight": self._total_example_weight,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the buffer from a `state_dict` snapshot, copying into the existing accumulator.

        Args:
            state: A mapping as returned by `state_dict`, from a buffer of the same ``num_params``.

        Raises:
            ValueError: If a key is missing, the accumulator's shape differs, or the count and total weight
                are inconsistent. The buffer is left unchanged.
        """
        missing = sorted({"accumulator", "count", "total_example_weight"} - state.keys())
        if missing:
            raise ValueError(f"state is missing keys {missing}")
        accumulator = state["accumulator"]
        count = state["count"]
        total = state["total_example_weight"]
        if not isinstance(accumulator, Tensor):
            raise ValueError(f"state['accumulator'] must be a Tensor, got {type(accumulator).__name__}")
        if accumulator.shape != self._acc.shape:
            raise ValueError(
                f"state['accumulator'] has shape {tuple(accumulator.shape)}, expected {tuple(self._acc.shape)}"
            )
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"state['count'] must be an int >= 0, got {count!r}")
        total = float(total)
        if not total >= 0 or not math.isfinite(total):
            raise ValueError(f"state['total_example_weight'] must be finite and >= 0, got {total}")
        if (count == 0) != (total == 0):
            raise ValueError(
                f"state has count {count} but total_example_weight {total}; both must be zero or both positive"
            )
        self._acc.copy_(accumulator)
        self._count = count
        self._total_example_weight = total
