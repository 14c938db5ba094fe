"""The client coroutine: download, train in an executor, encode, upload.

A client exists only while it has a task: the task registry starts :meth:`CohortClients.run` for the tasks it
dispatched together (one task, or a cohort), and the coroutine ends when their updates (or failures) are on the bus.
The training itself runs in a worker thread (:mod:`flasync.training.jobs`); the coroutine places each step on the
run's clock from the simulated world (network, speeds, faults).
"""

from __future__ import annotations

import heapq
import math
import operator
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from itertools import compress, repeat
from typing import Any, NamedTuple, cast

import numpy as np
import torch

from flasync import codecs
from flasync.clients.simulated.faults import Fate, FaultModel
from flasync.clients.simulated.population import Network, Population
from flasync.clients.simulated.secure import SecureRoom
from flasync.core import seeding
from flasync.core.bus import EventBus
from flasync.core.clock import Clock, Started, VirtualClock
from flasync.core.errors import InjectedFault
from flasync.core.events import (
    ClientFailed,
    FailureKind,
    TaskAssigned,
    TaskDiagnosis,
    UpdatesUploaded,
    UpdateUploaded,
    positional,
)
from flasync.core.instruments import debug_many, logs_debug
from flasync.core.snapshots import ModelSnapshot
from flasync.training.diagnostics import DivergedTraining
from flasync.training.executors import LoopExecutor
from flasync.training.executors.threads import StreamKey, TrainingJob
from flasync.training.jobs import (
    ClientSamples,
    Finish,
    JobContext,
    TrainedUpdate,
    correction_of,
    finish_cohort,
    injected_fault,
    start_of,
    train_job,
)
from flasync.training.plugins import ClientPlugin, TaskPart

__all__ = ["ClientWorld", "CohortClients", "ModelSnapshot"]

FAILURE_WARNINGS = 3
"""Failures of clients with one error logged as warnings in a run; the rest of them at debug level."""
_MAX_WARNED_ERRORS = 1_000  # distinct errors counted (an error naming its client would make one per client)
_HOST = torch.device("cpu")  # where the upload codec writes bytes
_MAKE_UPLOAD = positional(UpdateUploaded)
_ARRAY_SORT_FROM = 64  # tasks from which a group's completion order is sorted with NumPy (quicker from about there)


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


_Samples = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class _Plan(NamedTuple):
    """What a group of tasks does, known at dispatch: each task's timeline (by task index: its download and
    training seconds, and when its training ends) and plug-in parts, the jobs of those that train (by task index),
    the failures the fault model decides, and when each client next goes offline."""

    download_s: list[float]
    simulated: list[float]
    done_at: list[float]
    parts: list[tuple[TaskPart, ...]] | None
    """Each task's plug-in parts (None: the run has no plug-in)."""
    training: dict[int, TrainingJob[TrainedUpdate]]
    faults: dict[int, _Fault]
    offline: list[float] | None
    """When each task's client next goes offline (None: never)."""


def _timeline(
    world: ClientWorld, tasks: Sequence[TaskAssigned], model: ModelSnapshot
) -> tuple[_Plan, list[_Samples], list[tuple[int, int] | None]]:
    """Place each task's download and training on its timeline and record what a checkpoint must restore for it;
    return the group's plan (no jobs, faults nor offline times yet), each task's data and the span of its sample
    indices in the data's (None: the data's indices are the client's own)."""
    clients = [task.client_id for task in tasks]
    downloads = world.network.download_seconds_many(clients, model.download_bytes)
    samples = world.samples
    data: list[_Samples]
    spans: list[tuple[int, int] | None]
    if samples.lazy is None:  # rows of one data set: where each client's lie, sliced where its job trains
        starts, stops = samples.spans(clients)
        sizes = [stop - start for start, stop in zip(starts, stops, strict=True)]
        data = [(samples.x, samples.y, samples.index)] * len(clients)
        spans = list(zip(starts, stops, strict=True))
    else:
        data = [samples(cid) for cid in clients]
        sizes = [drawn[2].shape[0] for drawn in data]
        spans = [None] * len(clients)
    steps_for = world.job.local.steps_for
    steps_of = {size: steps_for(size) for size in set(sizes)}  # clients of one size take the same steps
    # A client's k-th participation draws the same numbers whenever and by whom it is dispatched.
    simulated = world.population.train_seconds_many(
        clients, list(map(steps_of.__getitem__, sizes)), [task.participation for task in tasks]
    )
    done_at = [task.simulated_s + (d + s) for task, d, s in zip(tasks, downloads, simulated, strict=True)]
    plugins = world.plugins
    parts = (
        [tuple(part for plugin in plugins if (part := plugin.task(task, model)) is not None) for task in tasks]
        if plugins
        else None
    )
    return _Plan(downloads, simulated, done_at, parts, {}, {}, None), data, spans


