"""The client coroutine: download, train in an executor, encode, upload.

A client exists only while it has a task: the task registry starts :meth:`Client.run` for one task, and the
coroutine ends when its update (or its failure) is on the bus. The training itself runs in a worker thread
(:mod:`flasync.training.jobs`); the coroutine places each step on the run's clock from the simulated world (network,
speeds, faults).
"""

from __future__ import annotations

import asyncio
import functools
import heapq
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import structlog
import torch

from flasync import codecs
from flasync.clients.simulated.faults import Fate, FaultModel
from flasync.clients.simulated.population import Network, Population
from flasync.core import seeding
from flasync.core.bus import EventBus
from flasync.core.clock import Clock, LoopExecutor, Started, VirtualClock
from flasync.core.errors import InjectedFault
from flasync.core.events import (
    ClientFailed,
    ClientId,
    FailureKind,
    TaskAssigned,
    TaskDiagnosis,
    UpdatesUploaded,
    UpdateUploaded,
)
from flasync.core.instruments import debug_many, logs_debug
from flasync.core.snapshots import ModelSnapshot
from flasync.training.diagnostics import DivergedTraining
from flasync.training.executors.threads import TrainingJob
from flasync.training.jobs import (
    ClientSamples,
    Finish,
    JobContext,
    TrainedUpdate,
    correction_of,
    finish_cohort,
    injected_crash,
    train_job,
)
from flasync.training.plugins import ClientPlugin, TaskPart

__all__ = ["Client", "ClientWorld", "CohortClients", "ModelSnapshot"]

FAILURE_WARNINGS = 3
"""Failures of clients with one error logged as warnings in a run; the rest of them at debug level."""
_MAX_WARNED_ERRORS = 1_000  # distinct errors counted (an error naming its client would make one per client)
_HOST = torch.device("cpu")  # where the upload codec writes bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientWorld:
    """What a simulated client's coroutine needs: the clock and the bus, the simulated world, and where to train.

    Attributes:
        clock: The run's clock.
        bus: Where answers go.
        log: The run's logger.
        wall: Monotonic real seconds.
        seed: The run's seed (each task's random streams are keyed by client and participation).
        population: Sizes and speeds.
        network: Simulated links.
        faults: The simulated failure model (None: no faults).
        samples: Each client's training data.
        pool: The training executor's pool.
        job: What the worker-thread side of a task needs.
        plugins: The run's per-client algorithm state (:mod:`flasync.training.plugins`), in the order their parts
            take a task.
        failure_warnings: How many failures of each error were logged as warnings (see :func:`_failed`).
    """

    clock: Clock
    bus: EventBus
    log: Any
    wall: Callable[[], float]
    seed: int
    population: Population
    network: Network
    faults: FaultModel | None
    samples: ClientSamples
    pool: Executor
    job: JobContext
    plugins: tuple[ClientPlugin, ...] = ()
    failure_warnings: Counter[str] = field(default_factory=Counter)

    def forget(self, task: TaskAssigned) -> None:
        """Drop what was recorded for a task that ended."""
        for plugin in self.plugins:
            plugin.released(task)


class _Prepared(NamedTuple):
    """A task's timeline and inputs, known before it trains."""

    samples: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    download_s: float
    simulated: float
    done_at: float
    parts: tuple[TaskPart, ...]


def _prepare(
    world: ClientWorld, task: TaskAssigned, model: ModelSnapshot, download_s: float | None = None
) -> _Prepared:
    """Place a task's download (of ``download_s`` seconds, when known) and training on its timeline; record what a
    checkpoint must restore for it."""
    job_ctx, cid = world.job, task.client_id
    if download_s is None:
        download_s = world.network.download_seconds(cid, model.download_bytes)
    samples = world.samples(cid)
    steps = job_ctx.local.steps_for(len(samples[2]))
    # A client's k-th participation draws the same numbers whenever and by whom it is dispatched.
    simulated = world.population.train_seconds(cid, steps, task.participation)
    plugins = world.plugins
    parts = tuple(part for plugin in plugins if (part := plugin.task(task, model)) is not None) if plugins else ()
    return _Prepared(samples, download_s, simulated, task.simulated_s + (download_s + simulated), parts)


