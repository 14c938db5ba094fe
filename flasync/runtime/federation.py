"""The runtime: wires data, model, clock, bus, executor, server and tracking into one run.

``await Federation(config).run()`` works inside any running event loop (a web service's, say): it creates no loop,
closes none, and never blocks the loop - data preparation, training, evaluation and every MLflow call run in
worker threads. Every task it starts belongs to its ``asyncio.TaskGroup``.
"""

from __future__ import annotations

import asyncio
import functools
import io
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import replace
from types import MappingProxyType
from typing import Any, Literal, TypeVar

import numpy as np
import structlog
import torch

from flasync import codecs, tracking
from flasync.clients.remote.transport import RemoteTransport, transport_for
from flasync.config import (
    RunConfig,
    flatten,
    validate,
)
from flasync.core.bus import EventBus
from flasync.core.clock import RunClock, VirtualClock, WallClock
from flasync.core.errors import ConfigError, RunInterrupted
from flasync.core.loops import run_loop
from flasync.core.scratch import make_scratch, sweep_scratch
from flasync.data import (
    ArrayData,
)
from flasync.observe.plots import render_plots
from flasync.observe.profiling import (
    Instrumentation,
    Profiler,
    build_profile,
    gpu_status,
    headline,
    peak_rss_bytes,
    torch_memory,
)
from flasync.observe.summary import RunSummary, json_ready, weights_sha256
from flasync.runtime import checkpoint, tracked
from flasync.runtime.build import (
    AggregatorFactory,
    build_server,
    build_world,
    check_objective,
    check_plugins,
    make_evaluator,
)
from flasync.runtime.naming import dataset_record, default_run_name, rule_name, run_mode, run_tags, topology_name
from flasync.runtime.prepare import ModelFactory, Prepared, RunInputs
from flasync.runtime.sizing import make_executor
from flasync.server import Server, ServerStats
from flasync.training.diagnostics import AlertMonitor, LayerLayout, TrainingDiagnostics, layer_layout
from flasync.training.executors.threads import TrainingExecutor
from flasync.training.local import LocalObjective, objective_name
from flasync.training.plugins import ClientPlugin, ServerPlugin
from flasync.training.residuals import RESIDUALS_PREFIX

__all__ = ["Federation", "RunSummary", "run", "weights_sha256"]

_METRIC_EXCLUDE = frozenset(tracking.DEFAULT_EXCLUDE | {"version", "of", "eta_s"})  # progress, not measurements
# Per-update figures logged only with ``tracking.metrics = "all"``; their per-version sums are in ``profile/version/*``
# and profile.json either way. Each MLflow metric row costs the store's writer process some microseconds of CPU,
# taken from the cores that train.
# Per-update figures that often stay the same all run long (a dense codec's bytes, equal partitions' samples and
# training memory, synchronous rounds' staleness): held back while constant and then recorded once, as the tag
# ``constant/<key>``, rather than as thousands of identical rows (see tracking.ConstantSeries).
_CONSTANT_KEYS = frozenset(
    {
        "client/upload_bytes",
        "client/download_bytes",
        "client/samples",
        "client/peak_mem_bytes",
        "client/sim_download_s",
        "client/compression",
        "server/update/staleness",
        "server/update/staleness_weight",
    }
)
# Fields of a profile row that are no metric series of their own: a constant 1, and the figures the server's
# ``server.version`` line already logs at the same steps (``server/version/updates``, ...). profile.json keeps them.
_PROFILE_ROW_NOT_LOGGED = frozenset({"versions", "updates", "aggregate_s", "simulated_s", "staleness_mean"})
_DETAIL_KEYS = frozenset(  # MLflow keys (see tracking.metric_key)
    {
        "client/sim_train_s",
        "client/sim_download_s",
        "client/encode_s",
        "client/compression",
        "client/residual_norm",
        "server/update/staleness_weight",
        "server/update/decode_s",
        "server/update/norm",
        # Two timings of every update: their per-version sums (profile/version/compute_s, .../queue_wait_s) and
        # their distributions (profile.json) are kept; the 2 x 2,000 rows of a short run's 100 x 20 updates took the
        # writer process's CPU beside training (a vectorized cohort's train_s is each member's share of one time).
        "client/train_s",
        "server/update/queue_wait_s",
    }
)


_T = TypeVar("_T")
_NO_TAGS: Mapping[str, str] = MappingProxyType({})