def _training_jobs(
    world: ClientWorld,
    model: ModelSnapshot,
    tasks: Sequence[TaskAssigned],
    train: Sequence[int],
    data: list[_Samples],
    spans: list[tuple[int, int] | None],
    parts: Sequence[tuple[TaskPart, ...]],
    attacks: Sequence[float],
) -> dict[int, TrainingJob[TrainedUpdate]]:
    """Return the local training of the tasks ``train`` (indices into ``tasks``, each with its ``attacks`` factor),
    by task index, in the form a batching executor trains with others of its cohort (``spans``: where each task's
    sample indices lie in its ``data``'s)."""
    job_ctx, seed, draws = world.job, world.seed, world.job.upload_codec.draws_random
    cfg, weights, make, finish = job_ctx.local, model.weights, TrainingJob.of, Finish
    task_purpose, codec_purpose = seeding.TASK, seeding.CODEC
    jobs: dict[int, TrainingJob[TrainedUpdate]] = {}
    for k, attack in zip(train, attacks, strict=True):
        task, samples, span, task_parts = tasks[k], data[k], spans[k], parts[k]
        cid, participation = task.client_id, task.participation
        # The streams' keys and the indices' span: the generators are made and the indices sliced where the job
        # trains, off the event loop.
        key: StreamKey = (seed, task_purpose, cid, participation)
        codec_key = (seed, codec_purpose, cid, participation) if draws else None
        start = start_of(task_parts) if task_parts else None
        base = weights if start is None else start
        jobs[k] = make(
            base,
            samples[0],
            samples[1],
            samples[2],
            cfg,
            key,
            finish(job_ctx, cid, codec_key, attack, task_parts, task.task_id),
            None,  # trained alone by _train_alone, from its own attributes
            correction_of(task_parts) if task_parts else None,
            None if span is not None else int(cid),
            _HOST,  # finish_job encodes the delta as bytes on the host
            finish_cohort,
            span,
            _train_alone,
        )
    return jobs


def _train_alone(job: TrainingJob[TrainedUpdate]) -> TrainedUpdate:
    """Train a task's job alone and finish it (its :attr:`~flasync.training.executors.threads.TrainingJob.alone`):
    :func:`~flasync.training.jobs.train_job` of the job's base, data, index span and stream key, and of its
    :class:`~flasync.training.jobs.Finish`'s task, client, codec stream, attack and plug-in parts (in a worker)."""
    finish = cast(Finish, job.finish)
    return train_job(
        finish.ctx,
        finish.client_id,
        job.base,
        (job.x, job.y, job.indices),
        job.generator,
        finish.codec_generator,
        finish.task_id,
        finish.attack,
        finish.parts,
        job.span,
    )


def _keep(
    world: ClientWorld,
    task: TaskAssigned,
    model: ModelSnapshot,
    plan: _Plan,
    i: int,
    trained: TrainedUpdate,
    lines: list[dict[str, Any]] | None = None,
) -> None:
    """Keep what the plug-in parts of trained task ``i`` hand back, and log its figures. With ``lines``, the debug
    line's fields are appended there for the caller to log rather than logged."""
    if plan.parts is not None:
        for part, finished in zip(plan.parts[i], trained.finished, strict=True):
            part.keep(finished)
    if not logs_debug(world.log):
        return
    result = trained.result
    line: dict[str, Any] = {
        **_context(task),
        "step": task.task_id,
        "train_s": result.train_s,
        "sim_train_s": plan.simulated[i],
        "sim_download_s": plan.download_s[i],
        "samples": result.num_samples,
        "loss": result.loss,
        "peak_mem_bytes": result.peak_mem_bytes,
        "encode_s": trained.encode_s,
        "download_bytes": model.download_bytes,
        "upload_bytes": trained.upload_bytes,
        "compression": (codecs.HEADER.size + 4 * world.job.num_params) / len(trained.payload),
    }
    for finished in trained.finished:
        line.update(finished.figures)
    if lines is None:
        world.log.debug("client", **line)
    else:
        lines.append(line)


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