def _training_job(
    world: ClientWorld,
    task: TaskAssigned,
    model: ModelSnapshot,
    prepared: _Prepared,
    attack: float,
    seed: int | None = None,
) -> TrainingJob[TrainedUpdate]:
    """Return the task's local training, in the form a batching executor trains with others of its cohort
    (``seed``: its task stream's, when mixed with others' by :func:`~flasync.core.seeding.stream_seeds`)."""
    job_ctx, cid = world.job, task.client_id
    samples, parts = prepared.samples, prepared.parts
    generator = (
        seeding.torch_stream(world.seed, seeding.TASK, cid, task.participation)
        if seed is None
        else seeding.torch_generator(seed)
    )
    codec_generator = (
        seeding.torch_stream(world.seed, seeding.CODEC, cid, task.participation)
        if job_ctx.upload_codec.draws_random
        else None
    )
    return TrainingJob(
        base=model.weights,
        x=samples[0],
        y=samples[1],
        indices=samples[2],
        cfg=job_ctx.local,
        generator=generator,
        finish=Finish(job_ctx, cid, codec_generator, attack, parts),
        solo=functools.partial(
            train_job, job_ctx, cid, model.weights, samples, generator, codec_generator, task.task_id, attack, parts
        ),
        correction=correction_of(parts),
        client=int(cid) if world.samples.lazy is not None else None,
        deltas_on=_HOST,  # finish_job encodes the delta as bytes on the host
        finish_many=finish_cohort,
    )


def _keep(
    world: ClientWorld,
    task: TaskAssigned,
    model: ModelSnapshot,
    prepared: _Prepared,
    trained: TrainedUpdate,
    context: Mapping[str, int] | None = None,
    lines: list[dict[str, Any]] | None = None,
) -> None:
    """Keep what a trained task's plug-in parts hand back, and log its figures (``context``: extra fields). With
    ``lines``, the debug line's fields are appended there for the caller to log rather than logged."""
    job_ctx = world.job
    for part, finished in zip(prepared.parts, trained.finished, strict=True):
        part.keep(finished)
    if not logs_debug(world.log):
        return
    result = trained.result
    line: dict[str, Any] = {
        **(context or {}),
        "step": task.task_id,
        "train_s": result.train_s,
        "sim_train_s": prepared.simulated,
        "sim_download_s": prepared.download_s,
        "samples": result.num_samples,
        "loss": result.loss,
        "peak_mem_bytes": result.peak_mem_bytes,
        "encode_s": trained.encode_s,
        "download_bytes": model.download_bytes,
        "upload_bytes": trained.upload_bytes,
        "compression": (codecs.HEADER.size + 4 * job_ctx.num_params) / len(trained.payload),
    }
    for finished in trained.finished:
        line.update(finished.figures)
    if lines is None:
        world.log.debug("client", **line)
    else:
        lines.append(line)


def _uploaded(
    world: ClientWorld,
    task: TaskAssigned,
    model: ModelSnapshot,
    prepared: _Prepared,
    trained: TrainedUpdate,
    upload_s: float,
    at: float | None = None,
) -> UpdateUploaded:
    """Return the upload of a trained task, sent at virtual time ``at`` (None: now; a batch of uploads sent at
    several times is handed over at the last of them)."""
    result = trained.result
    return UpdateUploaded(
        to=task.reply_to,
        task_id=task.task_id,
        client_id=task.client_id,
        base_version=task.base_version,
        num_samples=result.num_samples,
        payload=trained.payload,
        extra=trained.extra,
        train_loss=result.loss,
        simulated_s=world.clock.now() if at is None else at,
        sent_wall_s=world.wall(),
        compute_s=result.train_s,
        encode_s=trained.encode_s,
        sim_download_s=prepared.download_s,
        sim_train_s=prepared.simulated,
        sim_upload_s=upload_s,
        download_bytes=model.download_bytes,
        peak_mem_bytes=result.peak_mem_bytes,
        diagnosis=trained.diagnosis,
    )