_TRACES = "flasync-traces-"
_RESIDUALS = "flasync-residuals-"


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
            ``ready()``). Tagged ``aggregator.custom`` in tracking.
        objective: The loss local training minimises instead of cross-entropy (a :class:`flasync.LocalObjective`).
            Tagged ``objective`` in tracking.
        plugins: Algorithm state of your own (:class:`flasync.ClientPlugin` and :class:`flasync.ServerPlugin`
            objects), called after the run's own plug-ins at every point of an update's path; each is a checkpoint
            component under its ``name``.

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
    ) -> None:
        """Validate the configuration and create the clock and bus (nothing runs yet)."""
        if config is None:
            config = RunConfig()
        elif not isinstance(config, RunConfig):
            config = validate(config)
        if objective is not None:
            check_objective(config, objective)
        check_plugins(plugins)
        if aggregator is not None and config.privacy.enabled:
            # The noise is added by flasync's buffered rule; a user's rule would publish unnoised sums.
            raise ConfigError(
                "privacy.enabled: differential privacy needs flasync's own aggregation rule, not a custom one"
            )
        self.config: RunConfig = config
        self._aggregator = aggregator
        self._objective = objective
        self._plugins = tuple(plugins)
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
        """The run's profile (``profile.json``) once it finished with ``diagnostics.profile`` on."""
        self._scratch: str | None = None
        self._traces: TrainingDiagnostics | None = None
        self._resume = resume
        self._server: Server | None = None
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
        if self._server is not None:
            self._server.request_stop(reason)

    @property
    def stop_requested(self) -> str:
        """What asked the run to stop (empty if nothing did)."""
        return self._stop_requested

    @property
    def server(self) -> Server | None:
        """The running server (for inspection, e.g. :meth:`Server.state_dict`), None outside :meth:`run`."""
        return self._server

    def _prepare(self) -> Prepared:
        return RunInputs(
            self.config,
            dataset=self._dataset,
            test_dataset=self._test_dataset,
            model_factory=self._model_factory,
            client_attributes=self._client_attributes,
        ).prepare()

    def _make_tracker(self) -> tracking.Tracker:
        if self._tracker is not None:
            return self._tracker
        cfg = self.config.tracking
        if not cfg.enabled:
            return tracking.NullTracker()
        return tracked.mlflow_tracker(self.config)

    def _log_inputs(self, tracker: tracking.Tracker, prepared: Prepared, custom: bool, log: Any) -> None:
        """Record the training data as the run's MLflow dataset input, log ``config.yaml`` and have the model
        exported ahead (a tracking failure is only logged)."""
        record = dataset_record(self.config, prepared, custom=custom)
        try:
            tracker.log_dataset(record.name, record.digest, record.source, record.profile)
        except Exception as exc:  # a tracking failure must not fail the run
            log.warning("tracking.dataset_failed", error=f"{type(exc).__name__}: {exc}", metrics=False)
        self._log_config(tracker, log)
        self._prepare_model(tracker, prepared, log)

    def _prepare_model(self, tracker: tracking.Tracker, prepared: Prepared, log: Any) -> None:
        """Have the writer process export the model's structure while the run trains, so that logging the trained
        model at the end only swaps its weights in (see :meth:`tracking.MlflowTracker.prepare_model_from`)."""
        if not (self.config.tracking.log_model and isinstance(tracker, tracking.MlflowTracker)):
            return
        if prepared.model_spec is None:
            return
        name, kwargs = prepared.model_spec
        try:
            tracker.prepare_model_from(
                tracked.MODEL_BUILDER, {"model": name, "weights": None, **kwargs}, input_example=_example(prepared)
            )
        except Exception as exc:  # only a shortcut: the model's export at the end reports what fails
            log.debug("tracking.prepare_model_failed", error=f"{type(exc).__name__}: {exc}", metrics=False)

    def _log_config(self, tracker: tracking.Tracker, log: Any) -> None:
        """Log the run's configuration as ``config.yaml`` (secrets redacted), once its MLflow run is open: it is in
        the store while the run trains, and the store's first artifact (for MLflow, resolving where the run's
        artifacts go) is written then rather than at the end."""
        text = tracking.yaml_text(_redacted(self.config).model_dump(mode="json"))
        try:
            tracker.log_bytes(text.encode(), "config.yaml")
        except Exception as exc:  # a tracking failure must not fail the run
            log.warning("tracking.config_failed", error=f"{type(exc).__name__}: {exc}", metrics=False)

    def _tags(self) -> dict[str, str]:
        tags = run_tags(self.config, virtual_clock=self.clock.virtual)
        if self._aggregator is not None:
            tags["aggregator.custom"] = rule_name(self._aggregator)
        if self._objective is not None:
            tags["objective"] = objective_name(self._objective)
        return tags

    # ---------------------------------------------------------------------------------------------------- run
    async def run(self) -> RunSummary:
        """Run the federation to its stop condition and return its summary.

        Raises:
            ConfigError: If the data, partition or model do not fit the configuration (no MLflow run is left).
            DataError: If the data set cannot be used.
        """
        cfg = self.config
        self.summary = None
        tracker = self._make_tracker()
        tracked = not isinstance(tracker, tracking.NullTracker)
        _phase("loading the data and building the model", cfg)
        try:
            # Its MLflow writer process starts up (a spawn: tens of ms) while the data loads.
            await asyncio.to_thread(tracker.prepare)
            prepared = await asyncio.to_thread(self._prepare)
            if self._stop_requested:
                raise RunInterrupted(self._stop_requested)  # before any tracking run exists
        except BaseException:
            await _off_loop(tracker.finish, "FAILED")  # no run exists yet: this only stops what prepare() started
            raise
        cfg = self.config = prepared.config  # as resolved against the data (by_column: the population's size)
        metrics: tracking.MetricsProcessor | None = None
        constant: tracking.ConstantSeries | None = None
        if tracked:
            drop = _DETAIL_KEYS if cfg.tracking.metrics == "standard" else ()
            constant = tracking.ConstantSeries(tracker.log_metrics, _CONSTANT_KEYS)
            metrics = tracking.MetricsProcessor(constant, exclude=_METRIC_EXCLUDE, drop_keys=drop)
        # Metrics are taken at each log call; events below the log level skip structlog's chain.
        log = tracking.make_logger(level=cfg.tracking.log_level, metrics=metrics)
        warned: set[str] = set()

        def on_fallback(reason: str) -> None:
            if reason not in warned:  # once per reason, not once per cohort
                warned.add(reason)
                log.warning("executor.fallback", reason=reason, metrics=False)

        def on_executor(what: str, detail: str) -> None:
            log.log(
                logging.WARNING if what == "replaced" else logging.INFO,
                f"executor.{what}",
                detail=detail,
                metrics=False,
            )

        if cfg.executor.kind == "ray":
            _phase("starting Ray" if cfg.executor.ray.address is None else "joining the Ray cluster", cfg)
        try:
            # Before the MLflow run: an executor that cannot start (Ray) leaves no run behind.
            executor = await asyncio.to_thread(
                make_executor, cfg, prepared, on_fallback=on_fallback, on_event=on_executor, objective=self._objective
            )
        except BaseException:
            await _off_loop(tracker.finish, "FAILED")
            raise
        executor.attach(self.clock)
        if tracked:
            _phase("starting the MLflow run", cfg)
        opening: Future[str] | None = None
        try:
            if self._resume is not None and self._resume.run_id:
                run_id = await asyncio.to_thread(tracker.resume, self._resume.run_id)
                await asyncio.to_thread(self._log_config, tracker, log)  # a resumed run's stop.* may differ
                await asyncio.to_thread(self._prepare_model, tracker, prepared, log)
            else:
                custom = self._dataset is not None
                start = functools.partial(
                    tracker.start,
                    experiment=cfg.tracking.experiment,
                    run_name=cfg.tracking.run_name or default_run_name(cfg, uuid.uuid4().hex[:6], custom=custom),
                    params={**flatten(_redacted(cfg)), **(prepared.privacy.params() if prepared.privacy else {})},
                    tags=self._tags(),
                )
                if isinstance(tracker, tracking.MlflowTracker):
                    # Training does not wait for the writer process to import MLflow and create the run (seconds
                    # when the caller imported torch already): metrics queue until the run exists.
                    run_id = await asyncio.to_thread(functools.partial(start, wait=False))
                    opening = self._open_in_background(tracker, prepared, custom, log)
                else:
                    run_id = await asyncio.to_thread(start)
                    if tracked:
                        await asyncio.to_thread(self._log_inputs, tracker, prepared, custom, log)
        except BaseException:
            # Not the tracker: a start cut short by a cancellation may still be going on in its thread.
            await _off_loop(executor.shutdown)
            raise
        self.run_id = run_id or None
        status: Literal["FINISHED", "FAILED", "KILLED"] = "FAILED"
        try:
            context = {"run_id": self.run_id} if self.run_id else {}
            with structlog.contextvars.bound_contextvars(**context):
                summary = await self._simulate(prepared, executor, log, tracker, opening)
                if tracked:
                    _phase("logging the artifacts", cfg)
                await asyncio.to_thread(self._log_artifacts, tracker, prepared, summary, log, constant)
            status = "FINISHED"
            return summary
        except (asyncio.CancelledError, KeyboardInterrupt, RunInterrupted):
            status = "KILLED"
            raise
        finally:
            if self.transport is not None:
                self.transport.finish(status)
            trace_dir = self._traces.trace_dir if self._traces is not None else None
            if tracked:
                _phase("ending the MLflow run", cfg)  # a slow or silent store makes this the longest step
            if opening is not None:
                await _off_loop(futures_wait, [opening])  # the dataset input is recorded before the run ends
            if constant is not None and (opening is None or opening.exception() is None):
                # A run that logged its artifacts tagged them already (this finds none left): a failed one has not.
                await _off_loop(_tag_constants, tracker, constant, log)
            # Off the loop, and completed even while the task is being cancelled (see _off_loop).
            await _off_loop(_close, executor, tracker, status, trace_dir)

    def _open_in_background(
        self, tracker: tracking.MlflowTracker, prepared: Prepared, custom: bool, log: Any
    ) -> Future[str]:
        """Wait on a thread for the run ``tracker.start(wait=False)`` opens, then record the dataset input and the
        config; return the future of the run id. A run that cannot be opened (a deleted experiment) stops the
        federation."""
        loop = asyncio.get_running_loop()
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flasync-open-run")

        def open_run() -> str:
            run_id = tracker.opened()
            if run_id:
                log.info("run.opened", run_id=run_id, experiment=self.config.tracking.experiment, metrics=False)
            self._log_inputs(tracker, prepared, custom, log)
            return run_id

        def stop_if_failed(future: Future[str]) -> None:
            error = future.exception()
            if error is not None:
                loop.call_soon_threadsafe(self.request_stop, f"the MLflow run could not be opened: {error}")

        opening = pool.submit(open_run)
        pool.shutdown(wait=False)
        opening.add_done_callback(stop_if_failed)
        return opening

    async def _simulate(
        self,
        prepared: Prepared,
        executor: TrainingExecutor,
        log: Any,
        tracker: tracking.Tracker,
        opening: Future[str] | None = None,
    ) -> RunSummary:
        cfg = self.config
        dcfg = cfg.diagnostics
        # Temporary files of runs that were killed (SIGKILL, OOM) before they could remove them.
        swept = sweep_scratch(_TRACES) + sweep_scratch(_RESIDUALS)
        for spill_dir in {cfg.codec.residual_dir, cfg.scaffold.spill_dir} - {None}:
            swept += sweep_scratch(RESIDUALS_PREFIX, spill_dir)
        if swept:
            log.info("scratch.swept", folders=len(swept), message=f"removed {len(swept)} folder(s) of killed runs")
        layout: LayerLayout | None = None
        if dcfg.profile or dcfg.level == "full":
            layout = await asyncio.to_thread(lambda: layer_layout(prepared.factory()))
        diagnostics = TrainingDiagnostics(
            dcfg.level,
            layout,
            profile_tasks=dcfg.torch_profiler_tasks,
            trace_dir=str(make_scratch(_TRACES)) if dcfg.torch_profiler_tasks else None,
        )
        self._traces = diagnostics
        world = build_world(
            cfg,
            prepared,
            executor,
            bus=self.bus,
            clock=self.clock,
            log=log,
            wall=self._wall,
            diagnostics=diagnostics,
            scratch=self._scratch_dir,
            objective=self._objective,
            plugins=[plugin for plugin in self._plugins if isinstance(plugin, ClientPlugin)],
        )
        plugins = world.plugins
        device = prepared.device
        weights = prepared.initial.to(device, copy=True)
        parts = build_server(
            cfg,
            weights,
            bus=self.bus,
            clock=self.clock,
            wall=self._wall,
            log=log,
            population=world.population,
            world=world,
            tree=prepared.tree,
            evaluate=make_evaluator(prepared, executor, self.clock, batch_size=cfg.eval.batch_size),
            privacy=prepared.privacy,
            aggregator_factory=self._aggregator,
            start_task=self.transport.start_task if self.transport is not None else None,
            availability=self.transport,
            plugins=[plugin for plugin in self._plugins if isinstance(plugin, ServerPlugin)],
        )
        server = parts.server
        if self.transport is not None:
            self.transport.attach(
                bus=self.bus,
                registry=server.registry,
                clock=self.clock,
                log=log,
                num_params=prepared.initial.numel(),
                feature_shape=tuple(prepared.train.feature_shape),
                num_classes=prepared.train.num_classes,
            )
        if not self.clock.virtual and self._resume is None:
            self.clock.restore({"now": 0.0})  # wall time counts from the federation's start, not from its set-up
        start_sim = self.clock.now()  # a resumed run reports simulated time from the start of the run
        if self._resume is not None:
            server.load_state_dict(self._resume.state)  # the clock's reading too
        updates_before = server.stats.updates_accepted  # a resumed run's rate counts its own updates only
        resumed_from = self._resume.artifact if self._resume is not None else None
        writes = _CheckpointWriter(tracker, cfg, log, self._wall, resumed_from=resumed_from)
        server.on_checkpoint = writes.submit
        self._server = server
        if self._stop_requested:
            server.request_stop(self._stop_requested)
        instrumentation = self._instrumentation(server, layout, log, tracker)
        residual_memory: dict[str, int] = {}
        start_wall = self._wall()
        log.info(
            "run.started",
            **({"run_id": self.run_id} if self.run_id else {}),
            clients=cfg.population.num_clients,
            aggregator=cfg.server.kind,
            clock=cfg.clock,
            params=prepared.initial.numel(),
            metrics=False,
        )
        cancelled: asyncio.CancelledError | None = None
        try:
            stats = await self._drive(server)
        except asyncio.CancelledError as cancel:
            cancelled, stats = cancel, server.stats  # held until the clean-up below and the partial summary are done
        finally:
            self._server = None
            if instrumentation is not None and instrumentation.first_alerts:
                await _off_loop(_tag_alerts, tracker, instrumentation.first_alerts, log)
            if server.interrupted_state is not None and cfg.checkpoint.on_interrupt:
                writes.submit(server.interrupted_state)
            await _off_loop(writes.close)
            if plugins:
                # Jobs of cancelled clients may still be running and about to store their state: let them finish.
                await _off_loop(executor.shutdown)
            residual_memory = await _off_loop(self._close_stores, plugins, log)
        wall_s = self._wall() - start_wall
        if opening is not None and cancelled is None:
            self.run_id = await asyncio.wrap_future(opening) or None  # a run that could not be opened raises here
        simulated_s = self.clock.now() - start_sim
        self.weights = weights.cpu()  # artifacts and callers get host tensors, whatever the training device
        summary = await _off_loop(
            functools.partial(
                RunSummary.from_stats,
                stats,
                run_id=self.run_id,
                wall_s=wall_s,
                simulated_s=simulated_s,
                num_params=prepared.initial.numel(),
                weights=self.weights,
                updates_before=updates_before,
                topology=topology_name(self.config),
                tiers=parts.edges.summary() if parts.edges is not None else {},
                peak_rss_bytes=peak_rss_bytes(),
                **(
                    {"privacy_epsilon": prepared.privacy.accountant.epsilon(stats.versions)}
                    if prepared.privacy is not None
                    else {}
                ),
            )
        )
        self.summary = summary
        if cancelled is not None:
            raise cancelled
        if server.stop_requested:
            log.warning(
                "run.interrupted",
                reason=server.stop_requested,
                step=stats.versions,
                versions=stats.versions,
                updates_accepted=stats.updates_accepted,
                checkpoint=writes.last_saved,
                metrics=False,
            )
            raise RunInterrupted(
                server.stop_requested, run_id=self.run_id, checkpoint=writes.last_saved, summary=summary.to_dict()
            )
        if summary.tiers:
            log.debug("run.tiers", step=stats.versions, **summary.tiers)
        if instrumentation is not None:
            # In a thread: summarising a long run's records must not stall the caller's event loop.
            summary = await asyncio.to_thread(
                self._finish_profile, summary, instrumentation, server, executor, layout, residual_memory, log
            )
            self.summary = summary
        # After the profile, which counts the alerts and the peak memory into the summary.
        figures = {
            key: value
            for key, value in summary.to_dict().items()
            if isinstance(value, int | float) and not isinstance(value, bool)
        }
        bus = self.bus.statistics()
        # Debug on the console (the command prints the summary once); metrics either way.
        extra = {"bus_dropped": bus.dropped, "bus_high_water": bus.high_water}
        log.debug("run.finished", step=stats.versions, **figures, **extra)
        return summary

    def _close_stores(self, plugins: Sequence[ClientPlugin], log: Any) -> dict[str, int]:
        """Close the clients' plug-ins (their spilled state), remove the scratch folder; return the memory figures."""
        memory: dict[str, int] = {}
        for plugin in plugins:
            memory.update(plugin.close(log))
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        return memory

    def _scratch_dir(self) -> str:
        """Create the run's scratch folder (removed at the end of the run) and return its path."""
        if self._scratch is None:
            self._scratch = str(make_scratch(_RESIDUALS))
        return self._scratch

    def _instrumentation(
        self, server: Server, layout: LayerLayout | None, log: Any, tracker: tracking.Tracker
    ) -> Instrumentation | None:
        """Build the profiler and alert monitor the diagnostics config asks for (None: neither)."""
        dcfg = self.config.diagnostics
        if not dcfg.profile and dcfg.level == "off":
            return None
        return Instrumentation(
            self.bus,
            profiler=Profiler(run_mode(self.config)) if dcfg.profile else None,
            monitor=AlertMonitor(
                dcfg,
                layer_names=layout.names if layout is not None else (),
                weights=lambda: (int(server.version), server.weights),
                initial=server.weights.clone() if dcfg.level != "off" else None,
                step_cause=(
                    "the privacy noise: a smaller privacy.noise_multiplier or more clients per version?"
                    if self.config.privacy.enabled
                    else "server.optimizer.lr?"
                ),
            ),
            log=log,
            now=self.clock.now,
        )

    async def _drive(self, server: Server) -> ServerStats:
        """Run the clock and the server in one task group; close the bus at the end."""
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.clock.drive(), name="flasync-clock")
                try:
                    stats = await server.run()
                finally:
                    self.clock.stop()
                    self.bus.close()
        except BaseExceptionGroup as group:
            raise _root_cause(group) from None
        return stats

    def _finish_profile(
        self,
        summary: RunSummary,
        instrumentation: Instrumentation,
        server: Server,
        executor: TrainingExecutor,
        layout: LayerLayout | None,
        residual_memory: Mapping[str, int],
        log: Any,
    ) -> RunSummary:
        """Build the profile from the instrumentation's records, log its headline metrics, extend the summary."""
        cfg = self.config
        monitor = instrumentation.monitor
        alerts = dict(monitor.counts) if monitor is not None else {}
        rss = peak_rss_bytes()
        summary = replace(summary, peak_rss_bytes=rss, alerts=sum(alerts.values()))
        if instrumentation.profiler is None:
            return summary
        num_params = self.weights.numel() if self.weights is not None else 0
        trainable = layout.num_trainable if layout is not None else num_params
        aggregator = server.aggregator.nbytes
        memory: dict[str, Any] = {
            "peak_rss_bytes": rss,
            "model_bytes": 4 * num_params,
            "gradient_bytes": 4 * trainable,
            "optimizer_bytes": 4 * trainable,
            "worker_models": executor.models.built,
            "aggregator_bytes": aggregator,
            **residual_memory,
            **torch_memory(),
            "gpus": gpu_status(),
        }
        profile = build_profile(
            instrumentation.profiler.finish(),
            mode=run_mode(cfg),
            num_params=num_params,
            dense_bytes=codecs.HEADER.size + 4 * num_params,
            stragglers=cfg.diagnostics.stragglers,
            memory=memory,
            diagnostics=monitor.summary() if monitor is not None else None,
        )
        profile["alerts"] = alerts
        if summary.tiers:
            profile["communication"]["edge_tiers"] = dict(summary.tiers)
        profile["layers"] = list(layout.names) if layout is not None else []
        if layout is not None and self.weights is not None and layout.num_trainable <= self.weights.numel():
            parts = torch.split(self.weights[: layout.num_trainable], list(layout.lengths))
            profile["diagnostics"]["layer_weight_norms"] = {
                name: float(torch.linalg.vector_norm(part)) for name, part in zip(layout.names, parts, strict=True)
            }
        self.profile = profile
        # Single figures at the run's end: profile.json and `flasync report` hold them, not one-point metric series.
        log.debug("profile", step=summary.versions, **headline(profile), metrics=False)
        for row in profile["time"]["per_version"]:
            fields = {k: v for k, v in row.items() if k not in _PROFILE_ROW_NOT_LOGGED}
            log.debug("profile.version", step=int(row["version"]), **fields)
        return replace(
            summary,
            stragglers=tuple(int(row["client_id"]) for row in profile["clients"]["stragglers"]),
            server_idle_fraction=float(profile["time"]["server_idle_fraction"]),
        )

    def _log_artifacts(
        self,
        tracker: tracking.Tracker,
        prepared: Prepared,
        summary: RunSummary,
        log: Any,
        constant: tracking.ConstantSeries | None = None,
    ) -> None:
        """Log the run's artifacts (the summary, the profile and its plots, the weights, the model) and, with
        ``constant``, its constant metrics as tags; the model is exported while the rest is logged."""
        if isinstance(tracker, tracking.NullTracker):
            return
        mlflow_tracker = tracker if isinstance(tracker, tracking.MlflowTracker) else None
        assert self.weights is not None
        example = _example(prepared)
        built = self.config.tracking.log_model and mlflow_tracker is not None and prepared.model_spec is not None
        settle_model: Callable[[], float] | None = None
        if built:
            assert mlflow_tracker is not None and prepared.model_spec is not None
            # The writer process logs the model on a thread of its own (its helper exports it, on Linux) while this
            # process logs the other artifacts.
            try:
                settle_model = self._start_model_from_spec(mlflow_tracker, prepared.model_spec, example)
            except Exception as exc:  # a model MLflow cannot serialise must not fail the run
                log.warning("tracking.log_model_failed", error=f"{type(exc).__name__}: {exc}", metrics=False)
        if mlflow_tracker is not None:
            # The metrics still queued are written while this process serialises the artifacts, not after them.
            mlflow_tracker.send_soon()
        files = {"summary.json": tracking.artifact_bytes(summary.to_dict(), "summary.json")}
        if self.profile is not None:
            files["profile.json"] = tracking.artifact_bytes(json_ready(self.profile), "profile.json")
            if self.config.diagnostics.plots:
                files.update(self._plots(log))
        module = prepared.factory()
        offset = 0
        with torch.no_grad():
            for tensor in [*module.parameters(), *(b for b in module.buffers() if b.is_floating_point())]:
                n = tensor.numel()
                tensor.copy_(self.weights[offset : offset + n].view_as(tensor))
                offset += n
        buffer = io.BytesIO()
        torch.save({"flat": self.weights, "state_dict": module.state_dict()}, buffer)
        files["weights.pt"] = buffer.getvalue()
        if mlflow_tracker is not None:
            mlflow_tracker.log_artifacts(files)  # one job of the writer process, not one per file
        else:
            for artifact_file, data in files.items():
                tracker.log_bytes(data, artifact_file)
        if self._traces is not None:
            for path in self._traces.traces:
                tracker.log_file(path, "torch_profiler")
        tags = {}
        if summary.alerts and self.profile is not None:
            tags["alerts"] = ", ".join(f"{k}={v}" for k, v in sorted(self.profile["alerts"].items()))
        _tag_constants(tracker, constant, log, tags)  # done here, the end of the run's call to it finds nothing left
        if settle_model is not None:
            # The metrics still queued (the profile's rows among them) are written while the model is exported, not
            # after it, when the run's end would wait for them.
            tracker.flush()
        if not self.config.tracking.log_model or mlflow_tracker is None or (built and settle_model is None):
            return
        try:
            if settle_model is not None:
                seconds = settle_model()
            else:
                seconds = mlflow_tracker.log_model(module, input_example=example)
            log.debug("tracking.log_model", seconds=seconds, metrics=False)
        except Exception as exc:  # a model MLflow cannot serialise must not fail the run
            log.warning("tracking.log_model_failed", error=f"{type(exc).__name__}: {exc}", metrics=False)

    def _plots(self, log: Any) -> dict[str, bytes]:
        """Draw the profile's charts (SVG, about a millisecond each: see :mod:`flasync.tracking.charts`); return them
        by their
        artifact paths (under ``plots/``). A failure is only logged (no charts), it must not fail the run."""
        assert self.profile is not None
        began = time.perf_counter()
        try:
            plots = render_plots(self.profile)
        except Exception as exc:
            log.warning("tracking.plots_failed", error=f"{type(exc).__name__}: {exc}"[:300], metrics=False)
            return {}
        log.debug("tracking.plots", seconds=time.perf_counter() - began, metrics=False)
        return {f"plots/{name}": image for name, image in plots.items()}

    def _start_model_from_spec(
        self, tracker: tracking.MlflowTracker, spec: tuple[str, dict[str, Any]], example: np.ndarray
    ) -> Callable[[], float]:
        """Start logging the model :func:`flasync.training.models.build` rebuilds from ``spec`` and the final weights
        (in the
        writer process when there is one, see :meth:`tracking.MlflowTracker.start_model_from`); return what waits
        for it and returns the seconds."""
        assert self.weights is not None
        name, kwargs = spec
        folder = tempfile.mkdtemp(prefix="flasync-model-")
        try:
            weights = os.path.join(folder, "weights.npy")
            np.save(weights, self.weights.numpy(), allow_pickle=False)
            settle = tracker.start_model_from(
                tracked.MODEL_BUILDER, {"model": name, "weights": weights, **kwargs}, input_example=example
            )
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise

        def wait() -> float:
            try:
                return settle()
            finally:
                shutil.rmtree(folder, ignore_errors=True)  # the weights, once the model no longer needs them

        return wait


