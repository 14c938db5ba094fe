"""A run's simulation: its clients' world and its server wired to the clock, bus, executor and tracker, driven to
the stop rule, cleaned up and summarised."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from flasync import tracking
from flasync.algorithms.client_eval import EvaluationSummary
from flasync.clients.remote.transport import RemoteTransport
from flasync.clients.simulated.client import ClientWorld
from flasync.config import RunConfig
from flasync.core.bus import EventBus
from flasync.core.client_table import ClientTable
from flasync.core.clock import RunClock
from flasync.core.errors import RunInterrupted
from flasync.core.scratch import make_scratch, sweep_scratch
from flasync.observe.profiling import Instrumentation, peak_rss_bytes
from flasync.observe.summary import RunSummary
from flasync.runtime.build import (
    AggregatorFactory,
    ServerParts,
    build_server,
    build_world,
    make_evaluator,
    make_example_weight,
    staleness_weight_of,
)
from flasync.runtime.checkpoint import CheckpointWriter, ResumePoint
from flasync.runtime.closing import off_loop
from flasync.runtime.naming import finished_tags, topology_name
from flasync.runtime.prepare import Prepared
from flasync.runtime.run_profile import finish_profile, instrumentation, segment, tracking_health
from flasync.runtime.run_tracking import tag_alerts
from flasync.runtime.secure import remote_groups
from flasync.runtime.selection import SELECTION, BestVersion, with_best
from flasync.runtime.sizing import make_executor
from flasync.server import Server, ServerStats
from flasync.training.diagnostics import LayerLayout, TrainingDiagnostics, layer_layout
from flasync.training.executors.ray_watch import CLUSTER_GONE
from flasync.training.executors.threads import TrainingExecutor
from flasync.training.local import LocalObjective
from flasync.training.plugins import ClientPlugin, ServerPlugin
from flasync.training.residuals import RESIDUALS_PREFIX

__all__ = ["Simulation", "root_cause", "start_executor"]

_TRACES = "flasync-traces-"
_RESIDUALS = "flasync-residuals-"


async def start_executor(
    config: RunConfig,
    prepared: Prepared,
    log: Any,
    objective: LocalObjective | None,
    on_lost: Callable[[str], None],
) -> TrainingExecutor:
    """Start the training executor ``config.executor`` names (in a worker thread); its fallbacks are logged as
    warnings (once per reason), its replacements as warnings and its other events as info lines.

    ``on_lost`` is called on the event loop with :data:`CLUSTER_GONE` when the executor's Ray cluster is gone (its
    ``lost`` event, logged as a warning naming what is gone).
    """
    warned: set[str] = set()
    loop = asyncio.get_running_loop()

    def on_fallback(reason: str) -> None:
        if reason not in warned:  # once per reason, not once per cohort
            warned.add(reason)
            log.warning("executor.fallback", reason=reason, metrics=False)

    def on_executor(what: str, detail: str) -> None:
        if what == "lost":
            log.warning("executor.lost", detail=f"{detail}; stopping the run", metrics=False)
            with contextlib.suppress(RuntimeError):  # the loop closed: the run is over already
                loop.call_soon_threadsafe(on_lost, CLUSTER_GONE)
            return
        log.log(
            logging.WARNING if what == "replaced" else logging.INFO,
            f"executor.{what}",
            detail=detail,
            metrics=False,
        )

    return await asyncio.to_thread(
        make_executor, config, prepared, on_fallback=on_fallback, on_event=on_executor, objective=objective
    )


class Simulation:
    """One run of a federation's clients and server, from building them to its summary.

    Args:
        prepared: The run's data, model and resolved config.
        executor: Where training jobs run (started, attached to ``clock``).
        tracker: Where checkpoints and alert tags go.
        log: The run's logger.
        clock: The run's clock.
        bus: The run's event bus.
        wall: Monotonic real seconds.
        transport: Where remote clients get tasks and send updates (None: no remote clients).
        resume: The checkpoint the run continues from (None: a new run).
        aggregator: Builds a user's aggregation rule (None: ``config.server``'s).
        objective: A user's loss for local training (None: cross-entropy).
        plugins: A user's own algorithm state, after the run's own.
        run_id: The tracking run's id ('' or None: none yet).
        opening: The future of the id of a tracking run opened in the background.
        stop_requested: Returns what asked the federation to stop (empty if nothing did).

    Attributes:
        server: The running server, None before it is built and once it stopped.
        diagnostics: The training diagnostics run in the workers (their torch profiler traces), once built.
        weights: The final global weights on the host, once the server stopped.
        summary: The run's summary: whole once :meth:`run` returned, partial after a stop or a cancellation.
        profile: The profile of this segment of the run (from its start or its resume), once it finished or was
            stopped with ``diagnostics.profile`` on (see :func:`~flasync.runtime.run_profile.profile_artifact`).
        run_id: The tracking run's id, that of the run opened in the background once it is known.
        selection: What keeps the best version's weights (``eval.select``; None: no selection); a part of the
            run's checkpoints.
        clients: The per-client table (``tracking.client_table``; None: off), once the server is built.
    """

    def __init__(
        self,
        prepared: Prepared,
        executor: TrainingExecutor,
        tracker: tracking.Tracker,
        log: Any,
        *,
        clock: RunClock,
        bus: EventBus,
        wall: Callable[[], float],
        transport: RemoteTransport | None,
        resume: ResumePoint | None,
        aggregator: AggregatorFactory | None,
        objective: LocalObjective | None,
        plugins: Sequence[ClientPlugin | ServerPlugin],
        run_id: str | None,
        opening: Future[str] | None,
        stop_requested: Callable[[], str],
    ) -> None:
        """Keep the run's parts (nothing is built yet)."""
        self._config = prepared.config
        self._prepared = prepared
        self._executor = executor
        self._tracker = tracker
        self._log = log
        self._clock = clock
        self._bus = bus
        self._wall = wall
        self._transport = transport
        self._resume = resume
        self._aggregator = aggregator
        self._objective = objective
        self._plugins = tuple(plugins)
        self._opening = opening
        self._stop_requested = stop_requested
        self._scratch: str | None = None
        self.server: Server | None = None
        self.diagnostics: TrainingDiagnostics | None = None
        self.weights: torch.Tensor | None = None
        self.summary: RunSummary | None = None
        self.profile: dict[str, Any] | None = None
        self.selection: BestVersion | None = None
        self.clients: ClientTable | None = None
        self.run_id = run_id
        self._first_version = 0

    async def run(self) -> RunSummary:
        """Build the clients' world and the server, run them to the stop rule, clean up and return the summary.

        Raises:
            RunInterrupted: If a stop was requested (after the partial summary and the last checkpoint).
        """
        cfg = self._config
        _sweep(cfg, self._log)
        layout: LayerLayout | None = None
        if cfg.diagnostics.profile or cfg.diagnostics.level == "full":
            layout = await asyncio.to_thread(lambda: layer_layout(self._prepared.factory()))
        world, parts, weights = self._build(layout)
        server = parts.server
        self.clients = server.accounting.clients
        if cfg.eval.select is not None:
            self.selection = BestVersion(cfg.eval.select, server.registry.base).attach(self._bus)
            server.components[SELECTION] = self.selection  # checkpointed: a resumed run keeps its best so far
        start_sim, updates_before, writes = self._restore(server)
        self.server = server
        if self._stop_requested():
            server.request_stop(self._stop_requested())
        instruments = instrumentation(cfg, self._bus, server, layout, self._log, self._clock.now)
        start_wall = self._wall()
        # The journal's id names the run until MLflow has (--resume takes it).
        journal = self._tracker.journal.id if isinstance(self._tracker, tracking.MlflowTracker) else None
        self._log.info(
            "run.started",
            **({"run_id": self.run_id} if self.run_id else {"run": journal} if journal else {}),
            clients=cfg.population.num_clients,
            aggregator=cfg.server.kind,
            params=self._prepared.initial.numel(),  # the clock is in the summary: the line keeps to 120 columns
            metrics=False,
        )
        stats, cancelled, residual_memory = await self._run_to_end(server, world, writes, instruments)
        wall_s = self._wall() - start_wall
        if self._opening is not None and cancelled is None:
            self.run_id = await asyncio.wrap_future(self._opening) or None  # a run that could not be opened raises here
        simulated_s = self._clock.now() - start_sim
        self.weights = weights.cpu()  # artifacts and callers get host tensors, whatever the training device
        summary = await self._summarise(stats, parts, self.weights, wall_s, simulated_s, updates_before)
        self.summary = summary = await off_loop(with_best, summary, self.selection)
        if cancelled is not None:
            raise cancelled
        return await self._finish(summary, stats, server, writes, instruments, layout, residual_memory)

    def _build(self, layout: LayerLayout | None) -> tuple[ClientWorld, ServerParts, torch.Tensor]:
        """Build the training diagnostics, the clients' world and the server (attached to the remote transport, if
        any); return them with the global weights on the training device."""
        cfg = self._config
        dcfg = cfg.diagnostics
        prepared = self._prepared
        diagnostics = TrainingDiagnostics(
            dcfg.level,
            layout,
            profile_tasks=dcfg.torch_profiler_tasks,
            trace_dir=str(make_scratch(_TRACES)) if dcfg.torch_profiler_tasks else None,
        )
        self.diagnostics = diagnostics
        world = build_world(
            cfg,
            prepared,
            self._executor,
            bus=self._bus,
            clock=self._clock,
            log=self._log,
            wall=self._wall,
            diagnostics=diagnostics,
            scratch=self._scratch_dir,
            objective=self._objective,
            plugins=[plugin for plugin in self._plugins if isinstance(plugin, ClientPlugin)],
        )
        device = prepared.device
        weights = prepared.initial.to(device, copy=True)
        parts = build_server(
            cfg,
            weights,
            bus=self._bus,
            clock=self._clock,
            wall=self._wall,
            log=self._log,
            population=world.population,
            world=world,
            tree=prepared.tree,
            evaluate=make_evaluator(prepared, self._executor, self._clock, batch_size=cfg.eval.batch_size),
            privacy=prepared.privacy,
            aggregator_factory=self._aggregator,
            start_task=self._transport.start_task if self._transport is not None else None,
            availability=self._transport,
            remote=self._transport.incarnations if self._transport is not None else None,
            plugins=[plugin for plugin in self._plugins if isinstance(plugin, ServerPlugin)],
            shapes=prepared.shapes,
        )
        if self._transport is not None:
            _attach(self._transport, cfg, world, parts, prepared, bus=self._bus, clock=self._clock, log=self._log)
        return world, parts, weights

    def _restore(self, server: Server) -> tuple[float, int, CheckpointWriter]:
        """Set the clock's start and load a resumed run's checkpoint into ``server``; start writing its checkpoints.

        Returns:
            The clock's reading at the start, the updates accepted before it, and the checkpoint writer.
        """
        if not self._clock.virtual and self._resume is None:
            self._clock.restore({"now": 0.0})  # wall time counts from the federation's start, not from its set-up
        start_sim = self._clock.now()  # a resumed run reports simulated time from the start of the run
        if self._resume is not None:
            server.load_state_dict(self._resume.state)  # the clock's reading too
        updates_before = server.stats.updates_accepted  # a resumed run's rate counts its own updates only
        self._first_version = int(server.version)  # where this segment of the run starts (0 unless resumed)
        resumed_from = self._resume.artifact if self._resume is not None else None
        writes = CheckpointWriter(self._tracker, self._config, self._log, self._wall, resumed_from=resumed_from)
        server.on_checkpoint = writes.submit
        return start_sim, updates_before, writes

    async def _run_to_end(
        self,
        server: Server,
        world: ClientWorld,
        writes: CheckpointWriter,
        instruments: Instrumentation | None,
    ) -> tuple[ServerStats, asyncio.CancelledError | None, dict[str, int]]:
        """Drive the server to the stop rule, then tag the first alerts, write the interrupted run's checkpoint and
        close the clients' plug-ins (their spilled state), also after a cancellation.

        Returns:
            The server's figures, the cancellation that ended the run (held until the partial summary is made;
            None if none did) and the plug-ins' memory figures.
        """
        plugins = world.plugins
        cancelled: asyncio.CancelledError | None = None
        try:
            stats = await self._drive(server)
        except asyncio.CancelledError as cancel:
            cancelled, stats = cancel, server.stats  # held until the clean-up below and the partial summary are done
        finally:
            self.server = None
            if instruments is not None and instruments.first_alerts:
                await off_loop(tag_alerts, self._tracker, instruments.first_alerts, self._log)
            if server.interrupted_state is not None and self._config.checkpoint.on_interrupt:
                writes.submit(server.interrupted_state)
            await off_loop(writes.close)
            if plugins:
                # Jobs of cancelled clients may still be running and about to store their state: let them finish.
                await off_loop(self._executor.shutdown)
            residual_memory = await off_loop(self._close_stores, plugins)
        return stats, cancelled, residual_memory

    async def _drive(self, server: Server) -> ServerStats:
        """Run the clock and the server in one task group; close the bus at the end."""
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._clock.drive(), name="flasync-clock")
                try:
                    stats = await server.run()
                finally:
                    self._clock.stop()
                    self._bus.close()
        except BaseExceptionGroup as group:
            raise root_cause(group) from None
        return stats

    async def _summarise(
        self,
        stats: ServerStats,
        parts: ServerParts,
        weights: torch.Tensor,
        wall_s: float,
        simulated_s: float,
        updates_before: int,
    ) -> RunSummary:
        """Return the run's summary from the server's figures (in a worker thread: it hashes the weights)."""
        prepared = self._prepared
        return await off_loop(
            functools.partial(
                RunSummary.from_stats,
                stats,
                run_id=self.run_id,
                wall_s=wall_s,
                simulated_s=simulated_s,
                num_params=prepared.initial.numel(),
                weights=weights,
                updates_before=updates_before,
                topology=topology_name(self._config),
                tiers=parts.edges.summary() if parts.edges is not None else {},
                peak_rss_bytes=peak_rss_bytes(),
                **_client_eval(parts),
                **(
                    {"privacy_epsilon": prepared.privacy.accountant.epsilon(stats.versions)}
                    if prepared.privacy is not None
                    else {}
                ),
            )
        )

    async def _finish(
        self,
        summary: RunSummary,
        stats: ServerStats,
        server: Server,
        writes: CheckpointWriter,
        instruments: Instrumentation | None,
        layout: LayerLayout | None,
        residual_memory: dict[str, int],
    ) -> RunSummary:
        """End a stopped run with :class:`RunInterrupted`; else build the profile, log the run's final figures and
        return its whole summary."""
        log = self._log
        if instruments is not None:
            summary = await self._profile(summary, server, instruments, layout, residual_memory, stats.versions)
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
        # After the profile, which counts the alerts and the peak memory into the summary.
        figures = {
            key: value
            for key, value in summary.to_dict().items()
            if isinstance(value, int | float) and not isinstance(value, bool)
        }
        bus = self._bus.statistics()
        # Debug on the console (the command prints the summary once). One value each: tags, not one-point metrics
        # (which the MLflow UI would draw as a chart each).
        extra = {"bus_dropped": bus.dropped, "bus_high_water": bus.high_water}
        log.debug("run.finished", step=stats.versions, metrics=False, **figures, **extra)
        await off_loop(self._tracker.set_tags, finished_tags(figures | extra))
        return summary

    async def _profile(
        self,
        summary: RunSummary,
        server: Server,
        instruments: Instrumentation,
        layout: LayerLayout | None,
        residual_memory: dict[str, int],
        last_version: int,
    ) -> RunSummary:
        """Build this segment's profile (also when the run was stopped) and log its series; return the summary with
        the profile's figures, keeping the profile in :attr:`profile` with its ``segment``."""
        # In a thread: summarising a long run's records must not stall the caller's event loop.
        summary, profile = await asyncio.to_thread(
            finish_profile,
            self._config,
            summary,
            instruments,
            server,
            self._executor,
            layout,
            residual_memory,
            self._log,
            self.weights,
        )
        if profile is not None:
            profile["tracking"] = tracking_health(self._tracker)
            profile["segment"] = segment(
                first_version=self._first_version,
                last_version=last_version,
                stopped=bool(server.stop_requested),
            )
            self.profile = profile
        self.summary = summary
        return summary

    def _close_stores(self, plugins: Sequence[ClientPlugin]) -> dict[str, int]:
        """Close the clients' plug-ins (their spilled state), remove the scratch folder; return the memory figures."""
        memory: dict[str, int] = {}
        for plugin in plugins:
            memory.update(plugin.close(self._log))
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        return memory

    def _scratch_dir(self) -> str:
        """Create the run's scratch folder (removed at the end of the run) and return its path."""
        if self._scratch is None:
            self._scratch = str(make_scratch(_RESIDUALS))
        return self._scratch


