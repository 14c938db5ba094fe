"""Training on Ray actors: many processes, or many machines, deterministic like the threads.

``executor.kind = "ray"`` (``pip install 'flasync[ray]'``). Each actor is a process that holds the model and the
training data: the data go into Ray's object store once and every actor reads them from there; each model version is
put once and passed by reference (a small model's versions, :data:`_INLINE_BYTES` or less, travel inside the tasks);
a task ships its client's sample indices, its random state and any gradient correction a plug-in gives, and gets the
delta back. Encoding, error-feedback residuals and diagnosis stay in the driver, as with threads, so a Ray run ends
with the weights of a threads run of the same config, whatever the number of actors (training is a function of the
task's inputs only, and under the virtual clock the order of results depends on simulated times alone).

Each actor trains one task (or, with ``executor.ray.vectorized``, one cohort) at a time, with the next call queued
behind it; driver threads wait on the calls, so the event loop never blocks. An actor that dies (killed, out of
memory) fails the tasks it held, like any client failure the run accounts for, and is replaced. Ray started by
flasync (no ``executor.ray.address``) is stopped when the run ends, also after Ctrl-C; a cluster flasync joined is
left running.

A :class:`~flasync.training.executors.ray_watch.ClusterWatch` probes the cluster's GCS and this node's raylet while
the run goes on, and driver threads wait on calls one probe period at a time: once the cluster is gone (its GCS and
raylet killed, say), the tasks waiting fail, no new one is sent, the executor tells ``on_event("lost", why)`` and the
run stops as after a stop request, instead of hanging until Ray's core worker ends the process.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
import time
import uuid
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
from torch import nn

from flasync.config import RayConfig
from flasync.core.errors import ConfigError, TrainingError
from flasync.data import SyntheticClients
from flasync.training.cohort import CohortMember, CohortResult, CohortTrainer
from flasync.training.executors import ray_processes
from flasync.training.executors.ray_watch import CLUSTER_GONE, PROBE_EVERY_S, ClusterWatch
from flasync.training.executors.threads import CohortBatcher, ModelPool, TrainingJob
from flasync.training.local import FlatModel, LocalResult, LocalTraining, train

if TYPE_CHECKING:
    import psutil

__all__ = ["RayTrainingExecutor", "TrainingActor"]

T = TypeVar("T")

_VERSIONS_KEPT = 8  # model versions whose payloads (object refs, or small arrays) are kept for the tasks in flight
# A model version this small travels inside each task (Ray inlines arguments below 100 KiB) instead of being put: the
# driver then touches no object store while it trains, and a store that dies under a put ends the process at once.
_INLINE_BYTES = 64 * 1024
_PIPELINE = 2  # calls queued per actor: the next one's arguments travel while the current one trains
_ACTOR_START_S = 120.0  # an actor whose resources no node has waits for ever: give up after this
# Probes in a row that must fail before the cluster is taken for gone: a local Ray flasync started is not restarted
# by anyone, while a joined cluster's GCS (with GCS fault tolerance) may come back within Ray's own 60 s.
_MISSES_LOCAL = 2
_MISSES_JOINED = 30
_SHUTDOWN_GONE_S = 10.0  # longest wait for ray.shutdown once the cluster is gone (it takes seconds then)
_PROCESSES_END_S = 2.0  # after stopping a local Ray, how long its workers and agents may take to end before a kill


def _ray() -> Any:
    try:
        import ray  # an optional extra, imported only by runs with executor.kind = "ray"
    except ImportError as exc:
        raise ConfigError("executor.kind: 'ray' needs Ray: pip install 'flasync[ray]'") from exc
    return ray


class _DropMessages(logging.Filter):
    """Drop log records whose message starts with one of ``starts``."""

    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


@contextlib.contextmanager
def _quiet_local_start() -> Iterator[None]:
    """Silence two warnings of ``ray.init`` that say nothing to a run starting its own local Ray in a thread.

    One says no SIGTERM handler was set (flasync handles its signals itself); the other that the local cluster uses
    token authentication (it does, with a token made for it).
    """
    drop = _DropMessages(("SIGTERM handler is not set", "Token authentication is enabled for this Ray cluster"))
    loggers = [logging.getLogger(name) for name in _RAY_START_LOGGERS]
    for logger in loggers:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(drop)


_RAY_START_LOGGERS = ("ray._private.worker", "ray._private.authentication.authentication_token_setup")


def _check_reachable(address: str, timeout_s: float) -> None:
    """Fail fast (Ray itself retries an unreachable address for minutes) if ``host:port`` does not answer."""
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"executor.ray.address: expected 'host:port' or 'auto', got {address!r}")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ConfigError(f"executor.ray.address: cannot reach the Ray cluster at {address} ({exc})") from None


def _init_ray(settings: RayConfig) -> None:
    """Start a local Ray (no ``settings.address``) or join the cluster at ``settings.address``.

    Raises:
        ConfigError: If Ray cannot start or the cluster cannot be reached.
    """
    ray = _ray()
    if settings.address is not None:
        _check_reachable(settings.address, settings.connect_timeout_s)
    try:
        if settings.address is None:
            with _quiet_local_start():
                ray.init(
                    num_cpus=max(1, int(np.ceil(settings.actors * settings.cpus_per_actor))),
                    num_gpus=int(np.ceil(settings.actors * settings.gpus_per_actor)),
                    include_dashboard=False,
                    log_to_driver=False,
                    configure_logging=False,
                )
        else:
            ray.init(address=settings.address, log_to_driver=False, configure_logging=False)
    except Exception as exc:
        where = "start a local Ray" if settings.address is None else f"join the Ray cluster at {settings.address}"
        raise ConfigError(f"executor.ray: cannot {where}: {type(exc).__name__}: {exc}".splitlines()[0]) from None


def _watch(settings: RayConfig, on_lost: Callable[[str], None]) -> ClusterWatch:
    """A watch (not started) on the GCS of the Ray this process is connected to and on this node's raylet."""
    ray = _ray()
    host, _, port = str(ray.get_runtime_context().gcs_address).rpartition(":")
    me = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == me)
    return ClusterWatch(
        gcs=(host, int(port)),
        raylet=(str(node["NodeManagerAddress"]), int(node["NodeManagerPort"])),
        on_lost=on_lost,
        misses=_MISSES_LOCAL if settings.address is None else _MISSES_JOINED,
    )