class _CheckpointWriter:
    """Write checkpoints on one background thread: the newest one, and only after the metrics it covers.

    A checkpoint taken while an earlier one still waits replaces it (the earlier one would be older than this one
    by the time it was written), so a slow store costs one write of lag, never a growing queue. Before a checkpoint
    is written the tracker's queued metrics are flushed: a checkpoint of version ``v`` reaches the store only after
    every metric logged up to ``v`` has, so a run resumed from it misses no step (and the resumed tracker drops the
    steps the store already holds, see :meth:`tracking.MlflowTracker.resume`). A flush that times out skips that
    checkpoint with a warning and the next one tries again; failures are logged, never raised.

    Checkpoints alternate between the two artifacts of :data:`checkpoint.CHECKPOINT_SLOTS` (a slot is reused only
    after a write to the other succeeded), so a process killed mid-upload still leaves the previous one whole; a
    resumed run starts with the slot it was not resumed from.
    """

    def __init__(
        self,
        tracker: tracking.Tracker,
        config: RunConfig,
        log: Any,
        wall: Callable[[], float] = time.perf_counter,
        *,
        resumed_from: str | None = None,
    ) -> None:
        self._wall = wall
        self._tracker = tracker
        self._config = config
        self._log = log
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._waiting: tuple[dict[str, Any], float] | None = None
        self._draining: Future[None] | None = None
        self.superseded = 0
        """Checkpoints replaced by a newer one before they were written."""
        self.last_saved: str | None = None
        """The artifact holding the newest checkpoint in the store."""
        self._slot = 1 if resumed_from == checkpoint.CHECKPOINT_SLOTS[0] else 0
        """Index in :data:`checkpoint.CHECKPOINT_SLOTS` of the slot the next checkpoint goes to."""

    def submit(self, state: dict[str, Any]) -> None:
        """Hand ``state`` over for writing (returns at once: the event loop must not wait)."""
        if isinstance(self._tracker, tracking.NullTracker):
            return
        with self._lock:
            if self._waiting is not None:
                self.superseded += 1
            self._waiting = (state, self._wall())
            if self._draining is None or self._draining.done():
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flasync-checkpoint")
                self._draining = self._pool.submit(self._drain)

    def _drain(self) -> None:
        while True:
            with self._lock:
                waiting, self._waiting = self._waiting, None
            if waiting is None:
                return
            self._write(*waiting)

    def _write(self, state: dict[str, Any], taken: float) -> None:
        start = self._wall()
        version = int(state["version"])
        try:
            if not self._tracker.flush():
                self._log.warning(
                    "checkpoint.skipped",
                    version=version,
                    reason="the metrics it covers are not all written yet",
                    metrics=False,
                )
                return
            data = checkpoint.encode(state, _redacted(self._config))
            # The other slot keeps the previous checkpoint whole while this one is written (and if this fails).
            slot = checkpoint.CHECKPOINT_SLOTS[self._slot]
            self._tracker.log_bytes(data, slot)
        except Exception as exc:  # a failing store must not take the run down
            self._log.warning("checkpoint.failed", version=version, error=f"{type(exc).__name__}: {exc}", metrics=False)
            return
        self.last_saved = slot
        self._slot = 1 - self._slot
        self._log.debug(
            "checkpoint",
            step=version,
            bytes=len(data),
            seconds=self._wall() - start,
            lag_s=self._wall() - taken,
            superseded=self.superseded,
            in_flight=len(state["registry"]["in_flight"]),
        )

    def close(self) -> None:
        """Wait until the newest checkpoint handed over was written."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


async def _off_loop(fn: Callable[..., _T], *args: Any) -> _T:
    """Run ``fn(*args)`` in a worker thread and wait for it, also while the awaiting task is being cancelled.

    Clean-up (an executor's shutdown, a tracker's finish over a slow network) must neither block the event loop
    nor be cut short by the cancellation that caused it: the first cancellation arriving meanwhile is held until
    ``fn`` returned, then re-raised. A second one stops the wait at once (``fn`` goes on in its thread, and the
    interpreter waits for it at exit), so a caller that insists is never held up by a hung store.
    """
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    held: asyncio.CancelledError | None = None
    while True:
        try:
            result = await asyncio.shield(work)
        except asyncio.CancelledError as cancel:
            if work.done() or held is not None:
                raise
            held = cancel
            continue
        except BaseException:
            if held is not None:
                raise held from None  # the cancellation wins over a failing clean-up
            raise
        if held is not None:
            raise held
        return result


def _close(
    executor: TrainingExecutor,
    tracker: tracking.Tracker,
    status: Literal["FINISHED", "FAILED", "KILLED"],
    trace_dir: str | None = None,
) -> None:
    """Shut the executor down, end the tracking run with ``status`` and remove the traces folder (blocking)."""
    try:
        executor.shutdown()
    finally:
        tracker.finish(status)
        if trace_dir is not None:
            shutil.rmtree(trace_dir, ignore_errors=True)


def _phase(name: str, config: RunConfig) -> None:
    """Say on the console what the run is doing now (an info line, unless the run logs less; never a metric)."""
    if config.tracking.log_level in ("debug", "info"):
        structlog.get_logger("flasync").info("run.phase", phase=name)


def _example(prepared: Prepared) -> np.ndarray:
    """Return the logged model's input example: the first two test inputs (its signature and ``pt2`` trace)."""
    example: np.ndarray = prepared.test.x[:2].detach().cpu().numpy()
    return example