def _failed(
    world: ClientWorld,
    task: TaskAssigned,
    kind: FailureKind,
    error: str,
    diagnosis: TaskDiagnosis | None = None,
    **context: int,
) -> ClientFailed:
    """Log a task's failure and return its notice, sent now (``context``: extra log fields).

    The first :data:`FAILURE_WARNINGS` failures with one error are warnings, the rest debug lines: a run whose every
    client fails alike (a learning rate that overflows) says so a few times, not once per client. Every failure is
    counted either way (``updates_failed``, ``server/round/*``).
    """
    warned, seen = world.failure_warnings, 0
    if kind == "error" and (error in warned or len(warned) < _MAX_WARNED_ERRORS):
        warned[error] += 1
        seen = warned[error]
    if 0 < seen <= FAILURE_WARNINGS:
        last = seen == FAILURE_WARNINGS
        more = {"then": "further failures with this error are logged at debug level"} if last else {}
        world.log.warning("client.failed", **context, step=task.task_id, error=error, **more, metrics=False)
    else:
        world.log.debug("client.failed", **context, step=task.task_id, kind=kind, error=error, metrics=False)
    return ClientFailed(
        to=task.reply_to,
        task_id=task.task_id,
        client_id=task.client_id,
        base_version=task.base_version,
        error=error,
        simulated_s=world.clock.now(),
        diagnosis=diagnosis,
        kind=kind,
    )


def _training_failure(exc: BaseException) -> tuple[FailureKind, str, TaskDiagnosis | None]:
    """Return how a task whose training raised ``exc`` failed: its kind, its one-line error and its diagnosis."""
    kind: FailureKind = "crash" if isinstance(exc, InjectedFault) else "error"
    diagnosis = exc.diagnosis if isinstance(exc, DivergedTraining) else None
    return kind, f"{type(exc).__name__}: {exc}", diagnosis


class Client:
    """A sampled client: its id, and the coroutine that runs one task.

    Args:
        client_id: Index in the population.
        world: The simulated world the client lives in.
    """

    __slots__ = ("client_id", "world")

    def __init__(self, client_id: ClientId, world: ClientWorld) -> None:
        """Bind the client to the run."""
        self.client_id = client_id
        self.world = world

    async def run(self, task: TaskAssigned, model: ModelSnapshot) -> None:
        """Run one task: download ``model``, train locally, upload the encoded delta on the bus.

        Every step is placed at an absolute time counted from the dispatch (``task.simulated_s``), so a task
        re-dispatched from a checkpoint keeps the timeline it started with. The run's fault model may make the
        task crash, hang or drop out (see :mod:`flasync.clients.simulated.faults`). A failure of local training is
        published as
        :class:`ClientFailed`; it never propagates.
        """
        world, cid = self.world, self.client_id
        clock = world.clock
        # bind/reset rather than structlog's bound_contextvars: the same context, a third of its cost per task.
        tokens = structlog.contextvars.bind_contextvars(client_id=int(cid), base_version=int(task.base_version))
        try:
            prepared = _prepare(world, task, model)
            download_s, simulated, done_at = prepared.download_s, prepared.simulated, prepared.done_at
            faults = world.faults
            fate = faults.fate(cid, task.participation) if faults is not None else None
            offline_at = faults.offline_at(cid, task.simulated_s) if faults is not None else float("inf")
            if fate is not None and fate.fate is Fate.HANG:
                await asyncio.get_running_loop().create_future()  # never answers; the registry times the task out
            if fate is not None and fate.fate is Fate.DROPOUT:
                left_at = task.simulated_s + (download_s + fate.fraction * simulated)
                await self._fail(task, "dropout", f"dropped out after {fate.fraction:.0%} of training", left_at)
                return
            if offline_at < done_at:
                await self._fail(task, "offline", "availability window closed during training", offline_at)
                return
            job: Callable[[], TrainedUpdate]
            if fate is not None and fate.fate is Fate.CRASH:
                fraction = fate.fraction
                job = functools.partial(injected_crash, fraction)
                done_at = task.simulated_s + (download_s + fraction * simulated)
            else:
                attack = faults.attack_factor(cid) if faults is not None else 1.0
                # A batching executor trains this job together with others of the same base version.
                job = _training_job(world, task, model, prepared, attack)
            try:
                # Everything the job needs is known now, so it starts at once in real time; on the virtual
                # clock it completes after the simulated download and training.
                trained = await clock.run(world.pool, job, simulated_s=download_s + simulated, until=done_at)
            except Exception as exc:
                kind, error, diagnosis = _training_failure(exc)
                await self._fail(task, kind, error, None, diagnosis)
                return
            upload_s = world.network.upload_seconds(cid, trained.upload_bytes)
            up_at = done_at + upload_s
            if offline_at < up_at:
                await self._fail(task, "offline", "availability window closed during upload", offline_at)
                return
            _keep(world, task, model, prepared, trained)
            await clock.elapse(upload_s, until=up_at)
            await world.bus.publish(_uploaded(world, task, model, prepared, trained, upload_s))
        finally:
            structlog.contextvars.reset_contextvars(**tokens)

    async def _fail(
        self,
        task: TaskAssigned,
        kind: FailureKind,
        error: str,
        at: float | None,
        diagnosis: TaskDiagnosis | None = None,
    ) -> None:
        """Publish :class:`ClientFailed` at time ``at`` (now if None)."""
        world = self.world
        if at is not None:
            await world.clock.sleep_until(at)
        await world.bus.publish(_failed(world, task, kind, error, diagnosis))