def _attach(
    transport: RemoteTransport,
    config: RunConfig,
    world: ClientWorld,
    parts: ServerParts,
    prepared: Prepared,
    *,
    bus: EventBus,
    clock: RunClock,
    log: Any,
) -> None:
    """Serve the run's remote clients through ``transport`` (with secure aggregation's groups when it is on)."""
    registry = parts.server.registry
    secure = remote_groups(
        config,
        world,
        registry,
        staleness=staleness_weight_of(config.server),
        example_weight=make_example_weight(config.server),
        bus=bus,
        clock=clock,
        num_params=prepared.initial.numel(),
        model_version=lambda: int(parts.server.version),
    )
    transport.attach(
        bus=bus,
        registry=registry,
        clock=clock,
        log=log,
        num_params=prepared.initial.numel(),
        feature_shape=tuple(prepared.train.feature_shape),
        num_classes=prepared.train.num_classes,
        secure=secure,
    )


def _sweep(config: RunConfig, log: Any) -> None:
    """Remove the temporary files of runs that were killed (SIGKILL, OOM) before they could remove them."""
    swept = sweep_scratch(_TRACES) + sweep_scratch(_RESIDUALS)
    for spill_dir in {config.codec.residual_dir, config.scaffold.spill_dir} - {None}:
        swept += sweep_scratch(RESIDUALS_PREFIX, spill_dir)
    if swept:
        log.info("scratch.swept", folders=len(swept), message=f"removed {len(swept)} folder(s) of killed runs")


def root_cause(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """Return the first error of a (nested) exception group that is not a cancellation."""
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            return root_cause(error)
        if not isinstance(error, asyncio.CancelledError):
            return error
    return group.exceptions[0]


def _client_eval(parts: ServerParts) -> dict[str, Any]:
    """Return the summary's fields of the client-side evaluation that closed last (none without one)."""
    for plugin in parts.server.plugins:
        if isinstance(plugin, EvaluationSummary) and plugin.last is not None:
            return {"client_eval_version": plugin.last[0], "client_eval": plugin.last[1]}
    return {}