def _redacted(config: RunConfig) -> RunConfig:
    """Return ``config`` with credentials in its tracking URI replaced (for params and artifacts)."""
    uri = config.tracking.uri
    if uri is None or tracking.redact_uri(uri) == uri:
        return config
    return config.model_copy(update={"tracking": config.tracking.model_copy(update={"uri": tracking.redact_uri(uri)})})


def _tag_constants(
    tracker: tracking.Tracker, constant: tracking.ConstantSeries | None, log: Any, also: Mapping[str, str] = _NO_TAGS
) -> None:
    """Tag the run with each held-back metric of ``constant`` whose value never changed (``constant/<key>``), and
    with ``also`` in the same call; a tracking failure is only logged."""
    found = constant.constants() if constant is not None else {}
    tags = {**also, **{f"constant/{key}": f"{value:.10g}" for key, value in sorted(found.items())}}
    if not tags:
        return
    try:
        tracker.set_tags(tags)
    except Exception as exc:  # a tracking failure must not fail the run
        log.warning("tracking.constants_failed", error=f"{type(exc).__name__}: {exc}", metrics=False)


def _tag_alerts(tracker: tracking.Tracker, first: Mapping[str, str], log: Any) -> None:
    """Tag the run with the first alert of each kind (``alert.<kind>``); a tracking failure is only logged."""
    try:
        tracker.set_tags({f"alert.{kind}": message for kind, message in first.items()})
    except Exception as exc:  # a tracking failure must not fail the run
        log.warning("alert.tag_failed", error=f"{type(exc).__name__}: {exc}", metrics=False)


def _root_cause(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """Return the first error of a (nested) exception group that is not a cancellation."""
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            return _root_cause(error)
        if not isinstance(error, asyncio.CancelledError):
            return error
    return group.exceptions[0]


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