class CohortClients:
    """The coroutine that runs a group of tasks dispatched together: one coroutine and a few timers, not one each.

    It does what :meth:`Client.run` does for each of its tasks - the same timeline, the same jobs, the same
    uploads in the same order - without a coroutine per task, which is much of the event loop's work per task once
    a batching executor trains the jobs as one cohort. On the run's clock the group waits for its jobs once per
    distinct completion time (once for all of them, at the earliest, when a batching executor trains them and no
    answer can release another task), and once per distinct upload time, publishing every upload due then at once.
    Uploads at one time go out in the order their tasks finished training, as :class:`Client` coroutines' timers
    would send them.

    A task the registry released meanwhile (a round closed without it, a timeout) publishes nothing, as a
    cancelled :class:`Client` coroutine would not. Where an answer may make the server release other tasks in
    flight (:attr:`together` False: a round that closes on a quorum or a deadline, task timeouts), the uploads due
    at one time go out one at a time, each on its own timer, so that the server handles each before the next.

    Where the receiver does nothing with an upload but fold it in until the last one of its round has come
    (:attr:`gather`: rounds that close on every answer, straight to the cloud), the uploads due at different times
    go out as one batch at the last of those times, whenever the virtual clock has nothing else to fire before it
    (:meth:`~flasync.core.clock.VirtualClock.next_timer`): what the receiver and every observer see of each upload is
    what they would see of it sent alone at its own time (its ``simulated_s``), in the same order, and the round
    closes at the same time, without a timer, a loop pass and an event per upload time.

    Only a run whose fault model makes no task crash, hang or drop out and keeps every client online uses groups:
    such a fault decides per task whether and when it answers. Byzantine clients attack within a group as they do
    alone.

    Args:
        world: The simulated world the clients live in.
        live: Tells whether a task is still in flight.
        together: Publish the uploads due at one time together.
        gather: Publish the uploads due at different times together, at the last of them, where the clock has
            nothing else before it (only with ``together``).
    """

    __slots__ = ("gather", "live", "together", "world")

    def __init__(
        self,
        world: ClientWorld,
        live: Callable[[TaskAssigned], bool],
        *,
        together: bool = True,
        gather: bool = False,
    ) -> None:
        """Bind the group to the run."""
        if world.faults is not None and world.faults.active:
            raise ValueError("tasks run as a group only when no fault decides whether and when they answer")
        self.world = world
        self.live = live
        self.together = together
        self.gather = gather

    async def run(self, tasks: Sequence[TaskAssigned], model: ModelSnapshot) -> None:
        """Run ``tasks``, all on ``model``: train each as :meth:`Client.run` would, upload each at its time."""
        world = self.world
        clock = world.clock
        prepared, training = self._plans(tasks, model)
        n = len(tasks)
        # The agenda holds (time, order, kind, index). Completions are ordered by task (order < n) and uploads after
        # every completion (order >= n, numbered as their tasks finish training): at one time completions come
        # first, and uploads keep the order that one coroutine per task would give them. A batching executor
        # trains the group as one cohort anyway: where no answer can release another task (``together``), the
        # group hands it every job at once and waits once, at its earliest completion time, for all of them (one
        # future for the group), instead of once per completion time.
        agenda: list[tuple[float, int, int, int]]
        jobs: list[Started[Any]]
        pool = world.pool
        if self.together and isinstance(pool, LoopExecutor):
            group = pool.submit_many_async(training)
            jobs = [Started(group, group)]
            agenda = [(min(p.done_at for p in prepared), -1, _ALL_TRAINED, -1)]
        else:
            jobs = [clock.start(world.pool, job) for job in training]
            agenda = sorted((p.done_at, i, _TRAINED, i) for i, p in enumerate(prepared))
        state = _GroupState(tasks=tasks, model=model, prepared=prepared, jobs=jobs, agenda=agenda, order=n)
        try:
            while agenda:
                when, _, kind, _ = agenda[0]
                due = []
                while agenda and agenda[0][0] == when and agenda[0][2] == kind:
                    due.append(heapq.heappop(agenda)[3])
                if kind in (_ALL_TRAINED, _TRAINED):
                    await self._trained(state, when, kind, due)
                elif kind == _FAILED:
                    await self._publish_failures(state, when, due)
                elif self.together:
                    await self._upload_together(state, when, due)
                else:  # one at a time: the server has handled each before the next goes out
                    for i in due:
                        task, (trained, upload_s) = tasks[i], state.uploads.pop(i)
                        await clock.sleep_until(when)
                        if self.live(task):
                            await world.bus.publish(_uploaded(world, task, model, prepared[i], trained, upload_s))
        except BaseException:
            for job in jobs:
                job.future.cancel()
            raise

    def _plans(
        self, tasks: Sequence[TaskAssigned], model: ModelSnapshot
    ) -> tuple[list[_Prepared], list[TrainingJob[TrainedUpdate]]]:
        """Return each task's timeline and inputs, and its training job."""
        world = self.world
        # The group's download times and task seeds in one call each (array passes for a large group: the same
        # numbers).
        clients = [task.client_id for task in tasks]
        downloads = world.network.download_seconds_many(clients, model.download_bytes)
        seeds = seeding.stream_seeds(world.seed, seeding.TASK, clients, [task.participation for task in tasks])
        prepared = [_prepare(world, task, model, downloads[k]) for k, task in enumerate(tasks)]
        faults = world.faults
        training = [
            _training_job(
                world,
                task,
                model,
                plan,
                faults.attack_factor(task.client_id) if faults is not None else 1.0,
                seeds[k],
            )
            for k, (task, plan) in enumerate(zip(tasks, prepared, strict=True))
        ]
        return prepared, training

    async def _trained(self, state: _GroupState, when: float, kind: int, due: list[int]) -> None:
        """Take the outcomes of the jobs due at ``when``: a failure goes back on the agenda for its task's completion
        time, a trained update of a task still in flight for its upload time."""
        world, clock, tasks, prepared, agenda = self.world, self.world.clock, state.tasks, state.prepared, state.agenda
        if kind == _ALL_TRAINED:  # every job, taken in the order of their completion times
            due = sorted(range(len(tasks)), key=lambda i: (prepared[i].done_at, i))
            (results,) = await clock.finish(state.jobs, until=when)
            if isinstance(results, BaseException):
                raise results  # the group's future was cancelled
            outcomes = [results[i] for i in due]
        else:
            outcomes = await clock.finish([state.jobs[i] for i in due], until=when)
        upload_times = _upload_times(world.network, tasks, due, outcomes)
        lines: list[dict[str, Any]] = []  # the trained tasks' debug lines, logged together
        try:
            for i, outcome in zip(due, outcomes, strict=True):
                task, plan = tasks[i], prepared[i]
                if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
                    raise outcome
                if isinstance(outcome, Exception):
                    state.failures[i] = outcome  # published at the task's own completion time
                    heapq.heappush(agenda, (plan.done_at, i, _FAILED, i))
                elif self.live(task):  # else released meanwhile: a coroutine would have been cancelled
                    upload_s = upload_times[i]
                    _keep(world, task, state.model, plan, outcome, _context(task), lines)
                    state.uploads[i] = (outcome, upload_s)
                    heapq.heappush(agenda, (plan.done_at + upload_s, state.order, _UPLOAD, i))
                    state.order += 1
        finally:  # those kept so far, also when an outcome is raised
            debug_many(world.log, "client", lines)

    async def _publish_failures(self, state: _GroupState, when: float, due: list[int]) -> None:
        """Publish at ``when`` the failures of the tasks ``due`` that are still in flight."""
        world = self.world
        await world.clock.sleep_until(when)
        for i in due:
            task = state.tasks[i]
            if self.live(task):
                kind, error, diagnosis = _training_failure(state.failures.pop(i))
                await world.bus.publish(_failed(world, task, kind, error, diagnosis, **_context(task)))

    async def _upload_together(self, state: _GroupState, when: float, due: list[int]) -> None:
        """Publish at ``when`` the uploads due then (with ``gather``, and those due later when the clock has nothing
        else before them), as one batch where every receiver takes it."""
        world = self.world
        clock, bus, tasks = world.clock, world.bus, state.tasks
        await clock.sleep_until(when)
        times = [clock.now()] * len(due)
        if self.gather:
            later = _quiet_uploads(state.agenda, clock)
            if later:
                await clock.sleep_until(later[-1][0])
                due += [i for _, i in later]
                times += [at for at, _ in later]
        sent = [
            _uploaded(world, tasks[i], state.model, state.prepared[i], *state.uploads.pop(i), at=at)
            for i, at in zip(due, times, strict=True)
            if self.live(tasks[i])
        ]
        # As one batch where every receiver takes it (the server decodes and checks them together).
        if sent and all(message.to == sent[0].to for message in sent):
            await bus.publish_together(UpdatesUploaded, sent, to=sent[0].to)
        else:
            for message in sent:
                await bus.publish(message)