class _Fault(NamedTuple):
    """A task the fault model ends before it uploads: when, and how (kind, one-line error, diagnosis)."""

    at: float
    failure: tuple[FailureKind, str, TaskDiagnosis | None]


class CohortClients:
    """The client coroutine: it runs the tasks dispatched together on one model, one task or many.

    For each task it places the download and the training on the task's timeline, counted from its dispatch
    (``task.simulated_s``, so a task re-dispatched from a checkpoint keeps the timeline it started with), hands the
    training to the executor, encodes the delta in the worker and uploads it on the bus at its time. A failure of
    local training is published as :class:`ClientFailed` at the task's completion time; it never propagates. The
    run's fault model may make a task crash, hang or drop out, or its client go offline before it uploads
    (:mod:`flasync.clients.simulated.faults`): such a task fails (or, hanging, never answers) at the time its fault
    decides. A task alone is a group of one: the registry runs each task in a group of its own wherever an answer
    may decide the fate of another (faults, quorum and deadline rounds, timeouts) or time is real.

    A group of several tasks does what a group of one does for each of them - the same timeline, the same jobs, the
    same uploads in the same order - with one coroutine and a few timers instead of one coroutine each, which is
    much of the event loop's work per task once a batching executor trains the jobs as one cohort. On the run's
    clock the group waits for its jobs once per distinct completion time (once for all of them, at the earliest,
    when a batching executor trains them and no answer can release another task), and once per distinct upload
    time, publishing every upload due then at once. Uploads at one time go out in the order their tasks finished
    training, as one coroutine per task would send them.

    A task the registry released meanwhile (a round closed without it, a timeout) publishes nothing. Where an answer
    may make the server release other tasks in flight (:attr:`together` False), the uploads due at one time go out
    one at a time, so that the server handles each before the next.

    Where the receiver does nothing with an upload but fold it in until the last one of its round has come
    (:attr:`gather`: rounds that close on every answer, straight to the cloud), the uploads due at different times
    go out as one batch at the last of those times, whenever the virtual clock has nothing else to fire before it
    (:meth:`~flasync.core.clock.VirtualClock.next_timer`): what the receiver and every observer see of each upload is
    what they would see of it sent alone at its own time (its ``simulated_s``), in the same order, and the round
    closes at the same time, without a timer, a loop pass and an event per upload time.

    Under secure aggregation (``secure``) a trained task uploads nothing: at the end of its training its client
    hands its update to the :class:`~flasync.clients.simulated.secure.SecureRoom` and holds it there, its task in
    flight, until its group runs the protocol.

    Args:
        world: The simulated world the clients live in.
        live: Tells whether a task is still in flight.
        together: Publish the uploads due at one time together.
        gather: Publish the uploads due at different times together, at the last of them, where the clock has
            nothing else before it (only with ``together``).
        secure: Where trained updates wait for their secure-aggregation group (None: they are uploaded).
    """

    __slots__ = ("gather", "live", "secure", "together", "world")

    def __init__(
        self,
        world: ClientWorld,
        live: Callable[[TaskAssigned], bool],
        *,
        together: bool = True,
        gather: bool = False,
        secure: SecureRoom | None = None,
    ) -> None:
        """Bind the group to the run."""
        self.world = world
        self.live = live
        self.together = together
        self.gather = gather
        self.secure = secure

    async def run(self, tasks: Sequence[TaskAssigned], model: ModelSnapshot) -> None:
        """Run ``tasks``, all on ``model``: train each, and upload each (or publish its failure) at its time."""
        clock, pool = self.world.clock, self.world.pool
        plan = self._plans(tasks, model)
        n = len(tasks)
        # The agenda holds (time, order, kind, index). Completions and failures are ordered by task (order < n) and
        # uploads after them (order >= n, numbered as their tasks finish training): at one time completions come
        # first, and uploads keep the order that one coroutine per task would give them. A batching executor
        # trains the group as one cohort anyway: where no answer can release another task (``together``), the
        # group hands it every job at once and waits once, at its earliest completion time, for all of them (one
        # future for the group), instead of once per completion time.
        agenda = [(fault.at, i, _FAILED, i) for i, fault in plan.faults.items()]
        jobs: dict[int, Started[Any]] = {}
        training = plan.training
        batcher = pool if isinstance(pool, LoopExecutor) else None  # its futures give a list of outcomes each
        if batcher is not None and self.together and len(training) > 1:
            group = batcher.submit_many_async(list(training.values()))
            jobs[_ALL] = Started(group, group)
            done_at = plan.done_at
            agenda.append((min(done_at[i] for i in training), -1, _ALL_TRAINED, -1))
        else:
            for i, training_job in training.items():
                if batcher is not None:  # a batch of one
                    one = batcher.submit_many_async((training_job,))
                    jobs[i] = Started(one, one)
                else:
                    jobs[i] = clock.start(pool, training_job)
                agenda.append((plan.done_at[i], i, _TRAINED, i))
        heapq.heapify(agenda)
        state = _GroupState(
            tasks=tasks,
            model=model,
            plan=plan,
            jobs=jobs,
            agenda=agenda,
            order=n,
            failures={i: fault.failure for i, fault in plan.faults.items()},
            batches=batcher is not None,
        )
        try:
            while agenda:
                await self._next(state)
        except BaseException:
            for started in jobs.values():
                started.future.cancel()
            raise

    async def _next(self, state: _GroupState) -> None:
        """Take the entries of the agenda due first (of one time and kind) and do what they wait for."""
        world, agenda = self.world, state.agenda
        when, _, kind, _ = agenda[0]
        if len(agenda) > 8 and all(entry[0] == when and entry[2] == kind for entry in agenda):
            # Every entry is due now and of one kind (a cohort's uploads at one time): all of them, in the order the
            # heap gives them (entries are distinct), from one sort instead of a pop each.
            agenda.sort()
            due = [entry[3] for entry in agenda]
            agenda.clear()
        else:
            due = []
            while agenda and agenda[0][0] == when and agenda[0][2] == kind:
                due.append(heapq.heappop(agenda)[3])
        if kind in (_ALL_TRAINED, _TRAINED):
            await self._trained(state, when, kind, due)
        elif kind == _FAILED:
            await world.clock.sleep_until(when)
            await self._publish_failures(state, due)
        elif self.secure is not None:
            await self._hold(self.secure, state, when, due)
        elif self.together:
            await self._upload_together(state, when, due)
        else:  # one at a time: the server has handled each before the next goes out
            for i in due:
                await world.clock.elapse(state.uploads[i][1], until=when)
                for message in _uploads(world, state, [i], [world.clock.now()], self.live):
                    await world.bus.publish(message)

    def _plans(self, tasks: Sequence[TaskAssigned], model: ModelSnapshot) -> _Plan:
        """Return each task's timeline and inputs, the training job of each that trains, and the faults."""
        world = self.world
        plan, data, spans = _timeline(world, tasks, model)
        parts = plan.parts if plan.parts is not None else [()] * len(tasks)
        faults = world.faults
        if faults is None or not faults.active:
            train = range(len(tasks))
            attacks = [faults.attack_factor(task.client_id) for task in tasks] if faults else [1.0] * len(tasks)
            plan.training.update(_training_jobs(world, model, tasks, train, data, spans, parts, attacks))
            return plan
        offline = [faults.offline_at(task.client_id, task.simulated_s) for task in tasks]
        trains: list[int] = []
        for k, task in enumerate(tasks):
            fault = _fault(faults, task, plan.download_s[k], plan.simulated[k], plan.done_at[k], offline[k])
            if fault is None:
                trains.append(k)
            elif fault is not _HANGS:
                plan.faults[k] = fault
        attacks = [faults.attack_factor(tasks[k].client_id) for k in trains]
        plan.training.update(_training_jobs(world, model, tasks, trains, data, spans, parts, attacks))
        return plan._replace(offline=offline)

    async def _trained(self, state: _GroupState, when: float, kind: int, due: list[int]) -> None:
        """Take the outcomes of the jobs due at ``when``: a failure is published now, a trained update of a task
        still in flight goes on the agenda for its upload time (or its client's going offline before then)."""
        world, clock, tasks, done_at = self.world, self.world.clock, state.tasks, state.plan.done_at
        if kind == _ALL_TRAINED:  # every job, taken in the order of their completion times
            trains = list(state.plan.training)
            (results,) = await clock.finish([state.jobs[_ALL]], until=when)
            if isinstance(results, BaseException):
                raise results  # the group's future was cancelled
            # A stable sort of tasks in index order: by completion time, then index (a large group's with NumPy's
            # stable sort, which orders them as ``sorted`` does).
            ends = [done_at[i] for i in trains]
            order: list[int] = (
                np.argsort(np.asarray(ends, dtype=np.float64), kind="stable").tolist()
                if len(ends) >= _ARRAY_SORT_FROM
                else sorted(range(len(ends)), key=ends.__getitem__)
            )
            due = [trains[k] for k in order]
            outcomes = [results[k] for k in order]
        else:
            outcomes = await clock.finish([state.jobs[i] for i in due], until=when)
            if state.batches:  # each job's batch of one; a cancelled one's error stands for it
                outcomes = [o if isinstance(o, BaseException) else o[0] for o in outcomes]
        upload_times = _upload_times(world.network, tasks, due, outcomes)
        lines: list[dict[str, Any]] = []  # the trained tasks' debug lines, logged together
        # Whether a trained task leaves anything to keep: its plug-in parts' state, or its debug line.
        kept = lines if state.plan.parts is not None or logs_debug(world.log) else None
        if kept is None and self.secure is None and state.plan.offline is None and None not in upload_times:
            # Every one trained, with nothing to keep and no window to miss: each still in flight uploads.
            _push_all(state.agenda, _uploads_due(state, due, outcomes, cast(list[float], upload_times), self.live))
            return
        failed_now: list[int] = []
        uploads: list[tuple[float, int, int, int]] = []  # put on the agenda together
        live = self.live
        try:
            for i, outcome, upload_s in zip(due, outcomes, upload_times, strict=True):
                if upload_s is None:  # its training raised
                    if not isinstance(outcome, Exception):
                        raise outcome
                    state.failures[i] = _training_failure(outcome)
                    if done_at[i] == when:
                        failed_now.append(i)
                    else:  # published at the task's own completion time
                        heapq.heappush(state.agenda, (done_at[i], i, _FAILED, i))
                elif live(tasks[i]):  # else released meanwhile: nothing to send
                    self._schedule_upload(state, i, outcome, upload_s, kept, uploads)
        finally:  # those kept so far, also when an outcome is raised
            debug_many(world.log, "client", lines)
            _push_all(state.agenda, uploads)
        await self._publish_failures(state, failed_now)

    def _schedule_upload(
        self,
        state: _GroupState,
        i: int,
        trained: TrainedUpdate,
        upload_s: float,
        lines: list[dict[str, Any]] | None,
        uploads: list[tuple[float, int, int, int]],
    ) -> None:
        """Put task ``i``'s upload among ``uploads`` at its time, unless its client goes offline before it is sent
        (then its failure goes on the agenda); keep what its plug-in parts hand back and add its debug line to
        ``lines`` (None: nothing to keep)."""
        plan = state.plan
        if self.secure is not None:
            upload_s = 0.0  # the update waits on the client for its group
        up_at = plan.done_at[i] + upload_s
        if plan.offline is not None and plan.offline[i] < up_at:
            state.failures[i] = ("offline", "availability window closed during upload", None)
            heapq.heappush(state.agenda, (plan.offline[i], i, _FAILED, i))
            return
        if lines is not None:
            _keep(self.world, state.tasks[i], state.model, plan, i, trained, lines)
        state.uploads[i] = (trained, upload_s)
        uploads.append((up_at, state.order, _UPLOAD, i))
        state.order += 1

    async def _publish_failures(self, state: _GroupState, due: list[int]) -> None:
        """Publish now the failures of the tasks ``due`` that are still in flight."""
        world = self.world
        for i in due:
            task = state.tasks[i]
            kind, error, diagnosis = state.failures.pop(i)
            if self.live(task):
                await world.bus.publish(_failed(world, task, kind, error, diagnosis, **_context(task)))

    async def _hold(self, room: SecureRoom, state: _GroupState, when: float, due: list[int]) -> None:
        """Hand the updates of the tasks ``due`` at ``when`` to their clients' wait for a secure group (the client
        decodes its own encoded delta: the float update never leaves it)."""
        world = self.world
        await world.clock.sleep_until(when)
        codec, num_params = world.job.upload_codec, world.job.num_params
        for i in due:
            task, (trained, _) = state.tasks[i], state.uploads.pop(i)
            if self.live(task):
                delta = codec.decode(trained.payload, expected_elements=num_params)
                room.hold(task, delta, trained.result.num_samples, when)

    async def _upload_together(self, state: _GroupState, when: float, due: list[int]) -> None:
        """Publish at ``when`` the uploads due then (with ``gather``, and those due later when the clock has nothing
        else before them), as one batch where every receiver takes it."""
        world = self.world
        clock, bus = world.clock, world.bus
        # Under virtual time this waits until ``when``; real time counts the upload from the end of the training.
        await clock.elapse(state.uploads[due[0]][1], until=when)
        times = [clock.now()] * len(due)
        if self.gather:
            later = _quiet_uploads(state.agenda, clock)
            if later:
                await clock.sleep_until(later[-1][0])
                due += [i for _, i in later]
                times += [at for at, _ in later]
        prepared: list[object] = []
        sent = _uploads(world, state, due, times, self.live, prepared)
        # As one batch where every receiver takes it (the server decodes and checks them together, or takes each
        # delta as the worker decoded and checked it with its cohort's); a lone upload its worker decoded goes as a
        # batch of one, which carries its entry.
        to = sent[0].to if sent else None
        ready = tuple(prepared) if prepared and None not in prepared else None
        if (
            (len(sent) > 1 or ready is not None)
            and all(message.to == to for message in sent)
            and bus.batches_reach(UpdatesUploaded, UpdateUploaded, to)
        ):
            await bus.publish(UpdatesUploaded.of(tuple(sent), ready))
            return
        for message in sent:
            await bus.publish(message)


