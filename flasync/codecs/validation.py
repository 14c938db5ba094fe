"""Checks on a decoded client update before it may touch the aggregator.

:class:`UpdateValidator` is pure bookkeeping over tensors: it says why an update is refused (or ``None``), and
keeps the norms of recently *accepted* updates for the robust z-score. The server calls it after decoding and before
aggregating, so a refused update leaves the aggregator exactly as it was.

The robust z-score of a norm ``x`` over recent norms ``h`` is ``(x - median(h)) / (1.4826 * MAD(h))`` (MAD: the
median absolute deviation; 1.4826 makes it estimate the standard deviation of normal data), so one huge update
cannot inflate the scale it is judged by, as it would a mean and standard deviation.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["UpdateValidator", "Verdict", "clip_to_norm", "finite_norm", "robust_zscore"]

_MAD_TO_SIGMA = 1.4826
_NORM_BOUND_MIN_SEEN = 3


@dataclass(frozen=True, slots=True)
class Verdict:
    """Why an update is refused: ``reason`` (a short key, e.g. ``"norm"``) and a one-line ``detail``."""

    reason: str
    detail: str


def robust_zscore(value: float, history: Iterable[float]) -> float:
    """Return ``(value - median) / (1.4826 * MAD)`` over ``history`` (0 when history is empty or has no spread).

    With a zero MAD (most norms equal), any value above the median scores ``inf`` and any other value 0.
    """
    values = sorted(history)
    if not values:
        return 0.0
    median = _median(values)
    mad = _median(sorted(abs(v - median) for v in values))
    if mad == 0.0:
        return math.inf if value > median else 0.0
    return (value - median) / (_MAD_TO_SIGMA * mad)


def _median(sorted_values: list[float]) -> float:
    n = len(sorted_values)
    middle = n // 2
    return sorted_values[middle] if n % 2 else 0.5 * (sorted_values[middle - 1] + sorted_values[middle])


def finite_norm(delta: torch.Tensor) -> float:
    """Return the L2 norm of ``delta``, or NaN if an element of ``delta`` is NaN or infinite.

    A NaN or infinite element makes the norm NaN or infinite, so a finite norm proves every element finite, and the
    element-wise test (five times the norm's cost) runs only for the rest: non-finite elements, or finite ones whose
    norm overflowed (``inf`` is returned then).
    """
    norm = float(torch.linalg.vector_norm(delta))
    if not math.isfinite(norm) and not bool(torch.isfinite(delta).all()):
        return math.nan
    return norm


def clip_to_norm(delta: torch.Tensor, max_norm: float) -> tuple[torch.Tensor, float]:
    """Return ``delta`` scaled down to L2 norm ``max_norm`` if it is longer (a new tensor then), and its norm.

    Raises:
        ValueError: If ``max_norm`` is not a finite number > 0.
    """
    if not max_norm > 0 or not math.isfinite(max_norm):
        raise ValueError(f"max_norm must be finite and > 0, got {max_norm}")
    norm = float(torch.linalg.vector_norm(delta))
    if norm <= max_norm:
        return delta, norm
    return delta * (max_norm / norm), norm


class UpdateValidator:
    """Validate decoded updates: form, finiteness, norm bound and robust z-score of the norm.

    Args:
        num_params: Expected length of every update (a flat vector).
        dtype: Expected element type.
        max_norm: Refuse updates with a larger L2 norm (``None``: no bound).
        zscore_threshold: Refuse updates whose norm's robust z-score exceeds this (``None``: off).
        window: How many accepted norms the z-score looks at.
        min_history: Accepted norms needed before the z-score check applies.
        norm_bound_factor: Refuse updates whose norm exceeds this multiple of the median accepted norm (``None``:
            off); until ``min_history`` updates were accepted, of the median of every norm seen (from the third on).
            The reference then holds only accepted updates, so the refused ones cannot move it: a norm bound on
            a robust reference (Sun et al., "Can You Really Backdoor Federated Learning?", 2019, bound the norm; the
            median makes the bound follow the run without a hand-set constant).
    """

    def __init__(
        self,
        num_params: int,
        *,
        dtype: torch.dtype = torch.float32,
        max_norm: float | None = None,
        zscore_threshold: float | None = None,
        window: int = 50,
        min_history: int = 10,
        norm_bound_factor: float | None = None,
    ) -> None:
        """Start with no history."""
        if window < 1 or min_history < 1:
            raise ValueError(f"window and min_history must be >= 1, got {window} and {min_history}")
        self.num_params = num_params
        self.dtype = dtype
        self.max_norm = max_norm
        self.zscore_threshold = zscore_threshold
        self.min_history = min_history
        self.norm_bound_factor = norm_bound_factor
        self._norms: deque[float] = deque(maxlen=window)
        # Every finite norm checked, refused ones too: the norm bound's reference until enough were accepted.
        self._seen: deque[float] = deque(maxlen=window)

    @property
    def norms(self) -> list[float]:
        """The accepted norms the z-score currently looks at, oldest first."""
        return list(self._norms)

    def load_norms(self, norms: Iterable[float]) -> None:
        """Replace the history of accepted norms (from a checkpoint)."""
        self._norms.clear()
        self._norms.extend(float(n) for n in norms)

    def check(self, delta: torch.Tensor, norm: float | None = None) -> tuple[Verdict | None, float]:
        """Return ``(verdict, norm)``: ``verdict`` is ``None`` if ``delta`` may be aggregated.

        Nothing is recorded but the norm bound's view of the norms seen; call :meth:`accepted` once the update was
        really aggregated. The same as :meth:`check_alone` (form, finiteness, ``max_norm``) and then, if that passes,
        :meth:`check_norm` (the checks against the norms seen before).

        Args:
            delta: The decoded update.
            norm: Its L2 norm if already taken (a batch's norms come from one reduction); a norm that is not
                finite is taken again, element by element, to tell NaN and Inf from an overflowing sum.
        """
        verdict, norm = self.check_alone(delta, norm)
        if verdict is not None:
            return verdict, norm
        return self.check_norm(norm), norm

    def check_alone(self, delta: torch.Tensor, norm: float | None = None) -> tuple[Verdict | None, float]:
        """Return ``(verdict, norm)`` of the checks that look at ``delta`` alone: form, finiteness, ``max_norm``.

        They read and record nothing, so they may run ahead of the update's turn (:meth:`check_rows`); arguments as
        :meth:`check`.
        """
        if delta.dim() != 1 or delta.numel() != self.num_params:
            return Verdict("shape", f"update has shape {tuple(delta.shape)}, expected ({self.num_params},)"), math.nan
        if delta.dtype != self.dtype:
            return Verdict("dtype", f"update has dtype {delta.dtype}, expected {self.dtype}"), math.nan
        if norm is None or not math.isfinite(norm):
            norm = finite_norm(delta)
        return self._norm_alone(norm), norm

    def _norm_alone(self, norm: float) -> Verdict | None:
        """The verdict of :meth:`check_alone` on a delta of the right form whose norm (NaN: not finite) is ``norm``."""
        if math.isnan(norm):
            return Verdict("non_finite", "update contains NaN or Inf")
        if math.isinf(norm):
            # Every element is finite but the norm overflows float32: folded in, it would overflow the model.
            return Verdict("non_finite", "update norm overflows (inf) though every element is finite")
        if self.max_norm is not None and norm > self.max_norm:
            return Verdict("norm", f"update norm {norm:.4g} > max_update_norm {self.max_norm:g}")
        return None

    def check_rows(self, rows: torch.Tensor, norms: Sequence[float]) -> list[tuple[Verdict | None, float]]:
        """Return :meth:`check_alone` of each row of ``rows`` (a batch decoded together), in one pass.

        Each entry is the verdict and norm :meth:`check_alone` gives that row with its norm: the form is checked
        once for the batch, and where every norm is finite and within ``max_norm`` (one sum and one maximum) no row
        is looked at again; a row whose norm is not finite is taken again alone, as :meth:`check_alone` would.

        Args:
            rows: ``(K, P)`` deltas.
            norms: Their L2 norms, one reduction over the rows.
        """
        if rows.dim() != 2 or rows.shape[1] != self.num_params or rows.dtype != self.dtype:
            return [self.check_alone(row, norm) for row, norm in zip(rows.unbind(0), norms, strict=True)]
        # A sum is finite only if every term is (a NaN or an Inf stays in it): one C loop, cheaper than making an
        # array for the few rows of a small batch. A sum that overflows only sends the batch row by row.
        if math.isfinite(sum(norms)) and (self.max_norm is None or max(norms, default=0.0) <= self.max_norm):
            return [(None, norm) for norm in norms]
        out: list[tuple[Verdict | None, float]] = []
        for k, norm in enumerate(norms):
            if not math.isfinite(norm):
                norm = finite_norm(rows[k])
            out.append((self._norm_alone(norm), norm))
        return out

    @property
    def judges_history(self) -> bool:
        """Whether :meth:`check_norm` looks at the norms seen before (a norm bound or a z-score is on): else it
        passes every norm and records none, so accepted norms may be recorded together."""
        return self.norm_bound_factor is not None or self.zscore_threshold is not None

    def check_norm(self, norm: float) -> Verdict | None:
        """Return the verdict of the checks against the norms seen before (norm bound, z-score) on a finite ``norm``
        that :meth:`check_alone` passed; the norm bound's reference records it (see ``norm_bound_factor``)."""
        if self.norm_bound_factor is not None:
            # The median of accepted norms once there are enough, else of every norm seen so far (a minority of
            # attackers cannot move a median): the bound holds from the first updates on.
            reference = self._norms if len(self._norms) >= self.min_history else self._seen
            self._seen.append(norm)
            if len(reference) >= _NORM_BOUND_MIN_SEEN:
                bound = self.norm_bound_factor * _median(sorted(reference))
                if norm > bound:
                    return Verdict(
                        "norm_bound",
                        f"update norm {norm:.4g} > {self.norm_bound_factor:g} x the median of "
                        f"{len(reference)} recent norms ({bound:.4g})",
                    )
        if self.zscore_threshold is not None and len(self._norms) >= self.min_history:
            score = robust_zscore(norm, self._norms)
            if score > self.zscore_threshold:
                return Verdict(
                    "zscore",
                    f"update norm {norm:.4g} has robust z-score {score:.3g} > {self.zscore_threshold:g} "
                    f"over the last {len(self._norms)} accepted updates",
                )
        return None

    def accepted(self, norm: float) -> None:
        """Record the norm of an update that was aggregated."""
        if math.isfinite(norm):
            self._norms.append(norm)

    def accepted_many(self, norms: Iterable[float]) -> None:
        """Record the norms of updates that were aggregated, in order: :meth:`accepted` of each."""
        self._norms.extend(norm for norm in norms if math.isfinite(norm))