@dataclass(slots=True, kw_only=True)
class _GroupState:
    """What a :class:`CohortClients` group keeps while its tasks run: their plans and jobs, and what is due next."""

    tasks: Sequence[TaskAssigned]
    model: ModelSnapshot
    prepared: list[_Prepared]
    jobs: list[Started[Any]]
    agenda: list[tuple[float, int, int, int]]
    """Entries ``(time, order, kind, task index)``, a heap."""
    order: int
    """The order the next upload put on the agenda takes."""
    uploads: dict[int, tuple[TrainedUpdate, float]] = field(default_factory=dict)
    """Task index -> its trained update and upload seconds, until it is published."""
    failures: dict[int, Exception] = field(default_factory=dict)
    """Task index -> why its training failed, until it is published."""


def _quiet_uploads(agenda: list[tuple[float, int, int, int]], clock: Clock) -> list[tuple[float, int]]:
    """Take every entry left on a group's agenda and return them as ``(time, task index)`` in agenda order, when
    they are all uploads and a virtual clock has nothing else to fire up to the last one; else take nothing and
    return ``[]``."""
    if not agenda or not isinstance(clock, VirtualClock) or any(entry[2] != _UPLOAD for entry in agenda):
        return []
    entries = sorted(agenda)
    if not clock.next_timer() > entries[-1][0]:
        return []
    agenda.clear()
    return [(when, index) for when, _, _, index in entries]


def _upload_times(
    network: Network, tasks: Sequence[TaskAssigned], due: Sequence[int], outcomes: Sequence[Any]
) -> dict[int, float]:
    """Return the upload seconds of each trained task among ``due`` (indices into ``tasks``), from one call."""
    trained = [(i, o) for i, o in zip(due, outcomes, strict=True) if not isinstance(o, BaseException)]
    seconds = network.upload_seconds_many(
        [tasks[i].client_id for i, _ in trained], [o.upload_bytes for _, o in trained]
    )
    return {i: s for (i, _), s in zip(trained, seconds, strict=True)}


_ALL_TRAINED, _TRAINED, _FAILED, _UPLOAD = range(4)  # what a group's agenda entry waits for


def _context(task: TaskAssigned) -> dict[str, int]:
    """The log fields a :class:`Client` coroutine binds for its task."""
    return {"client_id": int(task.client_id), "base_version": int(task.base_version)}
