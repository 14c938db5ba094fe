"""Where local training runs: worker threads that each reuse one model.

PyTorch releases the GIL inside its kernels, so a small pool of threads overlaps client training without
pickling models or data between processes. Each worker thread builds its model once, on first use, and reuses it
for every client it trains (weights are loaded with one ``copy_``).

Each worker also gets its own intra-op thread count: with torch's OpenMP backend, ``torch.set_num_threads`` called in
a thread sizes that thread's OpenMP team. The default of one is what small FL models want: an intra-op team per
worker would spin on the cores the event loop and the other workers need, which measured 3.6x slower per client on
two cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, cast

import torch
from torch import nn

from flasync.core import seeding
from flasync.core.clock import VirtualClock
from flasync.training.cohort import CohortMember, CohortResult, CohortTrainer
from flasync.training.executors import LoopExecutor
from flasync.training.local import FlatModel, LocalResult, LocalTraining

__all__ = [
    "CohortBatcher",
    "ModelPool",
    "StreamKey",
    "ThreadTrainingExecutor",
    "TrainingExecutor",
    "TrainingJob",
    "cohorts_for",
    "resolve_device",
    "task_stream",
]

T = TypeVar("T")

StreamKey = tuple[int, int, int, int]
"""A random stream named by its key, ``(seed, purpose, id, counter)``: the stream of
:func:`~flasync.core.seeding.stream_seed` ``(seed, purpose, id, counter)``, made where it is drawn from."""


def task_stream(generator: torch.Generator | int | StreamKey) -> torch.Generator:
    """Return a task's random stream: ``generator`` itself, or a fresh one seeded with the seed given, or with the
    seed of the key given (:data:`StreamKey`)."""
    if isinstance(generator, torch.Generator):
        return generator
    if isinstance(generator, tuple):
        generator = seeding.stream_seed(*generator)
    return seeding.torch_generator(generator)


def _streams(jobs: Sequence[TrainingJob[Any]]) -> list[torch.Generator]:
    """Return each job's :meth:`~TrainingJob.stream`; the seeds of jobs keyed under one seed and purpose are mixed
    together (:func:`~flasync.core.seeding.stream_seeds`: the same seeds)."""
    keys = [job.generator for job in jobs]
    first = keys[0]
    if isinstance(first, tuple) and all(isinstance(key, tuple) and key[:2] == first[:2] for key in keys):
        keyed = cast(list[StreamKey], keys)
        seeds = seeding.stream_seeds(first[0], first[1], [key[2] for key in keyed], [key[3] for key in keyed])
        return [seeding.torch_generator(seed) for seed in seeds]
    return [job.stream() for job in jobs]


def resolve_device(spec: str) -> torch.device:
    """Turn ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` into a device that exists here.

    Raises:
        ValueError: If a CUDA device is asked for and this machine has none (or not that many).
    """
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r} was asked for but CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {spec!r} does not exist: this machine has {torch.cuda.device_count()} GPU(s)")
    return device


class ModelPool:
    """One :class:`FlatModel` per worker thread, built lazily from a factory, on ``device``."""

    def __init__(self, factory: Callable[[], nn.Module], device: torch.device | str = "cpu") -> None:
        """Remember the factory; nothing is built yet."""
        self._factory = factory
        self.device = torch.device(device)
        self._local = threading.local()
        self._lock = threading.Lock()
        self.built = 0

    def get(self) -> FlatModel:
        """Return the calling thread's model, building it on first use."""
        model: FlatModel | None = getattr(self._local, "model", None)
        if model is None:
            model = FlatModel(self._factory().to(self.device))
            self._local.model = model
            with self._lock:
                self.built += 1
        return model

    def cohort_trainer(self) -> CohortTrainer:
        """Return the calling thread's vectorized trainer, building it on first use."""
        trainer: CohortTrainer | None = getattr(self._local, "trainer", None)
        if trainer is None:
            trainer = CohortTrainer(self._factory().to(self.device))
            self._local.trainer = trainer
        return trainer


@dataclass(slots=True, kw_only=True, eq=False)
class TrainingJob(Generic[T]):
    """One client's local training, in a form a :class:`CohortBatcher` can batch with others.

    Not frozen, though nothing changes a job once made: one is made per task on the event loop, and a frozen
    dataclass's constructor costs several times a plain one's.

    Called directly (by any executor) it runs ``solo`` (or ``alone`` of itself), which trains the client alone. A
    batcher instead trains the jobs that share data layout and hyper-parameters as one cohort (each row from its own
    ``base``) and calls each job's ``finish`` with its own :class:`LocalResult`; ``solo()`` must equal
    ``finish(train(...))`` of the same client.

    Attributes:
        base: Flat weights the client starts from.
        x: The data set's inputs; ``indices`` select the client's samples.
        y: The data set's labels.
        indices: The client's sample indices (int64), or, with ``span``, the tensor they are a slice of.
        cfg: Local hyper-parameters.
        generator: The task's random stream (batch order), or the seed of one (one of
            :func:`~flasync.core.seeding.stream_seeds`), or its key (:data:`StreamKey`): the stream is then made
            where the job trains, off the event loop (see :meth:`stream`).
        finish: Turns the training result into what the job returns (e.g. encodes the delta); runs in the worker.
        solo: Trains this client alone and finishes (None: ``alone`` does).
        correction: Added to every gradient of the client (a plug-in's correction; None: nothing).
        client: The client of a lazily drawn population, whose samples an executor may draw itself instead of
            receiving ``x`` and ``y`` (None: the samples are rows of a data set held in memory).
        deltas_on: Where ``finish`` wants the trained delta (None: where it was trained). A cohort whose jobs all
            want it on the host copies its deltas there in one transfer.
        finish_many: Finishes the jobs of one cohort together from the cohort's result: what ``finish`` of each
            job with its own result returns, or the exception it raises, in the jobs' order. A batcher calls it
            where every job of a cohort has this same function (None: ``finish`` each).
        span: Where the client's sample indices lie in ``indices``: positions ``[start, stop)``, sliced where the
            job trains (:meth:`rows`), off the event loop (None: ``indices`` are the client's).
        alone: Trains a job alone from its own attributes and finishes, where ``solo`` is None: one function for
            every job of its kind, so that a job made per task need not carry a closure of its own.
    """

    base: torch.Tensor
    x: torch.Tensor
    y: torch.Tensor
    indices: torch.Tensor
    cfg: LocalTraining
    generator: torch.Generator | int | StreamKey
    finish: Callable[[LocalResult], T]
    solo: Callable[[], T] | None = None
    correction: torch.Tensor | None = None
    client: int | None = None
    deltas_on: torch.device | None = None
    finish_many: Callable[[Sequence[TrainingJob[T]], CohortResult], Sequence[T | Exception]] | None = None
    span: tuple[int, int] | None = None
    alone: Callable[[TrainingJob[T]], T] | None = None

    @classmethod
    def of(
        cls,
        base: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        indices: torch.Tensor,
        cfg: LocalTraining,
        generator: torch.Generator | int | StreamKey,
        finish: Callable[[LocalResult], T],
        solo: Callable[[], T] | None,
        correction: torch.Tensor | None,
        client: int | None,
        deltas_on: torch.device | None,
        finish_many: Callable[[Sequence[TrainingJob[T]], CohortResult], Sequence[T | Exception]] | None,
        span: tuple[int, int] | None,
        alone: Callable[[TrainingJob[T]], T] | None,
        /,
    ) -> TrainingJob[T]:
        """Return the job the constructor makes of these fields (every one given, in the order of the attributes),
        without its handling of keyword arguments: a client makes one per task on the event loop."""
        job = object.__new__(cls)
        job.base = base
        job.x = x
        job.y = y
        job.indices = indices
        job.cfg = cfg
        job.generator = generator
        job.finish = finish
        job.solo = solo
        job.correction = correction
        job.client = client
        job.deltas_on = deltas_on
        job.finish_many = finish_many
        job.span = span
        job.alone = alone
        return job

    def __call__(self) -> T:
        """Train this client alone and finish.

        Raises:
            TypeError: If the job has neither ``solo`` nor ``alone``.
        """
        if self.solo is not None:
            return self.solo()
        if self.alone is None:
            raise TypeError("a TrainingJob needs solo or alone to train by itself")
        return self.alone(self)

    def stream(self) -> torch.Generator:
        """Return the task's random stream: the generator given, or a fresh one seeded with the seed (or the key's)
        given."""
        return task_stream(self.generator)

    def rows(self) -> torch.Tensor:
        """Return the client's sample indices: :attr:`indices`, or their :attr:`span` of it (a view, no copy)."""
        span = self.span
        return self.indices if span is None else self.indices[span[0] : span[1]]

    @property
    def group(self) -> Hashable:
        """Jobs with equal groups can train as one cohort (their data and bases may differ)."""
        return (self.cfg, self.x.device, self.x.dtype, tuple(self.x.shape[1:]))


def _cohort_data(jobs: list[TrainingJob[Any]]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Return one data pair for a cohort: the jobs' shared tensors, or their own samples concatenated."""
    first = jobs[0]
    if all(job.x is first.x and job.y is first.y for job in jobs):
        return first.x, first.y, [job.rows() for job in jobs]
    rows = [job.rows() for job in jobs]
    xs = [job.x[part] for job, part in zip(jobs, rows, strict=True)]
    ys = [job.y[part] for job, part in zip(jobs, rows, strict=True)]
    parts, offset = [], 0
    for part in ys:
        parts.append(torch.arange(offset, offset + len(part), device=part.device))
        offset += len(part)
    return torch.cat(xs), torch.cat(ys), parts


class _Group:
    """A :attr:`TrainingJob.group` whose hash is taken once (a job's hash the configuration's every field)."""

    __slots__ = ("_hash", "key")

    def __init__(self, key: Hashable) -> None:
        self.key = key
        self._hash = hash(key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Group) and (other is self or (self._hash == other._hash and self.key == other.key))


class _HeldFuture(Future[T]):
    """A job's future that knows whether its job is still held back by the batcher."""

    def __init__(self) -> None:
        super().__init__()
        self.held = True


class _GroupFuture(asyncio.Future[list[Any]]):
    """One loop future for a group of held jobs (:meth:`CohortBatcher.submit_many_async`): each job's result or
    exception, in submission order, once every job is done. Its jobs' results reach it on its loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, size: int) -> None:
        super().__init__(loop=loop)
        self.outcomes: list[Any] = [None] * size
        self.left = size
        self.held_jobs = 0  # jobs still held back by the batcher (changed on the loop's thread, as jobs start)

    @property
    def held(self) -> bool:
        """Tell whether a job of the group is still held back (the clock needing the group starts them)."""
        return self.held_jobs > 0

    def deliver(self, index: int, outcome: Any) -> None:
        """Record one job's result or exception; resolve the group with the last."""
        self.deliver_run(index, [outcome])

    def deliver_run(self, start: int, outcomes: list[Any]) -> None:
        """Record the results or exceptions of the jobs ``start``, ``start + 1``, ... in one step; resolve the group
        with the last."""
        self.outcomes[start : start + len(outcomes)] = outcomes
        self.left -= len(outcomes)
        if not self.left:
            self.set_result(self.outcomes)


class _Slot:
    """A job's place in a :class:`_GroupFuture`, standing in for the job's own loop future in the batcher."""

    __slots__ = ("group", "index")

    def __init__(self, group: _GroupFuture, index: int) -> None:
        self.group = group
        self.index = index

    @property
    def held(self) -> bool:
        """Whether a job of the group is still held back."""
        return self.group.held

    @held.setter
    def held(self, value: bool) -> None:
        if not value:  # this job starts
            self.group.held_jobs -= 1

    def cancelled(self) -> bool:
        """Tell whether the group was cancelled."""
        return self.group.cancelled()

    def done(self) -> bool:
        """Tell whether the group is done (cancelled, or every job delivered)."""
        return self.group.done()

    def cancel(self) -> bool:
        """Cancel the whole group (its client gave up on every job)."""
        return self.group.cancel()

    def get_loop(self) -> asyncio.AbstractEventLoop:
        """The loop the group's future belongs to."""
        return self.group.get_loop()

    def set_result(self, value: Any) -> None:
        """Deliver the job's result (on the group's loop)."""
        self.group.deliver(self.index, value)

    def set_exception(self, error: BaseException) -> None:
        """Deliver the job's exception (on the group's loop)."""
        self.group.deliver(self.index, error)


_AnyHeld = _HeldFuture[Any] | _Slot
_Outcome = tuple[_Slot, Any, BaseException | None]
_Run = tuple[_GroupFuture, int, list[Any]]
"""Outcomes of consecutive jobs of one group: the group, the first job's index and each job's result or exception."""

# Results handed to the event loop per callback: the loop starts on the first ones while the worker finishes the rest.
_DELIVERY_CHUNK = 64


def _runs(outcomes: list[_Outcome]) -> dict[asyncio.AbstractEventLoop, list[_Run]]:
    """Return ``outcomes`` (in a worker) as runs of consecutive jobs of one group each, by their groups' loops."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Run]] = {}
    group: _GroupFuture | None = None
    values: list[Any] = []
    following = 0
    for slot, value, error in outcomes:
        if slot.group is not group or slot.index != following:
            group, values = slot.group, []
            by_loop.setdefault(group.get_loop(), []).append((group, slot.index, values))
        values.append(value if error is None else error)
        following = slot.index + 1
    return by_loop


def _settle(runs: list[_Run]) -> None:
    """Deliver runs of jobs' results to their groups' loop futures (on their loop); a group cancelled meanwhile is
    left as it is."""
    for group, start, values in runs:
        if not group.done():
            group.deliver_run(start, values)


class _Delivery:
    """Hands a cohort's results to their futures: loop futures in chunks, thread futures one by one."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending: list[_Outcome] = []

    def __call__(self, future: _AnyHeld, value: Any, error: BaseException | None) -> None:
        if isinstance(future, _Slot):
            self._pending.append((future, value, error))
            if len(self._pending) >= _DELIVERY_CHUNK:
                self.flush()
        elif error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def flush(self) -> None:
        if not self._pending:
            return
        outcomes, self._pending = self._pending, []
        for loop, runs in _runs(outcomes).items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody awaits these any more
                loop.call_soon_threadsafe(_settle, runs)


def _cancel(future: _AnyHeld) -> None:
    """Cancel a held future from any thread (a loop future on its own loop)."""
    if isinstance(future, _Slot):
        with contextlib.suppress(RuntimeError):  # a closed loop
            future.get_loop().call_soon_threadsafe(future.cancel)
    else:
        future.cancel()


@dataclass(slots=True)
class _Held:
    jobs: list[TrainingJob[Any]] = field(default_factory=list)
    futures: list[_AnyHeld] = field(default_factory=list)


def _split(held: _Held, parts: int) -> list[_Held]:
    """Return ``held`` cut into ``parts`` runs of consecutive jobs of nearly equal size (itself for one part)."""
    if parts <= 1:
        return [held]
    size, extra = divmod(len(held.jobs), parts)
    cuts, start = [], 0
    for k in range(parts):
        stop = start + size + (1 if k < extra else 0)
        cuts.append(_Held(held.jobs[start:stop], held.futures[start:stop]))
        start = stop
    return cuts


def cohorts_for(jobs: int, *, parallel: int, member_cpu_s: float | None, min_split: int, min_part_s: float) -> int:
    """Return how many cohorts a group of ``jobs`` jobs is split into: at most ``parallel``, each of at least
    ``min_split`` members and, when a member's training CPU is known (``member_cpu_s``), of at least ``min_part_s``
    seconds of CPU; at least one."""
    parts = min(parallel, jobs // min_split)
    if parts > 1 and member_cpu_s and min_part_s > 0:
        parts = min(parts, int(jobs * member_cpu_s / min_part_s))
    return max(parts, 1)


def _init_worker(threads: int, default: int, device: torch.device | None = None) -> None:
    """Size this worker's OpenMP team (leaving torch's default for other threads as it was); give it a CUDA stream.

    On CUDA each worker gets its own stream, so that several workers train clients concurrently on one GPU (the
    current stream is per thread in PyTorch; :func:`flasync.training.local.train` orders its work after the default
    stream's).
    """
    if device is not None and device.type == "cuda":
        torch.cuda.set_stream(torch.cuda.Stream(device=device))  # type: ignore[no-untyped-call]
    # torch sizes a thread's team from the process default on the thread's first parallel call; make that happen
    # now, or it would later undo the size set below.
    torch.get_num_threads()
    torch.set_num_threads(threads)
    # set_num_threads also stores the count that threads created later start with; a throwaway thread puts that
    # default back without touching this worker's own team.
    restore = threading.Thread(target=torch.set_num_threads, args=(default,), name="flasync-threads-restore")
    restore.start()
    restore.join()


class CohortBatcher(LoopExecutor):
    """An executor that holds :class:`TrainingJob` submissions back and runs those sharing a base as one cohort.

    Anything else submitted goes straight to the inner pool. Held jobs start when :meth:`flush` is called: by the
    virtual clock when it has to wait for real work (so cohorts depend on virtual times only, and runs stay
    deterministic), after a few quiet event-loop passes under real time, or as soon as a group reaches
    ``max_cohort``. A group started with at least ``2 * MIN_SPLIT`` jobs is split into up to ``parallel`` cohorts
    of nearly equal size, which the pool's threads train side by side (a member's result does not depend on which
    cohort it trains in), as long as each would train for at least ``MIN_PART_S`` seconds of CPU at the pace of
    the cohorts trained so far on the CPU. Each job's future is resolved with its own result, or its own exception.

    Args:
        inner: The worker pool that runs cohorts.
        models: Per-thread models and vectorized trainers.
        max_cohort: Largest number of clients trained in one vectorized call.
        on_fallback: Called (in a worker thread) with the reason whenever a cohort had to be trained one client
            at a time.
        settle_passes: Quiet event-loop passes before held jobs start, when no clock drives :meth:`flush`.
        train_cohort: Trains a cohort elsewhere, ``(base, x, y, members, cfg, jobs) -> CohortResult`` (e.g. on a Ray
            actor), every member from ``base``: jobs of different bases then never share a cohort. None: on the
            calling worker's own vectorized trainer, which starts each member from its own job's base, so that
            asynchronous clients dispatched at different versions train together.
        run_job: Runs a cohort of one (default: the job itself, trained on the worker).
        passthrough: Where submissions other than training jobs go (default: ``inner``).
        parallel: Cohorts the inner pool trains at once (its threads): a large group is split into that many.
        cpu_time: The calling thread's CPU seconds (what a cohort's pace is measured with).
    """

    MIN_SPLIT = 32
    """Fewest members of a cohort split off a large group (smaller cohorts gain little from their batching)."""

    MIN_PART_S = 0.012
    """Least CPU a cohort split off a group should train for, in seconds. A cohort's step is a few dozen tensor calls
    whatever its size, and two threads that make small calls at once spend on the GIL's hand-overs what the second
    core gives them. On 2 cores (``benchmarks/cohort_split.py``): the tutorial MLP's group of 64 trained as two
    cohorts side by side took 0.78x the speed of one cohort on one thread, of 100 0.98x, of 160 (8 ms of CPU a
    cohort) 1.26x; the CNN's, at 1.4 ms a member, 1.76x from 64 on."""

    def __init__(
        self,
        inner: Executor,
        models: ModelPool,
        *,
        max_cohort: int = 256,
        on_fallback: Callable[[str], None] | None = None,
        settle_passes: int = 2,
        train_cohort: Callable[..., CohortResult] | None = None,
        run_job: Callable[[TrainingJob[Any]], Any] | None = None,
        passthrough: Executor | None = None,
        parallel: int = 1,
        cpu_time: Callable[[], float] = time.thread_time,
    ) -> None:
        """Hold nothing yet."""
        if max_cohort < 1:
            raise ValueError(f"max_cohort must be >= 1, got {max_cohort}")
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel}")
        self.parallel = parallel
        self.inner = inner
        self.train_cohort = train_cohort
        self.run_job = run_job
        self.passthrough = passthrough if passthrough is not None else inner
        self.models = models
        self.max_cohort = max_cohort
        self.on_fallback = on_fallback
        self._settle_passes = settle_passes
        self._held: dict[Hashable, _Held] = {}
        self._lock = threading.Lock()
        self._driven = False
        self._scheduled = False
        self._submitted = 0
        self.cohorts = 0
        self.vectorized_clients = 0
        self.fallback_clients = 0
        self._cpu_time = cpu_time
        self._member_cpu_s: float | None = None  # CPU seconds per member of the last cohort trained here
        self._last_group: tuple[LocalTraining, torch.Tensor, _Group] | None = None

    def attach(self, clock: object) -> None:
        """Let a virtual clock start held jobs when the first of them is needed (real time: no-op)."""
        if isinstance(clock, VirtualClock):
            clock.on_wait(self._needed)
            self._driven = True

    def _needed(self, future: object) -> None:
        """Start every held job if ``future`` is one of them (the clock cannot go on without its result)."""
        if isinstance(future, _HeldFuture | _GroupFuture) and future.held:
            self.flush()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Hold a :class:`TrainingJob`; pass anything else to the inner pool."""
        if not isinstance(fn, TrainingJob) or args or kwargs:
            return self.passthrough.submit(fn, *args, **kwargs)
        future: _HeldFuture[T] = _HeldFuture()
        self._hold(fn, future)
        return future

    def _group(self, fn: TrainingJob[Any]) -> Hashable:
        """Return ``fn.group``, made and hashed once for the jobs of one configuration and data set (call locked)."""
        last = self._last_group
        if last is not None and last[0] is fn.cfg and last[1] is fn.x:
            return last[2]
        group = _Group(fn.group)
        self._last_group = (fn.cfg, fn.x, group)
        return group

    def submit_many_async(self, jobs: Sequence[TrainingJob[Any]]) -> asyncio.Future[list[Any]]:
        """Hold training jobs together (one or many); return one future of the running loop for all of them.

        It resolves, once every job is done, with each job's result or exception (as a value) in the order of
        ``jobs``, without a loop future, a done callback and a result hand-over per job: a cohort's results reach the
        loop in a few callbacks, not one cross-thread wake-up per client. Cancelling it cancels every job that has
        not started.
        """
        group = _GroupFuture(asyncio.get_running_loop(), len(jobs))
        if not jobs:
            group.set_result([])
            return group
        group.held_jobs = len(jobs)
        self._hold_many(jobs, [_Slot(group, index) for index in range(len(jobs))])
        return group

    def _hold(self, fn: TrainingJob[Any], future: _AnyHeld) -> None:
        self._hold_many((fn,), (future,))

    def _hold_many(self, jobs: Sequence[TrainingJob[Any]], futures: Sequence[_AnyHeld]) -> None:
        """Hold each job with its future, in order, under one acquisition of the lock; start the groups that fill.

        Consecutive jobs of one configuration and data set (and one base, where cohorts train elsewhere), told apart
        by identity, join their held group a slice at a time, as they would one by one.
        """
        full: list[_Held] = []
        with self._lock:
            held_by_group = self._held
            start, count = 0, len(jobs)
            while start < count:
                stop = self._run_end(jobs, start)
                group = self._key(jobs[start])
                while start < stop:
                    held = held_by_group.get(group)
                    if held is None:  # not setdefault: it would build a _Held per slice
                        held = held_by_group[group] = _Held()
                    end = min(stop, start + self.max_cohort - len(held.jobs))
                    held.jobs += jobs[start:end]
                    held.futures += futures[start:end]
                    start = end
                    if len(held.jobs) >= self.max_cohort:
                        del held_by_group[group]
                        full.append(held)
            self._submitted += count
            waiting = bool(held_by_group)
        for held in full:
            self._launch(held)
        if waiting and not self._driven and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._tick, self._submitted, 0)

    def _key(self, fn: TrainingJob[Any]) -> Hashable:
        """Return the key of the held group a job joins (call locked)."""
        return self._group(fn) if self.train_cohort is None else (id(fn.base), self._group(fn))

    def _run_end(self, jobs: Sequence[TrainingJob[Any]], start: int) -> int:
        """Return where the run of jobs from ``jobs[start]`` that share its configuration and data set (and its base,
        where cohorts train elsewhere), by identity, ends: they all join one held group."""
        first = jobs[start]
        cfg, x, base, bases = first.cfg, first.x, first.base, self.train_cohort is not None
        end = start + 1
        while end < len(jobs) and (job := jobs[end]).cfg is cfg and job.x is x and (not bases or job.base is base):
            end += 1
        return end

    def _tick(self, mark: int, quiet: int) -> None:
        quiet = quiet + 1 if self._submitted == mark else 0
        if quiet >= self._settle_passes:
            self._scheduled = False
            self.flush()
        else:
            asyncio.get_running_loop().call_soon(self._tick, self._submitted, quiet)

    def flush(self) -> None:
        """Start every held job now: one cohort per group, or up to ``parallel`` for a large group."""
        with self._lock:
            groups = list(self._held.values())
            self._held.clear()
        for held in groups:
            self._launch(held)

    def _launch(self, held: _Held) -> None:
        """Start a group as one cohort, or as up to ``parallel`` cohorts trained side by side if it is large."""
        for part in _split(held, self.parts(len(held.jobs))):
            self._start(part)

    def parts(self, jobs: int) -> int:
        """Return how many cohorts a group of ``jobs`` jobs trains as (:func:`cohorts_for`, at the pace of the last
        cohort trained here)."""
        return cohorts_for(
            jobs,
            parallel=self.parallel,
            member_cpu_s=self._member_cpu_s,
            min_split=self.MIN_SPLIT,
            min_part_s=self.MIN_PART_S,
        )

    def _start(self, held: _Held) -> None:
        for future in held.futures:
            future.held = False
        started = self.inner.submit(self._run, held)

        def cancelled(done: Future[None]) -> None:
            if done.cancelled():  # the pool shut down before the cohort started: its jobs never will
                for future in held.futures:
                    _cancel(future)

        started.add_done_callback(cancelled)

    def _run(self, held: _Held) -> None:
        jobs: list[TrainingJob[Any]] = []
        futures: list[_AnyHeld] = []
        for job, future in zip(held.jobs, held.futures, strict=True):
            # Skip jobs whose client was cancelled meanwhile (a loop future cancelled after this read is trained,
            # and its result dropped on delivery).
            live = not future.cancelled() if isinstance(future, _Slot) else future.set_running_or_notify_cancel()
            if live:
                jobs.append(job)
                futures.append(future)
        if not jobs:
            return
        deliver = _Delivery()
        try:
            self._train(jobs, futures, deliver)
        finally:
            deliver.flush()

    def _train(self, jobs: list[TrainingJob[Any]], futures: list[_AnyHeld], deliver: _Delivery) -> None:
        if len(jobs) == 1:
            deliver(futures[0], *self._resolve(jobs[0], None))
            return
        try:
            first = jobs[0]
            x, y, parts = _cohort_data(jobs)
            members = [
                CohortMember(
                    indices=part,
                    generator=generator,
                    correction=job.correction,
                    base=None if job.base is first.base else job.base,
                )
                for job, part, generator in zip(jobs, parts, _streams(jobs), strict=True)
            ]
            if self.train_cohort is not None:
                outcome = self.train_cohort(first.base, x, y, members, first.cfg, jobs)
            else:
                trainer = self.models.cohort_trainer()
                began = self._cpu_time()  # CPU, not wall: waiting for the GIL or a core does not count
                wanted = first.deltas_on
                deltas_on = wanted if all(job.deltas_on == wanted for job in jobs) else None
                outcome = trainer.train(first.base, x, y, members, first.cfg, deltas_on=deltas_on)
                if trainer.device.type == "cpu":  # on an accelerator the CPU only launches the kernels
                    self._member_cpu_s = (self._cpu_time() - began) / len(members)
        except Exception as exc:
            for future in futures:
                deliver(future, None, exc)
            return
        self.cohorts += 1
        if outcome.vectorized:
            self.vectorized_clients += len(jobs)
        else:
            self.fallback_clients += len(jobs)
            if self.on_fallback is not None and outcome.fallback_reason is not None:
                self.on_fallback(outcome.fallback_reason)
        finish_many = first.finish_many
        if finish_many is not None and all(job.finish_many is finish_many for job in jobs):
            try:
                finished = finish_many(jobs, outcome)
            except Exception as exc:
                for future in futures:
                    deliver(future, None, exc)
                return
            for future, value in zip(futures, finished, strict=True):
                if isinstance(value, Exception):
                    deliver(future, None, value)
                else:
                    deliver(future, value, None)
            return
        for job, future, result in zip(jobs, futures, outcome.results, strict=True):
            deliver(future, *self._resolve(job, result))

    def _resolve(self, job: TrainingJob[Any], result: LocalResult | None) -> tuple[Any, BaseException | None]:
        """Return ``(value, None)`` of a job (finished from its cohort's ``result``, or run alone), or its error."""
        try:
            if result is not None:
                return job.finish(result), None
            if self.run_job is not None:
                return self.run_job(job), None
            return job(), None
        except Exception as exc:
            return None, exc

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Cancel held jobs, then shut the inner pool down."""
        with self._lock:
            groups = list(self._held.values())
            self._held.clear()
        for held in groups:
            for future in held.futures:
                _cancel(future)
        self.inner.shutdown(wait=wait, cancel_futures=cancel_futures)


class TrainingExecutor(Protocol):
    """Where a run's training jobs run: what clients, the evaluator and the runtime need of an executor.

    A job is a callable returning what its client uploads (a :class:`TrainingJob` when it can be batched); the
    executor's :attr:`pool` runs it off the event loop, and its :attr:`models` are the reusable per-worker models.
    """

    @property
    def models(self) -> ModelPool:
        """The per-worker models jobs train on."""
        ...

    @property
    def pool(self) -> Executor:
        """Runs jobs off the event loop (``concurrent.futures`` interface)."""
        ...

    def attach(self, clock: object) -> None:
        """Let a virtual clock drive batched jobs (no-op when nothing is batched)."""
        ...

    def shutdown(self) -> None:
        """Cancel queued jobs and wait for running ones."""
        ...


class ThreadTrainingExecutor:
    """A thread pool plus the per-thread models its jobs train (a :class:`TrainingExecutor`).

    Args:
        factory: Builds the user's ``nn.Module`` (called once per worker thread).
        workers: Number of threads.
        threads_per_worker: Intra-op (OpenMP) threads of each worker's torch kernels.
        vectorized: Batch :class:`TrainingJob` submissions into cohorts (:class:`CohortBatcher`).
        max_cohort: Largest cohort, when vectorized.
        device: Where models (and so training) live.
        on_fallback: Told why a cohort was trained one client at a time.
    """

    def __init__(
        self,
        factory: Callable[[], nn.Module],
        *,
        workers: int,
        threads_per_worker: int = 1,
        vectorized: bool = False,
        max_cohort: int = 256,
        device: torch.device | str = "cpu",
        on_fallback: Callable[[str], None] | None = None,
    ) -> None:
        """Start no threads yet: they start with the first job, or with :meth:`start_threads`."""
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {threads_per_worker}")
        self.workers = workers
        self.threads_per_worker = threads_per_worker
        self.device = torch.device(device)
        self.models = ModelPool(factory, self.device)
        threads: Executor = ThreadPoolExecutor(
            max_workers=workers,
            thread_name_prefix="flasync-train",
            initializer=_init_worker,
            initargs=(threads_per_worker, torch.get_num_threads(), self.device),
        )
        self.batcher: CohortBatcher | None = None
        if vectorized:
            self.batcher = CohortBatcher(
                threads, self.models, max_cohort=max_cohort, on_fallback=on_fallback, parallel=workers
            )
        self.pool: Executor = self.batcher if self.batcher is not None else threads
        self._threads = threads

    def start_threads(self, timeout_s: float = 10.0) -> None:
        """Start every worker thread now, where the executor is made (a run makes it off the event loop, which then
        starts no thread of its own at its first jobs).

        Each thread takes a job that waits for all of them, so the pool starts a thread for each; a thread that does
        not start within ``timeout_s`` is left to start with a later job, as it would without this.
        """
        barrier = threading.Barrier(self.workers)
        waits = [self._threads.submit(barrier.wait, timeout_s) for _ in range(self.workers)]
        for wait in waits:
            with contextlib.suppress(threading.BrokenBarrierError):
                wait.result()

    def attach(self, clock: object) -> None:
        """Let a virtual clock start held cohorts when it must wait for them (no-op without batching)."""
        if self.batcher is not None:
            self.batcher.attach(clock)

    def shutdown(self) -> None:
        """Cancel queued jobs and wait for running ones."""
        self.pool.shutdown(wait=True, cancel_futures=True)