_HANGS = _Fault(math.inf, ("error", "hangs", None))
"""A task that never answers (the registry times it out)."""


def _fault(
    faults: FaultModel, task: TaskAssigned, download_s: float, simulated: float, done_at: float, offline_at: float
) -> _Fault | None:
    """Return how the fault model ends ``task`` (its download and training seconds, and when its training ends)
    before it trains to the end (:data:`_HANGS`: never answers), or None when it trains (a Byzantine client trains
    and attacks)."""
    fate = faults.fate(task.client_id, task.participation)
    if fate.fate is Fate.HANG:
        return _HANGS
    if fate.fate is Fate.DROPOUT:
        error = f"dropped out after {fate.fraction:.0%} of training"
        return _Fault(task.simulated_s + (download_s + fate.fraction * simulated), ("dropout", error, None))
    if offline_at < done_at:
        return _Fault(offline_at, ("offline", "availability window closed during training", None))
    if fate.fate is Fate.CRASH:
        # What a worker's training error would be: the injected fault, at its fraction of the training.
        at = task.simulated_s + (download_s + fate.fraction * simulated)
        return _Fault(at, _training_failure(injected_fault(fate.fraction)))
    return None


@dataclass(slots=True, kw_only=True)
class _GroupState:
    """What a :class:`CohortClients` group keeps while its tasks run: their plan and jobs, and what is due next."""

    tasks: Sequence[TaskAssigned]
    model: ModelSnapshot
    plan: _Plan
    jobs: dict[int, Started[Any]]
    """Task index -> its started job (:data:`_ALL`: the group's one future for every job)."""
    agenda: list[tuple[float, int, int, int]]
    """Entries ``(time, order, kind, task index)``, a heap."""
    order: int
    """The order the next upload put on the agenda takes."""
    uploads: dict[int, tuple[TrainedUpdate, float]] = field(default_factory=dict)
    """Task index -> its trained update and upload seconds, until it is published."""
    failures: dict[int, tuple[FailureKind, str, TaskDiagnosis | None]] = field(default_factory=dict)
    """Task index -> how it failed (kind, one-line error, diagnosis), until it is published."""
    batches: bool = False
    """The jobs were submitted to a :class:`~flasync.training.executors.LoopExecutor`: each future gives a list."""


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


