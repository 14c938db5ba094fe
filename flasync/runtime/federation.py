"""The runtime: a federated run's lifecycle, from its config to its summary.

``await Federation(config).run()`` works inside any running event loop (a web service's, say): it creates no loop,
closes none, and never blocks the loop - data preparation, training, evaluation and every MLflow call run in
worker threads. Every task it starts belongs to its ``asyncio.TaskGroup``. The run's simulation is wired in
:mod:`flasync.runtime.simulation`, what it tells its tracker in :mod:`flasync.runtime.run_tracking` and
:mod:`flasync.runtime.artifacts`, its end in :mod:`flasync.runtime.closing`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import structlog
import torch

from flasync import tracking
from flasync.clients.remote.transport import RemoteTransport, transport_for
from flasync.config import RunConfig, validate
from flasync.core.bus import EventBus
from flasync.core.client_table import ClientTable
from flasync.core.clock import RunClock, VirtualClock, WallClock
from flasync.core.errors import ConfigError, RunInterrupted
from flasync.core.loops import run_loop
from flasync.data import ArrayData
from flasync.observe.summary import RunSummary, weights_sha256
from flasync.runtime import checkpoint
from flasync.runtime.artifacts import log_artifacts, log_stopped_profile
from flasync.runtime.build import AggregatorFactory, check_aggregator, check_objective, check_plugins
from flasync.runtime.closing import Status, end_run, off_loop
from flasync.runtime.prepare import ModelFactory, Prepared, RunInputs
from flasync.runtime.run_tracking import federation_tags, make_tracker, open_run, run_logger
from flasync.runtime.selection import Best, register_selected, run_models
from flasync.runtime.simulation import Simulation, start_executor
from flasync.server import Server
from flasync.tracking.registry import Registration
from flasync.training.executors.threads import TrainingExecutor
from flasync.training.local import LocalObjective
from flasync.training.plugins import ClientPlugin, ServerPlugin

__all__ = ["Federation", "RunSummary", "run", "weights_sha256"]


class Federation:
    """One federated run, awaitable from any event loop.

    Args:
        config: A :class:`RunConfig` or a mapping validated into one (``None``: the defaults).
        dataset: Training data instead of ``config.data``: an :class:`ArrayData` or any map-style torch
            ``Dataset`` of ``(x, y)`` pairs. It is partitioned over clients as ``config.partition`` says.
        test_dataset: Held-out data evaluated by the server (default: a stratified split of ``dataset`` by
            ``config.data.test_fraction``).
        model_factory: Builds the ``nn.Module`` to train instead of ``config.model``; called once for the initial
            weights (under the run's seed) and once per worker thread.
        tracker: Where params, metrics and artifacts go (default: MLflow per ``config.tracking``).
        client_attributes: Per-client attribute arrays of ``population.num_clients`` values each, e.g.
            ``{"region": [...]}``, for ``topology.assign = "attribute"``.
        clock: Overrides the clock ``config.clock`` names.
        wall: Monotonic real seconds (injected for tests).
        resume: Continue from a checkpoint (see :mod:`flasync.runtime.checkpoint`) instead of starting afresh; its
            ``run_id`` (if any) is the MLflow run to continue. ``config`` must be the checkpointed run's config
            (its ``stop`` section may differ).
        aggregator: Builds the server's aggregation rule instead of ``config.server``: called once with the flat
            global weights and ``config.server``, it returns a :class:`flasync.Aggregator`. ``config.server.kind``
            still picks when versions are made (``fedavg`` rounds, ``fedbuff``/``fedasync`` slots asking
            ``ready()``). Tagged ``aggregator.custom`` in tracking. Under ``[secure_aggregation]`` it gets each
            group's sum through ``add_partial`` only, and is refused unless it says ``partial_sums = True``.
        objective: The loss local training minimises instead of cross-entropy (a :class:`flasync.LocalObjective`).
            Tagged ``objective`` in tracking.
        plugins: Algorithm state of your own (:class:`flasync.ClientPlugin` and :class:`flasync.ServerPlugin`
            objects), called after the run's own plug-ins at every point of an update's path; each is a checkpoint
            component under its ``name``.
        tags: Tracking tags the new run gets besides its own (a sweep's ``mlflow.parentRunId``, say); a resumed
            run keeps the tags it has.

    Attributes:
        config: The run's configuration; :meth:`run` replaces it by the one resolved against the data (with
            ``partition.kind = "by_column"``, ``population.num_clients`` is the number of clients in the data).

    Raises:
        ConfigError: If ``config`` is not a valid configuration, or ``objective`` is not one (or is not
            vectorizable under ``executor.kind = "vectorized"``).
    """

    def __init__(
        self,
        config: RunConfig | Mapping[str, Any] | None = None,
        *,
        dataset: ArrayData | torch.utils.data.Dataset[Any] | None = None,
        test_dataset: ArrayData | torch.utils.data.Dataset[Any] | None = None,
        model_factory: ModelFactory | None = None,
        tracker: tracking.Tracker | None = None,
        client_attributes: Mapping[str, Sequence[Any] | np.ndarray] | None = None,
        clock: RunClock | None = None,
        wall: Callable[[], float] = time.perf_counter,
        resume: checkpoint.ResumePoint | None = None,
        aggregator: AggregatorFactory | None = None,
        objective: LocalObjective | None = None,
        plugins: Sequence[ClientPlugin | ServerPlugin] = (),
        tags: Mapping[str, str] | None = None,
    ) -> None:
        """Validate the configuration and create the clock and bus (nothing runs yet)."""
        if config is None:
            config = RunConfig()
        elif not isinstance(config, RunConfig):
            config = validate(config)
        if objective is not None:
            check_objective(config, objective)
        check_plugins(plugins)
        if aggregator is not None:
            check_aggregator(config, aggregator)
        if aggregator is not None and config.privacy.enabled:
            # The noise is added by flasync's buffered rule; a user's rule would publish unnoised sums.
            raise ConfigError(
                "privacy.enabled: differential privacy needs flasync's own aggregation rule, not a custom one"
            )
        self.config: RunConfig = config
        self._aggregator = aggregator
        self._objective = objective
        self._plugins = tuple(plugins)
        self._tags = dict(tags or {})
        self._dataset = dataset
        self._test_dataset = test_dataset
        self._model_factory = model_factory
        self._tracker = tracker
        self._client_attributes = dict(client_attributes or {})
        self.clock: RunClock = clock or (
            VirtualClock() if config.clock == "virtual" else WallClock(factor=config.wall_time_factor)
        )
        self.bus = EventBus(on_activity=self.clock.poke)
        self._wall = wall
        self.weights: torch.Tensor | None = None
        self.run_id: str | None = None
        self.summary: RunSummary | None = None
        """The summary of the last :meth:`run`: whole once it returned, partial after a stop or a cancellation."""
        self.profile: dict[str, Any] | None = None
        """The profile of the run's last segment once it finished or was stopped with ``diagnostics.profile`` on
        (logged as :func:`~flasync.runtime.run_profile.profile_artifact` names it)."""
        self.best: Best | None = None
        """The best version's weights and figure of the last :meth:`run` (``eval.select``; None: no selection)."""
        self.registration: Registration | None = None
        """What the last :meth:`run` registered in the MLflow Model Registry (``tracking.register``; None: nothing)."""
        self.client_table: ClientTable | None = None
        """The per-client table of the last :meth:`run` (``tracking.client_table``; None: off): its
        :meth:`~flasync.core.client_table.ClientTable.table` and
        :meth:`~flasync.core.client_table.ClientTable.histograms` are what the run logged."""
        self._resume = resume
        self._simulation: Simulation | None = None
        self._stop_requested = ""
        self.transport: RemoteTransport | None = transport_for(config) if config.remote.enabled else None
        """Where remote clients get tasks and send updates (``remote.enabled``; serve it with flasync.runtime.serve)."""

    def request_stop(self, reason: str = "interrupted") -> None:
        """Ask the run to stop soon, checkpoint and end as ``KILLED``; :meth:`run` then raises ``RunInterrupted``.

        Call it from the run's event loop (a signal handler installed with ``loop.add_signal_handler`` is). The
        server finishes the message at hand, clients are cancelled, every metric is flushed, a checkpoint is
        written (``checkpoint.on_interrupt``) and the tracking run ends ``KILLED``.
        """
        if not self._stop_requested:
            self._stop_requested = reason
        server = self.server
        if server is not None:
            server.request_stop(reason)

    @property
    def stop_requested(self) -> str:
        """What asked the run to stop (empty if nothing did)."""
        return self._stop_requested

    @property
    def server(self) -> Server | None:
        """The running server (for inspection, e.g. :meth:`Server.state_dict`), None outside :meth:`run`."""
        return self._simulation.server if self._simulation is not None else None

    def _prepare(self) -> Prepared:
        return RunInputs(
            self.config,
            dataset=self._dataset,
            test_dataset=self._test_dataset,
            model_factory=self._model_factory,
            client_attributes=self._client_attributes,
        ).prepare()

    # ---------------------------------------------------------------------------------------------------- run
    async def run(self) -> RunSummary:
        """Run the federation to its stop condition and return its summary.

        Raises:
            ConfigError: If the data, partition or model do not fit the configuration (no MLflow run is left).
            DataError: If the data set cannot be used.
        """
        cfg = self.config
        self.summary = None
        self.best = self.registration = self.client_table = None
        tracker = make_tracker(cfg, self._tracker)
        tracked = not isinstance(tracker, tracking.NullTracker)
        _phase("loading the data and building the model", cfg)
        try:
            # Its MLflow writer process starts up (a spawn: tens of ms) while the data loads.
            await asyncio.to_thread(tracker.prepare)
            prepared = await asyncio.to_thread(self._prepare)
            if self._resume is not None:  # before the MLflow run is reopened: a misfit leaves it as it was
                checkpoint.check_fits(
                    self._resume.state,
                    num_params=prepared.initial.numel(),
                    num_clients=prepared.config.population.num_clients,
                )
            if self._stop_requested:
                raise RunInterrupted(self._stop_requested)  # before any tracking run exists
        except BaseException:
            await off_loop(tracker.finish, "FAILED")  # no run exists yet: this only stops what prepare() started
            raise
        cfg = self.config = prepared.config  # as resolved against the data (by_column: the population's size)
        log, constant = run_logger(cfg, tracker)
        if cfg.executor.kind == "ray":
            _phase("starting Ray" if cfg.executor.ray.address is None else "joining the Ray cluster", cfg)
        try:
            # Before the MLflow run: an executor that cannot start (Ray) leaves no run behind.
            executor = await start_executor(cfg, prepared, log, self._objective, on_lost=self.request_stop)
        except BaseException:
            await off_loop(tracker.finish, "FAILED")
            raise
        executor.attach(self.clock)
        if tracked:
            _phase("starting the MLflow run", cfg)
        try:
            run_id, opening = await open_run(
                tracker,
                prepared,
                log,
                resume=self._resume,
                custom=self._dataset is not None,
                tags=federation_tags(
                    cfg, virtual_clock=self.clock.virtual, aggregator=self._aggregator, objective=self._objective
                )
                | self._tags,
                on_unopened=self.request_stop,
            )
        except BaseException:
            # Not the tracker: a start cut short by a cancellation may still be going on in its thread.
            await off_loop(executor.shutdown)
            raise
        self.run_id = run_id or None
        return await self._run_opened(prepared, executor, tracker, log, constant, opening)

    async def _run_opened(
        self,
        prepared: Prepared,
        executor: TrainingExecutor,
        tracker: tracking.Tracker,
        log: Any,
        constant: tracking.ConstantSeries | None,
        opening: Future[str] | None,
    ) -> RunSummary:
        """Run the simulation and log the artifacts of a run whose tracking run is open; end it with its status."""
        cfg = self.config
        tracked = not isinstance(tracker, tracking.NullTracker)
        simulation = self._simulation = Simulation(
            prepared,
            executor,
            tracker,
            log,
            clock=self.clock,
            bus=self.bus,
            wall=self._wall,
            transport=self.transport,
            resume=self._resume,
            aggregator=self._aggregator,
            objective=self._objective,
            plugins=self._plugins,
            run_id=self.run_id,
            opening=opening,
            stop_requested=lambda: self._stop_requested,
        )
        status: Status = "FAILED"
        failure = ""
        try:
            context = {"run_id": self.run_id} if self.run_id else {}
            with structlog.contextvars.bound_contextvars(**context):
                try:
                    summary = await simulation.run()
                finally:
                    self._keep(simulation)
                if tracked:
                    _phase("logging the artifacts", cfg)
                assert self.weights is not None
                await asyncio.to_thread(
                    log_artifacts,
                    tracker,
                    prepared,
                    summary,
                    log,
                    constant,
                    weights=self.weights,
                    profile=self.profile,
                    traces=simulation.diagnostics,
                    best=self.best,
                    clients=self.client_table,
                )
                if cfg.tracking.register is not None and cfg.tracking.log_model:
                    models = run_models(summary, self.weights, self.best, cfg.eval.select)
                    self.registration = await asyncio.to_thread(register_selected, tracker, cfg, models, log)
            status = "FINISHED"
        except (asyncio.CancelledError, KeyboardInterrupt, RunInterrupted) as stop:
            status = "KILLED"
            if isinstance(stop, RunInterrupted) and self.profile is not None:
                await asyncio.to_thread(log_stopped_profile, tracker, self.profile, log)  # what this segment did
            raise
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"  # remote clients are told why, with the run's end
            raise
        finally:
            self._simulation = None
            if self.transport is not None:
                self.transport.finish(status, failure if status == "FAILED" else "")
            trace_dir = simulation.diagnostics.trace_dir if simulation.diagnostics is not None else None
            if tracked:
                _phase("ending the MLflow run", cfg)  # a slow or silent store makes this the longest step
            await end_run(executor, tracker, status, log, opening=opening, constant=constant, trace_dir=trace_dir)
            self._count_lost(tracker)
        return self.summary or summary

    def _count_lost(self, tracker: tracking.Tracker) -> None:
        """Put the metric rows the ended tracking run lost in the summary (a stopped run's partial one too)."""
        lost = tracker.metric_rows_lost if isinstance(tracker, tracking.MlflowTracker) else 0
        if lost and self.summary is not None:
            self.summary = dataclasses.replace(self.summary, metric_rows_lost=lost)

    def _keep(self, simulation: Simulation) -> None:
        """Keep what the simulation made: its run id, summary (partial after a stop or a cancellation), final weights
        and profile."""
        self.run_id = simulation.run_id
        self.summary = simulation.summary
        self.best = simulation.selection.best if simulation.selection is not None else None
        self.client_table = simulation.clients
        if simulation.weights is not None:
            self.weights = simulation.weights
        if simulation.profile is not None:
            self.profile = simulation.profile


def _phase(name: str, config: RunConfig) -> None:
    """Say on the console what the run is doing now (an info line, unless the run logs less; never a metric)."""
    if config.tracking.log_level in ("debug", "info"):
        structlog.get_logger("flasync").info("run.phase", phase=name)


def run(config: RunConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> RunSummary:
    """Run a federation synchronously in a new event loop (uvloop when installed), for code without a loop.

    The federation is built inside the loop, and what exists before it is kept out of the run's garbage
    collections until it returns; its garbage is collected as it ends (:func:`flasync.core.loops.frozen_heap` with
    ``at_start=True``).

    Args:
        config: As for :class:`Federation`.
        **kwargs: Passed to :class:`Federation`.
    """

    async def build_and_run() -> RunSummary:
        return await Federation(config, **kwargs).run()

    return run_loop(build_and_run(), builds_inside=True)