def _to_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor of its own from ``array`` (copied when it is read only, as arrays from Ray's object store are)."""
    return torch.from_numpy(np.array(array, copy=not array.flags.writeable))


def _read_only(array: np.ndarray) -> torch.Tensor:
    """A tensor over ``array`` without a copy, for what training only reads (the base weights, a correction).

    ``torch.from_numpy`` warns about a read-only array because the tensor could write to it; these never do.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


class TrainingActor:
    """What runs inside a Ray actor: the reused model, the data it was given, and one training call at a time.

    Args:
        factory: Builds the model.
        threads: Intra-op torch threads (the weights depend on it, as on the threads executor).
        device: Where the model trains (``cuda`` for an actor with a GPU).
        lazy: A lazily drawn population (its sizes and seed): the actor draws a client's samples itself.
    """

    def __init__(
        self, factory: Callable[[], nn.Module], threads: int, device: str, lazy: SyntheticClients | None = None
    ) -> None:
        torch.set_num_threads(threads)
        self.lazy = lazy
        self.device = torch.device(device)
        self.factory = factory
        self.model = FlatModel(factory().to(self.device))
        self.trainer: CohortTrainer | None = None
        self.data: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def node(self) -> str:
        """Return the id of the Ray node the actor runs on."""
        return str(_ray().get_runtime_context().get_node_id())

    def _data(self, key: int, refs: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        held = self.data.get(key)
        if held is None:
            x, y = _ray().get(refs)
            held = (_to_tensor(x).to(self.device), _to_tensor(y).to(self.device))
            self.data = {key: held}  # one data set at a time: a run's, or a lazy client's
        return held

    def train(
        self,
        base: np.ndarray,
        data: tuple[int, list[Any]],
        indices: np.ndarray,
        cfg: LocalTraining,
        state: np.ndarray,
        correction: np.ndarray | None,
    ) -> tuple[np.ndarray, int, int, float, float, int]:
        """Train one client from ``base`` on its rows ``indices`` of the data; return the result's fields."""
        x, y = self._data(*data)
        return self._train_on(base, x, y, indices, cfg, state, correction)

    def _train_on(
        self,
        base: np.ndarray,
        x: torch.Tensor,
        y: torch.Tensor,
        indices: np.ndarray,
        cfg: LocalTraining,
        state: np.ndarray,
        correction: np.ndarray | None,
    ) -> tuple[np.ndarray, int, int, float, float, int]:
        generator = torch.Generator()
        generator.set_state(torch.from_numpy(np.array(state)))
        result = train(
            self.model,
            _read_only(base).to(self.device),
            x,
            y,
            cfg,
            generator,
            indices=torch.from_numpy(np.array(indices)).to(self.device),
            correction=None if correction is None else _read_only(correction).to(self.device),
        )
        return _fields(result)

    def train_client(
        self, base: np.ndarray, client: int, cfg: LocalTraining, state: np.ndarray, correction: np.ndarray | None
    ) -> tuple[np.ndarray, int, int, float, float, int]:
        """Train client ``client`` of the lazy population on the samples drawn here (the driver ships no data)."""
        assert self.lazy is not None
        data = self.lazy.client(client)
        x, y = data.x.to(self.device), data.y.to(self.device)
        indices = np.arange(len(data.y), dtype=np.int64)
        return self._train_on(base, x, y, indices, cfg, state, correction)

    def train_cohort(
        self,
        base: np.ndarray,
        data: tuple[int, list[Any]],
        members: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]],
        cfg: LocalTraining,
    ) -> tuple[list[tuple[np.ndarray, int, int, float, float, int]], bool, str | None]:
        """Train a cohort (one vectorized call where the model allows); return each member's fields."""
        if self.trainer is None:
            self.trainer = CohortTrainer(self.factory().to(self.device))
        x, y = self._data(*data)
        built = []
        for indices, state, correction in members:
            generator = torch.Generator()
            generator.set_state(torch.from_numpy(np.array(state)))
            built.append(
                CohortMember(
                    indices=torch.from_numpy(np.array(indices)).to(x.device),
                    generator=generator,
                    correction=None if correction is None else _read_only(correction),
                )
            )
        outcome = self.trainer.train(_read_only(base).to(self.device), x, y, built, cfg)
        return [_fields(r) for r in outcome.results], outcome.vectorized, outcome.fallback_reason