def _uploads(
    world: ClientWorld,
    state: _GroupState,
    due: list[int],
    times: list[float],
    live: Callable[[TaskAssigned], bool],
    prepared: list[object] | None = None,
) -> list[UpdateUploaded]:
    """Return the uploads of the trained tasks ``due``, sent at virtual ``times`` (a batch of uploads sent at several
    times is handed over at the last of them) and now in real time, of those whose tasks are still in flight (``live``),
    in order; take them from ``state``, and append each one's decoding made ahead (or None) to ``prepared``."""
    tasks, model, plan, uploads, wall = state.tasks, state.model, state.plan, state.uploads, world.wall()
    download_bytes, download_s, simulated = model.download_bytes, plan.download_s, plan.simulated
    make = _MAKE_UPLOAD
    sent = []
    for i, at in zip(due, times, strict=True):
        trained, upload_s = uploads.pop(i)
        task = tasks[i]
        if not live(task):
            continue
        result = trained.result
        if prepared is not None:
            prepared.append(trained.prepared)
        sent.append(
            make(  # the fields in their order (flasync.core.events.positional)
                task.reply_to,
                task.task_id,
                task.client_id,
                task.base_version,
                result.num_samples,
                trained.payload,
                result.loss,
                at,
                wall,
                "client",
                result.train_s,
                trained.encode_s,
                download_s[i],
                simulated[i],
                upload_s,
                download_bytes,
                result.peak_mem_bytes,
                trained.diagnosis,
                trained.extra,
            )
        )
    return sent


