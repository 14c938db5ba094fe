"""Aggregators: pure objects that fold updates in and step the global weights when they decide to.

Each aggregator owns how updates combine and when a new model version is due; none knows about events, clocks or
clients. An update's weight is an example weight times a staleness weight (FLSim's split,
:mod:`flasync.aggregation.weights` and :mod:`flasync.aggregation.staleness`).

* :class:`BufferedAggregator` - FedBuff (Nguyen et al., AISTATS 2022, Algorithm 1) and FedAvg (McMahan et al.,
  AISTATS 2017): ``Delta = sum_k e_k s(tau_k) delta_k / sum_k e_k``, then one server-optimizer step
  (Reddi et al., ICLR 2021) with ``Delta`` as the pseudo-gradient; due once ``size`` updates are in.
* :class:`MixingAggregator` - FedAsync (Xie, Koyejo and Gupta, 2019, eq. 1): every update is mixed in at once,
  ``w <- (1 - alpha s(tau)) w + alpha s(tau) x_local``.
* :class:`RobustAggregator` - a round's updates combined coordinate-wise by median or trimmed mean (Yin et al.,
  ICML 2018), then one server-optimizer step; the round's end (a policy's decision) makes it due.

A rule of your own satisfies :class:`Aggregator` and is passed to ``flasync.Federation(config, aggregator=...)``;
:class:`CustomAggregator` keeps it in checkpoints under its name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import torch

from flasync.aggregation.buffer import UpdateBuffer
from flasync.aggregation.functional import fedasync_mix_
from flasync.aggregation.hierarchy import mix_partial_
from flasync.aggregation.optimizers import ServerOptimizer
from flasync.aggregation.robust import coordinate_median, trimmed_mean
from flasync.aggregation.staleness import StalenessWeight
from flasync.aggregation.weights import ExampleWeight
from flasync.core.errors import CheckpointError

__all__ = [
    "Aggregator",
    "BufferedAggregator",
    "CustomAggregator",
    "MixingAggregator",
    "RobustAggregator",
    "RobustRule",
]

RobustRule = Literal["median", "trimmed_mean"]


class Aggregator(Protocol):
    """What the server loop needs of an aggregation rule: the seam for a server rule of your own.

    A rule is built over the global weights, one flat float32 tensor of ``P`` elements on the run's device, which
    it changes **in place** in :meth:`add` or :meth:`step` (the server never copies them back). Everything runs on
    the event loop's thread, one call at a time, so a rule needs no lock, and it must draw no random numbers
    that are not its own seeded generator's (the same seed then gives the same weights, bit for bit).

    The server loop calls, for each accepted client update, ``add(delta, staleness=tau, num_samples=n, base=w)``:
    ``delta = base - w_local`` (a pseudo-gradient, already decoded, checked and clipped by the server's resilience
    settings), ``staleness`` the versions published since ``base`` (always 0 in synchronous rounds), ``num_samples``
    the client's training samples and ``base`` the weights it started from. The tensors are the server's: read
    them, or clone what must be kept until :meth:`step`. An edge (``topology.kind = "tree"``) sends sums instead,
    through :meth:`add_partial`; a rule that combines individual updates only may raise ``ValueError`` there.
    Under secure aggregation each group's unmasked sum comes through :meth:`add_partial` (``staleness`` 0) and
    :meth:`add` is never called; a factory runs there only if it says so with ``partial_sums = True``.

    When :meth:`step` runs depends on the server's kind (the policy):

    * ``fedavg`` (synchronous rounds): once a round closes (``clients_per_round`` answers, a quorum at the
      deadline, or nothing left in flight), if :meth:`count` is above 0. :meth:`ready` is not asked.
    * ``fedbuff`` and ``fedasync`` (asynchronous slots): after each message the server handled, if :meth:`ready`
      returns True. A rule that is never ready never publishes.

    Each :meth:`step` publishes version ``v + 1`` of the weights. :meth:`state_dict` goes into checkpoints, which
    are read back with ``torch.load(weights_only=True)``: plain values, lists, dicts and tensors only.
    """

    def add(self, delta: torch.Tensor, *, staleness: int, num_samples: int, base: torch.Tensor) -> float:
        """Fold one client delta in (read, not kept unless the rule must); return its staleness weight.

        Args:
            delta: ``base - w_local``, flat ``(P,)``.
            staleness: ``tau``, versions published since ``base`` (>= 0).
            num_samples: The client's training samples.
            base: The global weights the client started from, flat ``(P,)``.

        Returns:
            The weight the rule gave the update's staleness (1.0 if it ignores staleness), logged as a metric.
        """
        ...

    def add_partial(self, weighted_sum: torch.Tensor, *, example_weight: float, staleness: int) -> float:
        """Fold an edge's partial aggregate ``sum_k e_k s_k delta_k`` in; return the staleness weight applied."""
        ...

    def ready(self) -> bool:
        """Tell whether the rule wants a new version now (asked by asynchronous policies; rounds decide alone)."""
        ...

    def step(self) -> None:
        """Apply what was folded in to the global weights, in place, and start afresh."""
        ...

    def count(self) -> int:
        """Count the updates (or partials) waiting for the next step."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes the rule holds besides the global weights (buffers, optimizer state)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Return the rule's state for a checkpoint (plain values and tensors, copied)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        ...


def _expect_kind(state: dict[str, Any], kind: str) -> None:
    if not isinstance(state, dict) or state.get("kind") != kind:
        found = state.get("kind") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"checkpoint holds a {found!r} aggregator, this run a {kind} one")


class BufferedAggregator:
    """FedBuff and FedAvg: accumulate weighted deltas, then one server-optimizer step.

    Args:
        weights: The global weights, stepped in place by ``optimizer``; the buffer lives on their device.
        size: ``K``: the rule is due once this many updates (or partials) are in.
        optimizer: Steps ``weights`` with the buffer's pseudo-gradient.
        staleness: ``s(tau)``.
        example_weight: ``e_k``.
        release: Makes a version's pseudo-gradient from the buffer's weighted sum and the version's index instead
            of the weighted mean (None: the mean); e.g. :meth:`flasync.aggregation.privacy.GaussianMechanism.privatize`,
            the noised sum over a fixed count ``(sum_k e_k s_k delta_k + N(0, (z C)^2 I)) / K``.
    """

    def __init__(
        self,
        weights: torch.Tensor,
        *,
        size: int,
        optimizer: ServerOptimizer,
        staleness: StalenessWeight,
        example_weight: ExampleWeight,
        release: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    ) -> None:
        """Allocate the buffer on the weights' device."""
        self.buffer = UpdateBuffer(weights.numel(), device=weights.device)
        self.optimizer = optimizer
        self.size = size
        self.staleness = staleness
        self.example_weight = example_weight
        self.release = release
        self.steps = 0

    def add(self, delta: torch.Tensor, *, staleness: int, num_samples: int, base: torch.Tensor) -> float:
        """Add ``e_k s(tau_k) delta_k`` to the buffer; return ``s(tau_k)``."""
        weight = self.staleness(staleness)
        self.buffer.add(delta, example_weight=self.example_weight(num_samples), staleness_weight=weight)
        return weight

    def weigh(self, staleness: Sequence[int], num_samples: Sequence[int]) -> tuple[list[float], list[float]]:
        """Return the example weights ``e_k`` and staleness weights ``s(tau_k)`` :meth:`add` would give updates of
        ``staleness`` versions trained on ``num_samples`` samples, up to the first update whose weights the buffer
        would refuse (so :meth:`add_rows` takes every pair given).

        ``s`` is asked once for each staleness of the batch (a batch's updates mostly share theirs), ``e`` for each
        update.
        """
        weigh: dict[int, float] = {}
        for tau in staleness:
            if tau not in weigh:
                weigh[tau] = self.staleness(tau)
        staleness_weights = [weigh[tau] for tau in staleness]
        example_weight = self.example_weight
        example_weights = [example_weight(samples) for samples in num_samples]
        # A NaN or an Inf makes the sum so; a sum that overflows only sends the batch to the check of each.
        if not (
            math.isfinite(sum(example_weights) + sum(weigh.values()))
            and min(example_weights, default=1.0) > 0
            and min(weigh.values(), default=0.0) >= 0
        ):
            for index, (example, weight) in enumerate(zip(example_weights, staleness_weights, strict=True)):
                if not (0 < example < math.inf and 0 <= weight < math.inf):
                    del example_weights[index:], staleness_weights[index:]
                    break
        return example_weights, staleness_weights

    def add_rows(
        self, deltas: Sequence[torch.Tensor], *, example_weights: Sequence[float], staleness_weights: Sequence[float]
    ) -> None:
        """Add ``e_k s_k delta_k`` of each update in turn, its weights as :meth:`weigh` gave them: :meth:`add` of each,
        bit for bit (see :meth:`UpdateBuffer.add_rows`)."""
        self.buffer.add_rows(deltas, example_weights=example_weights, staleness_weights=staleness_weights)

    def add_partial(self, weighted_sum: torch.Tensor, *, example_weight: float, staleness: int) -> float:
        """Add ``s(tau) S`` and ``E`` of an edge's partial; return ``s(tau)``."""
        weight = self.staleness(staleness)
        self.buffer.add_sum(weighted_sum, example_weight=example_weight, staleness_weight=weight)
        return weight

    def ready(self) -> bool:
        """Tell whether ``K`` updates are in."""
        return self.buffer.count >= self.size

    def room(self) -> int:
        """Count the updates the buffer takes before :meth:`ready` (the last of them makes a version due)."""
        return max(self.size - self.buffer.count, 0)

    def step(self) -> None:
        """Step the optimizer with the buffer's weighted mean delta (or what ``release`` makes) and empty the buffer."""
        if self.release is None:
            # The mean is taken in place: the buffer is emptied right after the step reads it.
            self.optimizer.step(self.buffer.mean_())
        else:
            self.optimizer.step(self.release(self.buffer.weighted_sum, self.steps))
        self.steps += 1
        self.buffer.reset()

    def count(self) -> int:
        """Count the updates in the buffer."""
        return self.buffer.count

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer and the optimizer's state."""
        return self.buffer.nbytes + self.optimizer.state_nbytes

    def state_dict(self) -> dict[str, Any]:
        """Return the buffer's and the optimizer's state."""
        return {
            "kind": "buffered",
            "buffer": self.buffer.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        _expect_kind(state, "buffered")
        self.buffer.load_state_dict(state["buffer"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state.get("steps", 0))


class RobustAggregator:
    """Keep a round's deltas, combine them coordinate-wise (median or trimmed mean), one server step.

    Coordinate-wise rules need every delta of the round at once, so this rule holds them (``K`` flat tensors)
    and never asks for a step itself: the round's end does.

    Args:
        weights: The global weights, stepped in place by ``optimizer``.
        rule: ``median`` or ``trimmed_mean``.
        trim_fraction: The share cut at each end by ``trimmed_mean``.
        optimizer: Steps ``weights`` with the combined delta.
    """

    def __init__(
        self, weights: torch.Tensor, *, rule: RobustRule, trim_fraction: float, optimizer: ServerOptimizer
    ) -> None:
        """Start with an empty round."""
        self.optimizer = optimizer
        self.rule = rule
        self.trim_fraction = trim_fraction
        self.deltas: list[torch.Tensor] = []

    def add(self, delta: torch.Tensor, *, staleness: int, num_samples: int, base: torch.Tensor) -> float:
        """Keep a copy of the delta for the round's combination; return 1 (no staleness in rounds)."""
        self.deltas.append(delta.detach().clone())
        return 1.0

    def add_partial(self, weighted_sum: torch.Tensor, *, example_weight: float, staleness: int) -> float:
        """Refuse: a coordinate-wise rule combines client updates, not sums of them."""
        raise ValueError("robust aggregation combines client updates, not edge partial aggregates")

    def ready(self) -> bool:
        """Return False: the round's end decides."""
        return False

    def step(self) -> None:
        """Combine the round's deltas and step the optimizer with the result."""
        if self.rule == "median":
            aggregate = coordinate_median(self.deltas)
        else:
            aggregate = trimmed_mean(self.deltas, self.trim_fraction)
        self.optimizer.step(aggregate)
        self.deltas.clear()

    def count(self) -> int:
        """Count the round's deltas."""
        return len(self.deltas)

    @property
    def nbytes(self) -> int:
        """Bytes of the held deltas and the optimizer's state."""
        held = sum(d.numel() * d.element_size() for d in self.deltas)
        return held + self.optimizer.state_nbytes

    def state_dict(self) -> dict[str, Any]:
        """Return the round's deltas and the optimizer's state."""
        return {"kind": "robust", "deltas": [d.clone() for d in self.deltas], "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        _expect_kind(state, "robust")
        self.deltas = [d.clone() for d in state["deltas"]]
        self.optimizer.load_state_dict(state["optimizer"])


class MixingAggregator:
    """FedAsync: every update is mixed into the weights as it arrives; each one is a new version.

    Args:
        weights: The global weights, mixed in place.
        alpha: The mixing rate ``alpha`` in ``(0, 1]``.
        staleness: ``s(tau)``, which discounts ``alpha``.
    """

    def __init__(self, weights: torch.Tensor, *, alpha: float, staleness: StalenessWeight) -> None:
        """Bind the weights."""
        self.weights = weights
        self.alpha = alpha
        self.staleness = staleness
        self._pending = False

    def add(self, delta: torch.Tensor, *, staleness: int, num_samples: int, base: torch.Tensor) -> float:
        """Mix the local model ``base - delta`` in at rate ``alpha s(tau)``; return ``s(tau)``."""
        weight = self.staleness(staleness)
        local = base - delta
        fedasync_mix_(self.weights, local, self.alpha * weight)
        self._pending = True
        return weight

    def add_partial(self, weighted_sum: torch.Tensor, *, example_weight: float, staleness: int) -> float:
        """Mix an edge's mean delta in at rate ``alpha s(tau)``; return ``s(tau)``."""
        weight = self.staleness(staleness)
        mix_partial_(self.weights, weighted_sum, alpha=self.alpha * weight, example_weight=example_weight)
        self._pending = True
        return weight

    def ready(self) -> bool:
        """Tell whether an update was mixed in since the last version."""
        return self._pending

    def step(self) -> None:
        """Mark the mixed-in update as published (the weights changed already)."""
        self._pending = False

    def count(self) -> int:
        """Return 1 if an update waits to be published, else 0."""
        return int(self._pending)

    @property
    def nbytes(self) -> int:
        """Return 0: the rule holds nothing besides the weights."""
        return 0

    def state_dict(self) -> dict[str, Any]:
        """Return whether an update waits to be published."""
        return {"kind": "mixing", "pending": self._pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        _expect_kind(state, "mixing")
        self._pending = bool(state["pending"])


class CustomAggregator:
    """A rule of your own as the server holds it: every call forwarded, checkpoints kept under the rule's name.

    Its state is ``{"kind": "custom", "rule": name, "state": rule.state_dict()}``, so a checkpoint of a custom
    rule is resumed by a rule of the same name only, and a built-in rule refuses it.

    Args:
        rule: Any object satisfying :class:`Aggregator`.
        name: What the rule is called in checkpoints and messages (e.g. its class name).
    """

    def __init__(self, rule: Aggregator, name: str) -> None:
        """Wrap ``rule``."""
        self.rule = rule
        self.name = name

    def add(self, delta: torch.Tensor, *, staleness: int, num_samples: int, base: torch.Tensor) -> float:
        """Forward to the rule."""
        return float(self.rule.add(delta, staleness=staleness, num_samples=num_samples, base=base))

    def add_partial(self, weighted_sum: torch.Tensor, *, example_weight: float, staleness: int) -> float:
        """Forward to the rule."""
        return float(self.rule.add_partial(weighted_sum, example_weight=example_weight, staleness=staleness))

    def ready(self) -> bool:
        """Forward to the rule."""
        return bool(self.rule.ready())

    def step(self) -> None:
        """Forward to the rule."""
        self.rule.step()

    def count(self) -> int:
        """Forward to the rule."""
        return int(self.rule.count())

    @property
    def nbytes(self) -> int:
        """Forward to the rule."""
        return int(self.rule.nbytes)

    def state_dict(self) -> dict[str, Any]:
        """Return the rule's state under its name."""
        return {"kind": "custom", "rule": self.name, "state": self.rule.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (of a rule with the same name)."""
        _expect_kind(state, "custom")
        if state.get("rule") != self.name:
            found = state.get("rule")
            raise CheckpointError(f"checkpoint holds the custom aggregator {found!r}, this run {self.name!r}")
        self.rule.load_state_dict(state["state"])
