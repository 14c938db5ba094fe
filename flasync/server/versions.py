"""The cloud's versions: step the aggregator into a new model, publish it (encoded once), evaluate it.

:class:`VersionMaker` owns the model's counter, the **version**: the server loop decides when a version is due
(its :class:`~flasync.server.policies.Policy`) and asks for it; the maker steps the
:class:`~flasync.aggregation.Aggregator`, checks the weights, publishes the new model to the
:class:`~flasync.server.registry.TaskRegistry` and the policy, and reports the version's figures and evaluations.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

from flasync.aggregation import Aggregator
from flasync.codecs import Pipeline
from flasync.core.bus import EventBus
from flasync.core.clock import Clock
from flasync.core.errors import TrainingError
from flasync.core.events import Aggregated, Evaluated, ModelPublished, Version
from flasync.core.instruments import logs_debug
from flasync.core.snapshots import ModelSnapshot
from flasync.server.accounting import Accounting
from flasync.server.policies import Policy
from flasync.server.registry import TaskRegistry
from flasync.server.stopping import StopRules, eta_seconds
from flasync.training.local import EvalResult
from flasync.training.plugins import ServerPlugin

__all__ = ["Evaluator", "VersionMaker"]

Evaluator = Callable[[torch.Tensor], Awaitable[EvalResult | None]]
"""Evaluate flat weights off the event loop (None: there is nothing to evaluate on)."""


def _checked_norm(weights: torch.Tensor) -> float | None:
    """Return ``||weights||_2``, or None when an element of ``weights`` is NaN or infinite: the finite check of
    ``torch.isfinite(weights).all()``, mostly in one reduction, whose norm the version's snapshot keeps.

    A NaN or infinite element makes the L2 norm NaN or infinite, so a finite norm proves every element finite (one
    reduction instead of the element-wise test's five passes); only a norm that is not finite, which finite elements
    give when their squares overflow, is settled by the element-wise test (their norm is then infinite).
    """
    if weights.requires_grad:
        weights = weights.detach()
    norm = float(torch.linalg.vector_norm(weights))
    return norm if math.isfinite(norm) or bool(torch.isfinite(weights).all()) else None


class VersionMaker:
    """Make, publish and evaluate the cloud's model versions.

    Args:
        weights: The flat global weights (the aggregator steps them in place).
        aggregator: Steps ``weights`` with what was folded in.
        registry: Where each published model becomes the base of the tasks that start from it.
        policy: Learns of each published model.
        accounting: The run's counters (each version's figures are closed there).
        bus: The run's event bus.
        clock: The run's clock.
        wall: Monotonic real seconds.
        log: The run's logger.
        download_codec: Encodes each published model once.
        evaluate: Evaluates a model off the loop.
        rules: The run's stop rules (the evaluation's progress line counts towards ``max_versions``).
        download_generator: The download codec's random stream for a version (stochastic stages draw from it).
        plugins: The run's server-side algorithm state: each sends what it has with every model and learns of every
            step and version made.

    Attributes:
        version: The newest version (0: the initial model).
        start_wall: The wall reading when this process started the run (see :meth:`begin`).
        first_version: The version this process started from (a resumed run's pace counts from it).
    """

    def __init__(
        self,
        weights: torch.Tensor,
        *,
        aggregator: Aggregator,
        registry: TaskRegistry,
        policy: Policy,
        accounting: Accounting,
        bus: EventBus,
        clock: Clock,
        wall: Callable[[], float],
        log: Any,
        download_codec: Pipeline,
        evaluate: Evaluator,
        rules: StopRules,
        download_generator: Callable[[int], torch.Generator] | None = None,
        plugins: Sequence[ServerPlugin] = (),
    ) -> None:
        """Start at version 0."""
        self.weights = weights
        self.aggregator = aggregator
        self.registry = registry
        self.policy = policy
        self.accounting = accounting
        self.bus = bus
        self.clock = clock
        self.wall = wall
        self.log = log
        self.download_codec = download_codec
        self.evaluate_weights = evaluate
        self.rules = rules
        self.download_generator = download_generator
        self.plugins = tuple(plugins)
        self.version = Version(0)
        self.start_wall = 0.0
        self.first_version = 0

    def begin(self) -> None:
        """Mark the run's start in this process: its wall time and the version it starts from."""
        self.start_wall = self.wall()
        self.first_version = int(self.version)

    def elapsed_s(self) -> float:
        """Return the wall seconds since :meth:`begin`."""
        return self.wall() - self.start_wall

    async def step(self) -> None:
        """Step the aggregator into the next version, publish it and report its figures (:class:`Aggregated`).

        Raises:
            TrainingError: If the step left NaN or Inf in the weights (nothing later could repair it).
        """
        stats = self.accounting.stats
        start = self.wall()
        self.aggregator.step()
        for plugin in self.plugins:
            plugin.stepped(int(self.version))
        aggregate_s = self.wall() - start
        norm = _checked_norm(self.weights)
        if norm is None:
            # Nothing a later version does can repair it, and every client would train from it.
            raise TrainingError(
                f"the global model has NaN or Inf after the server step to version {int(self.version) + 1}: "
                "lower the server learning rate or bound updates (resilience.max_update_norm, clip_update_norm)"
            )
        stats.cloud_aggregate_s += aggregate_s
        self.version = version = Version(self.version + 1)
        stats.versions = int(version)
        # The snapshot's clone has the weights' values; in the same layout (contiguous), the same norm, bit for bit.
        await self.publish(norm=norm if self.weights.is_contiguous() else None)
        figures = self.accounting.close_version(int(version))
        wall_s = self.elapsed_s()
        if logs_debug(self.log):  # a filtered debug call would still build its fields
            self.log.debug(
                "server.version",
                step=int(version),
                aggregate_s=aggregate_s,
                updates=figures.updates,
                staleness_mean=figures.staleness_mean,
                in_flight=len(self.registry),
                ingress_bytes=figures.ingress_bytes,
                egress_bytes=figures.egress_bytes,
                simulated_s=self.clock.now(),
                wall_s=wall_s,
                versions_per_s=int(version) / wall_s if wall_s > 0 else 0.0,
            )
        for plugin in self.plugins:
            plugin.version_made(int(version), self.log)
        await self.bus.publish(
            Aggregated(
                version=version,
                num_updates=figures.updates,
                mean_staleness=figures.staleness_mean,
                aggregate_s=aggregate_s,
                simulated_s=self.clock.now(),
                wall_s=wall_s,
            )
        )

    async def publish(self, *, norm: float | None = None) -> None:
        """Encode the current weights once (with what each plug-in sends beside them) and publish the snapshot,
        which keeps ``norm`` (``||weights||_2`` when the caller measured it).

        The lossless download's size is known without encoding it (its payload would only be measured), and a
        download stream is drawn only for a codec that draws random numbers.
        """
        start = self.wall()
        current = self.weights
        exact = (current.detach() if current.requires_grad else current).clone()
        codec = self.download_codec
        # One download is encoded (and, if lossy, decoded) per version, not per client.
        size = codec.payload_nbytes(exact.numel()) if exact.dim() == 1 else None
        if size is not None:  # lossless: what clients decode is the weights themselves
            weights = exact
        else:
            generator = self._generator() if codec.draws_random else None
            payload = codec.encode(exact, generator=generator).payload
            weights = codec.decode(payload, expected_elements=exact.numel()).to(exact.device)
            size = len(payload)
        extra = None
        for plugin in self.plugins:  # what a plug-in sends with the model goes through the same codec
            sent = plugin.published(int(self.version), codec, self._generator(extra=True))
            size += sent.nbytes
            if sent.value is not None:
                extra = sent.value
        snapshot = ModelSnapshot(
            version=self.version, weights=weights, exact=exact, download_bytes=size, extra=extra, norm=norm
        )
        self.registry.publish(snapshot)
        self.policy.published(snapshot)
        await self.bus.publish(
            ModelPublished(
                version=self.version,
                simulated_s=self.clock.now(),
                download_bytes=snapshot.download_bytes,
                encode_s=self.wall() - start,
            )
        )

    def _generator(self, *, extra: bool = False) -> torch.Generator | None:
        if self.download_generator is None:
            return None
        # The model of version v draws from key v; a plug-in's extra sent with it from key -(v + 1).
        version = int(self.version)
        return self.download_generator(-(version + 1) if extra else version)

    async def evaluate(self) -> None:
        """Evaluate the published model (as clients download it); keep its figures in the stats and report them."""
        snapshot = self.registry.current
        assert snapshot is not None
        stats = self.accounting.stats
        start = self.wall()
        result = await self.evaluate_weights(snapshot.weights)
        if result is None:
            return
        stats.accuracy, stats.loss, stats.evaluated_version = result.accuracy, result.loss, int(snapshot.version)
        stats.eval_metrics = dict(result.metrics)
        wall_s = self.elapsed_s()
        version = int(snapshot.version)
        self.log.info(
            "server.eval",
            step=version,
            version=version,
            of=self.rules.max_versions,
            **({"accuracy": result.accuracy} if math.isfinite(result.accuracy) else {}),  # NaN: a regression's
            loss=result.loss,
            **result.metrics,
            updates=stats.updates_accepted,
            simulated_s=self.clock.now(),
            wall_s=wall_s,
            eta_s=eta_seconds(self.rules, version - self.first_version, version, wall_s),
        )
        await self.bus.publish(
            Evaluated(
                version=snapshot.version,
                accuracy=result.accuracy,
                loss=result.loss,
                simulated_s=self.clock.now(),
                wall_s=wall_s,
                eval_s=self.wall() - start,
                metrics=dict(result.metrics),
            )
        )