def _fields(result: LocalResult) -> tuple[np.ndarray, int, int, float, float, int]:
    delta = result.delta.detach().to("cpu", torch.float32).numpy()
    return delta, result.num_samples, result.steps, result.loss, result.train_s, result.peak_mem_bytes


def _result(fields: tuple[np.ndarray, int, int, float, float, int]) -> LocalResult:
    delta, num_samples, steps, loss, train_s, peak = fields
    return LocalResult(
        delta=_to_tensor(delta),
        num_samples=int(num_samples),
        steps=int(steps),
        loss=float(loss),
        train_s=float(train_s),
        peak_mem_bytes=int(peak),
    )


class _Slot:
    """One actor handle, its node and its calls in flight; replaced when the actor dies."""

    __slots__ = ("actor", "busy", "node")

    def __init__(self, actor: Any, node: str) -> None:
        self.actor = actor
        self.node = node
        self.busy = 0


class _RayPool(Executor):
    """Runs :class:`TrainingJob` submissions on actors (through the waiting threads), anything else locally."""

    def __init__(self, owner: RayTrainingExecutor) -> None:
        self.owner = owner

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        owner = self.owner
        if isinstance(fn, TrainingJob) and not args and not kwargs:
            return owner.waiters.submit(owner.run_remote, fn)
        return owner.local.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.owner.waiters.shutdown(wait=wait, cancel_futures=cancel_futures)
        self.owner.local.shutdown(wait=wait, cancel_futures=cancel_futures)