def _uploads_due(
    state: _GroupState,
    due: list[int],
    trained: list[TrainedUpdate],
    upload_times: list[float],
    live: Callable[[TaskAssigned], bool],
) -> list[tuple[float, int, int, int]]:
    """Keep the trained updates of the tasks ``due`` that are still in flight in ``state`` and return their agenda
    entries, numbered in order (what :meth:`CohortClients._schedule_upload` does for each, where nothing is kept
    and no client goes offline)."""
    tasks, done_at, order = state.tasks, state.plan.done_at, state.order
    if len(trained) != len(due) or len(upload_times) != len(due):
        raise ValueError("every task due needs its trained update and its upload seconds")
    asked = list(map(live, map(tasks.__getitem__, due)))  # each task asked once, in order
    if not all(asked):  # some released meanwhile: nothing to send for them
        due, trained, upload_times = (
            list(compress(due, asked)),
            list(compress(trained, asked)),
            list(compress(upload_times, asked)),
        )
    state.uploads.update(zip(due, zip(trained, upload_times, strict=True), strict=True))
    end = state.order = order + len(due)
    ends = map(operator.add, map(done_at.__getitem__, due), upload_times)
    return list(zip(ends, range(order, end), repeat(_UPLOAD), due))


def _upload_times(
    network: Network, tasks: Sequence[TaskAssigned], due: Sequence[int], outcomes: Sequence[Any]
) -> list[float | None]:
    """Return the upload seconds of each of the tasks ``due`` (indices into ``tasks``), from one call: None for
    those whose outcome is an exception."""
    trained = [k for k, o in enumerate(outcomes) if not isinstance(o, BaseException)]
    if len(trained) == len(outcomes):  # every one trained
        seconds: list[Any] = network.upload_seconds_many(
            [tasks[i].client_id for i in due], [o.upload_bytes for o in outcomes]
        )
        return seconds
    times: list[float | None] = [None] * len(outcomes)
    made = network.upload_seconds_many(
        [tasks[due[k]].client_id for k in trained], [outcomes[k].upload_bytes for k in trained]
    )
    for k, upload_s in zip(trained, made, strict=True):
        times[k] = upload_s
    return times


def _push_all(agenda: list[tuple[float, int, int, int]], entries: list[tuple[float, int, int, int]]) -> None:
    """Put ``entries`` on the heap ``agenda`` (one heapify for many: entries are distinct, so what the heap gives
    and in which order does not depend on how they were put)."""
    if len(entries) > 8:
        agenda += entries
        heapq.heapify(agenda)
    else:
        for entry in entries:
            heapq.heappush(agenda, entry)


_ALL_TRAINED, _TRAINED, _FAILED, _UPLOAD = range(4)  # what a group's agenda entry waits for
_ALL = -1  # the key of the group's one future among its jobs


def _context(task: TaskAssigned) -> dict[str, int]:
    """The log fields of a task's lines."""
    return {"client_id": int(task.client_id), "base_version": int(task.base_version)}