class RayTrainingExecutor:
    """A :class:`~flasync.training.executors.threads.TrainingExecutor` whose training runs on Ray actors.

    Args:
        factory: Builds the model (shipped to every actor).
        settings: ``executor.ray``.
        device: The driver's device (evaluation runs there; actors with GPUs train on ``cuda``).
        lazy: A lazily drawn population: its sizes and seed go to each actor once, and a task ships its client's id
            instead of its samples.
        on_fallback: Told why a cohort was trained one client at a time (``settings.vectorized``).
        on_event: Told of what happens to actors (``("replaced", reason)``), for the run's log.

    Raises:
        ConfigError: If Ray is not installed, cannot start, or the cluster cannot be reached.
    """

    def __init__(
        self,
        factory: Callable[[], nn.Module],
        settings: RayConfig,
        *,
        device: torch.device | str = "cpu",
        on_fallback: Callable[[str], None] | None = None,
        on_event: Callable[[str, str], None] | None = None,
        lazy: SyntheticClients | None = None,
    ) -> None:
        ray = _ray()
        if settings.gpus_per_actor > 0 and settings.address is None and not torch.cuda.is_available():
            raise ConfigError(
                f"executor.ray.gpus_per_actor: {settings.gpus_per_actor:g} asked for, but this machine has no CUDA GPU"
            )
        self.lazy = lazy
        self.settings = settings
        self.factory = factory
        self.on_event = on_event
        self.models = ModelPool(factory, device)
        self.started_ray = False
        self.joined_ray = False
        self._ray_processes: list[psutil.Process] = []  # the processes ray.init started here (a local Ray)
        if not ray.is_initialized():
            before = ray_processes.children()
            _init_ray(settings)
            self.started_ray = settings.address is None
            self.joined_ray = not self.started_ray
            if self.started_ray:
                self._ray_processes = ray_processes.started_since(before, os.path.dirname(ray.__file__))
        self._remote_actor = ray.remote(
            num_cpus=settings.cpus_per_actor, num_gpus=settings.gpus_per_actor, max_restarts=0
        )(TrainingActor)
        self._device = "cuda" if settings.gpus_per_actor > 0 else "cpu"
        self._lock = threading.Lock()
        self._names = (f"flasync-train-{uuid.uuid4().hex[:8]}-{n}" for n in itertools.count())
        self.watch = _watch(settings, self._gone)
        try:
            self.watch.start()
            self._slots = self._start_slots(settings.actors)
        except BaseException:
            self.watch.close()
            if self.started_ray:  # a Ray started for this run must not outlive an executor that never was
                self.started_ray = False
                self._stop_local_ray(ray.shutdown)
            raise
        self._turn = itertools.count()
        self._bases: OrderedDict[int, tuple[torch.Tensor, Any]] = OrderedDict()
        self._data: dict[int, tuple[torch.Tensor, torch.Tensor, list[Any], int]] = {}
        self._data_keys = itertools.count()
        self.tasks_by_node: Counter[str] = Counter()
        self.replaced = 0
        self.waiters = ThreadPoolExecutor(max_workers=_PIPELINE * settings.actors, thread_name_prefix="flasync-ray")
        self.local = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flasync-local")
        self.batcher: CohortBatcher | None = None
        ray_pool = _RayPool(self)
        self.pool: Executor = ray_pool
        if settings.vectorized:
            self.batcher = CohortBatcher(
                self.waiters,
                self.models,
                max_cohort=256,
                on_fallback=on_fallback,
                train_cohort=self.train_cohort_remote,
                run_job=self.run_remote,
                passthrough=self.local,
            )
            self.pool = self.batcher

    # ------------------------------------------------------------------------------------------------ actors
    def _start_slots(self, count: int) -> list[_Slot]:
        """Start ``count`` actors at once and wait until each answers: they load side by side, on as many cores as
        the cluster gives them. If any cannot start, every one of them is killed (unless the cluster is gone)."""
        ray = _ray()
        # Named (flasync-train-<run>-<n>), so that `ray list actors` and tests can find them.
        actors = [
            self._remote_actor.options(name=next(self._names)).remote(
                self.factory, self.settings.threads_per_actor, self._device, self.lazy
            )
            for _ in range(count)
        ]
        try:
            return [_Slot(actor, self._node_of(actor)) for actor in actors]
        except TrainingError:
            raise  # the cluster is gone, and its actors with it: a kill would wait on a GCS that never answers
        except BaseException:
            for actor in actors:
                with contextlib.suppress(Exception):  # an actor already gone
                    ray.kill(actor)
            raise

    def _node_of(self, actor: Any) -> str:
        """Wait until the just-started ``actor`` answers; return its node.

        Raises:
            ConfigError: If it did not start within :data:`_ACTOR_START_S` seconds, or failed to start.
            TrainingError: If the cluster is gone.
        """
        ray = _ray()
        try:
            node: str = self._wait(actor.node.remote(), timeout_s=_ACTOR_START_S)
        except ray.exceptions.GetTimeoutError:
            settings = self.settings
            raise ConfigError(
                f"executor.ray: no actor started within {_ACTOR_START_S:.0f} s: does the cluster have "
                f"{settings.cpus_per_actor:g} CPU and {settings.gpus_per_actor:g} GPU free for one?"
            ) from None
        except TrainingError:
            raise  # the cluster is gone
        except Exception as exc:
            message = f"executor.ray: an actor could not start: {type(exc).__name__}: {exc}"
            raise ConfigError(message.splitlines()[0]) from None
        return node

    def _slot(self) -> _Slot:
        """Pick the actor with the fewest calls in flight (round robin among equals) and count the call."""
        with self._lock:
            start = next(self._turn)
            slots = self._slots
            slot = min((slots[(start + i) % len(slots)] for i in range(len(slots))), key=lambda s: s.busy)
            slot.busy += 1
            return slot

    def _call(self, method: str, *args: Any) -> Any:
        """Run ``method`` on an actor and wait; an actor that died is replaced and the call fails.

        Each actor runs its calls one at a time, in order; with :data:`_PIPELINE` calls queued per actor the next
        one's arguments travel while the current one trains.
        """
        ray = _ray()
        slot = self._slot()
        try:
            self._check()
            ref = getattr(slot.actor, method).remote(*args)
            try:
                value = self._wait(ref)
            except ray.exceptions.RayActorError as exc:
                self._check()
                if self.watch.silent():  # the actor died with its node: a new one would wait on a GCS that is gone
                    raise TrainingError(CLUSTER_GONE) from None
                self._replace(slot, exc)
                raise TrainingError(f"the Ray actor training this task died ({type(exc).__name__})") from None
            with self._lock:
                self.tasks_by_node[slot.node] += 1
            return value
        finally:
            with self._lock:
                slot.busy -= 1

    def _wait(self, ref: Any, timeout_s: float | None = None) -> Any:
        """``ray.get(ref)``, one probe period at a time, so that a cluster the watch finds gone ends the wait.

        Raises:
            TrainingError: If the cluster is gone (:data:`CLUSTER_GONE`).
            ray.exceptions.GetTimeoutError: If ``timeout_s`` seconds passed (counted in probe periods).
        """
        ray = _ray()
        periods = None if timeout_s is None else max(1, int(np.ceil(timeout_s / PROBE_EVERY_S)))
        for period in itertools.count(1):
            try:
                return ray.get(ref, timeout=PROBE_EVERY_S)
            except ray.exceptions.GetTimeoutError:
                self._check()
                if periods is not None and period >= periods:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover - itertools.count never ends

    def _check(self) -> None:
        """Raise :class:`TrainingError` if the watch found the cluster gone (nothing more is sent to it)."""
        if self.watch.lost:
            raise TrainingError(CLUSTER_GONE)

    def _check_put(self) -> None:
        """Raise :class:`TrainingError` unless this node's raylet answers now: Ray ends the process when its object
        store is gone (on a put, or on freeing a ref the put evicts), without waiting for the watch."""
        if not self.watch.raylet_answers():
            raise TrainingError(CLUSTER_GONE)

    def _gone(self, why: str) -> None:
        """Tell the run, from the watch's thread, that the cluster is gone."""
        if self.on_event is not None:
            self.on_event("lost", why)

    def _replace(self, slot: _Slot, exc: BaseException) -> None:
        with self._lock:
            if slot not in self._slots:
                return  # another call on the same actor replaced it already
            index = self._slots.index(slot)
            self._slots[index] = self._start_slots(1)[0]
            self.replaced += 1
        if self.on_event is not None:
            self.on_event("replaced", f"{type(exc).__name__} on node {slot.node[:12]}")

    # --------------------------------------------------------------------------------------------- payloads
    def _base_ref(self, base: torch.Tensor) -> Any:
        """One object-store copy per model version (tasks of a version share the snapshot's tensor), or the version's
        array itself if it is :data:`_INLINE_BYTES` or smaller (Ray sends it inside each task)."""
        with self._lock:
            held = self._bases.get(id(base))
            if held is not None and held[0] is base:
                self._bases.move_to_end(id(base))
                return held[1]
            payload: Any = base.detach().to("cpu", torch.float32).numpy()
            if payload.nbytes > _INLINE_BYTES:
                self._check_put()
                payload = _ray().put(payload)
            self._bases[id(base)] = (base, payload)
            while len(self._bases) > _VERSIONS_KEPT:
                self._bases.popitem(last=False)
            return payload

    def _data_ref(self, x: torch.Tensor, y: torch.Tensor) -> tuple[int, list[Any]]:
        """The training data, put once (a lazy client's own samples, put per task)."""
        with self._lock:
            held = self._data.get(id(x))
            if held is None or held[0] is not x or held[1] is not y:
                ray = _ray()
                self._check_put()
                refs = [ray.put(x.detach().cpu().numpy()), ray.put(y.detach().cpu().numpy())]
                if len(self._data) > 4:
                    self._data.clear()
                # A fresh key per put: an actor caches by key, and ids of freed tensors are reused.
                held = self._data[id(x)] = (x, y, refs, next(self._data_keys))
            return held[3], held[2]

    # ------------------------------------------------------------------------------------------------ calls
    def run_remote(self, job: TrainingJob[T]) -> T:
        """Train ``job`` on an actor, then finish it here (encode, residuals), in a waiting thread."""
        correction = None if job.correction is None else job.correction.detach().cpu().numpy()
        if job.client is not None and self.lazy is not None:  # the actor draws the client's samples
            state = job.stream().get_state().numpy()
            fields = self._call("train_client", self._base_ref(job.base), job.client, job.cfg, state, correction)
            return job.finish(_result(fields))
        fields = self._call(
            "train",
            self._base_ref(job.base),
            self._data_ref(job.x, job.y),
            job.rows().detach().cpu().numpy(),
            job.cfg,
            job.stream().get_state().numpy(),
            correction,
        )
        return job.finish(_result(fields))

    def train_cohort_remote(
        self,
        base: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        members: Sequence[CohortMember],
        cfg: LocalTraining,
        jobs: Sequence[TrainingJob[Any]],
    ) -> CohortResult:
        """Train a cohort on an actor (one call) and return its results."""
        start = time.perf_counter()
        data = self._data_ref(jobs[0].x, jobs[0].y) if x is jobs[0].x else self._data_ref(x, y)
        shipped = [
            (
                m.indices.detach().cpu().numpy(),
                m.generator.get_state().numpy(),
                None if m.correction is None else m.correction.detach().cpu().numpy(),
            )
            for m in members
        ]
        fields, vectorized, reason = self._call("train_cohort", self._base_ref(base), data, shipped, cfg)
        return CohortResult(
            results=[_result(f) for f in fields],
            vectorized=vectorized,
            fallback_reason=reason,
            train_s=time.perf_counter() - start,
        )

    # ------------------------------------------------------------------------------------------- lifecycle
    def attach(self, clock: object) -> None:
        """Let a virtual clock start held cohorts (no-op unless vectorized)."""
        if self.batcher is not None:
            self.batcher.attach(clock)

    def shutdown(self) -> None:
        """Cancel queued jobs, wait for running ones, kill the actors and stop the Ray this executor started."""
        if self.on_event is not None and self.tasks_by_node:
            nodes = ", ".join(f"{node[:12]}: {count}" for node, count in sorted(self.tasks_by_node.items()))
            self.on_event("finished", f"tasks by Ray node {nodes}; actors replaced: {self.replaced}")
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.waiters.shutdown(wait=True, cancel_futures=True)
        self.local.shutdown(wait=True, cancel_futures=True)
        self.watch.close()
        ray = _ray()
        if not ray.is_initialized():
            return
        if not self.watch.lost:
            for slot in self._slots:
                with contextlib.suppress(Exception):  # an actor already gone
                    ray.kill(slot.actor)
        self._bases.clear()
        self._data.clear()
        if self.watch.lost and (self.started_ray or self.joined_ray):
            self.started_ray = self.joined_ray = False
            self._stop_local_ray(_shutdown_gone)
        elif self.started_ray:
            self.started_ray = False
            self._stop_local_ray(ray.shutdown)

    def _stop_local_ray(self, stop: Callable[[], None]) -> None:
        """Disconnect from Ray with ``stop``, then wait for every process of the local Ray this executor started
        (none for a cluster it joined: workers and agents end a moment after the raylet) and kill any still there
        after :data:`_PROCESSES_END_S`."""
        tree = ray_processes.with_descendants(self._ray_processes)
        self._ray_processes = []
        stop()
        ray_processes.reap(tree, _PROCESSES_END_S)


def _shutdown_gone() -> None:
    """Disconnect from a Ray whose GCS and raylet are gone, waiting at most :data:`_SHUTDOWN_GONE_S` seconds.

    Without a disconnect, Ray's core worker ends the process once the GCS has not answered for a minute; the
    disconnect itself waits on the GCS for a few seconds, and may hang, so it runs in a thread of its own.
    """
    done = threading.Thread(target=_ray().shutdown, name="flasync-ray-shutdown", daemon=True)
    done.start()
    done.join(_SHUTDOWN_GONE_S)
