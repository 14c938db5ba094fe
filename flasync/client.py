"""The client coroutine: download, train in an executor, encode, upload.

A client exists only while it has a task: the task registry starts :meth:`Client.run` for one task, and the
coroutine ends when its update (or its failure) is on the bus. The training itself runs in a worker thread
(:mod:`flasync.jobs`); the coroutine places each step on the run's clock from the simulated world (network,
speeds, faults).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from flasync import codecs, seeding
from flasync.bus import EventBus
from flasync.clock import Clock
from flasync.diagnostics import DivergedTraining
from flasync.errors import InjectedFault
from flasync.events import ClientFailed, ClientId, FailureKind, TaskAssigned, TaskDiagnosis, UpdateUploaded
from flasync.executors import TrainingJob
from flasync.faults import Fate, FaultModel
from flasync.jobs import ClientSamples, JobContext, TaskVariates, TrainedUpdate, finish_job, injected_crash, train_job
from flasync.population import Network, Population
from flasync.residuals import ResidualStore
from flasync.snapshots import ModelSnapshot

__all__ = ["Client", "ClientResiduals", "ClientWorld", "ModelSnapshot"]


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
        pre_task_residuals: When checkpoints are on, each in-flight task's residual as it was when the task
            started, by task id (the registry forgets a task's entry when it releases it).
        pre_task_variates: The same for the clients' SCAFFOLD control variates.
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
    pre_task_residuals: dict[int, torch.Tensor | None] | None = None
    pre_task_variates: dict[int, torch.Tensor | None] | None = None

    def forget(self, task: TaskAssigned) -> None:
        """Drop what was recorded for a task that ended."""
        if self.pre_task_residuals is not None:
            self.pre_task_residuals.pop(task.task_id, None)
        if self.pre_task_variates is not None:
            self.pre_task_variates.pop(task.task_id, None)


class ClientResiduals:
    """The clients' error-feedback residuals (or SCAFFOLD control variates) as checkpoint state.

    A task in flight may have stored its new vector already; the state keeps the vector it started from, so a
    resumed run trains it again from there.

    Args:
        world: The clients' world (its stores and what each task in flight started from).
        in_flight: The tasks in flight now.
        variates: Hold the control variates instead of the residuals.
    """

    def __init__(
        self, world: ClientWorld, in_flight: Callable[[], Iterable[TaskAssigned]], *, variates: bool = False
    ) -> None:
        """Bind the world and the registry's view of the tasks in flight."""
        self.world = world
        self.in_flight = in_flight
        self.variates = variates

    def _store(self) -> tuple[ResidualStore | None, dict[int, torch.Tensor | None] | None]:
        world = self.world
        if self.variates:
            return world.job.variates, world.pre_task_variates
        return world.job.residuals, world.pre_task_residuals

    def state_dict(self) -> dict[str, Any]:
        """Return ``{"ids": [...], "values": Tensor(len(ids), num_params)}``."""
        job = self.world.job
        store, pre_task = self._store()
        if store is None:
            return {"ids": [], "values": torch.zeros(0)}
        recorded = pre_task if pre_task is not None else {}
        values: dict[int, torch.Tensor] = {}
        with job.residual_lock:
            for client_id in store.client_ids():
                held = store.get(client_id)
                if held is not None:
                    values[client_id] = held
            for task in self.in_flight():
                if task.task_id in recorded:
                    before = recorded[task.task_id]
                    if before is None:
                        values.pop(int(task.client_id), None)
                    else:
                        values[int(task.client_id)] = before.clone()
        ids = sorted(values)
        stacked = torch.stack([values[i] for i in ids]) if ids else torch.zeros(0)
        return {"ids": ids, "values": stacked}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put the checkpoint's vectors back into the store."""
        store, _ = self._store()
        if store is None:
            return
        for i, client_id in enumerate(state["ids"]):
            store.put(int(client_id), state["values"][i])


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
        task crash, hang or drop out (see :mod:`flasync.faults`). A failure of local training is published as
        :class:`ClientFailed`; it never propagates.
        """
        world, cid = self.world, self.client_id
        clock, log, job_ctx = world.clock, world.log, world.job
        # bind/reset rather than structlog's bound_contextvars: the same context, a third of its cost per task.
        tokens = structlog.contextvars.bind_contextvars(client_id=int(cid), base_version=int(task.base_version))
        try:
            download_s = world.network.download_seconds(cid, model.download_bytes)
            samples = world.samples(cid)
            indices = samples[2]
            steps = job_ctx.local.steps_for(len(indices))
            # A client's k-th participation draws the same numbers whenever and by whom it is dispatched.
            simulated = world.population.train_seconds(cid, steps, task.participation)
            done_at = task.simulated_s + (download_s + simulated)
            residuals = job_ctx.residuals
            if world.pre_task_residuals is not None and residuals is not None:
                with job_ctx.residual_lock:  # what a checkpoint taken while this task is in flight must restore
                    world.pre_task_residuals[task.task_id] = residuals.get(cid)
            variates = self._variates(task, model)
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
            attack = faults.attack_factor(cid) if faults is not None else 1.0
            generator = seeding.torch_stream(world.seed, seeding.TASK, cid, task.participation)
            codec_generator = (
                seeding.torch_stream(world.seed, seeding.CODEC, cid, task.participation)
                if job_ctx.upload_codec.draws_random
                else None
            )
            job: Callable[[], TrainedUpdate]
            if fate is not None and fate.fate is Fate.CRASH:
                fraction = fate.fraction
                job = functools.partial(injected_crash, fraction)
                done_at = task.simulated_s + (download_s + fraction * simulated)
            else:
                # A batching executor trains this job together with others of the same base version.
                job = TrainingJob(
                    base=model.weights,
                    x=samples[0],
                    y=samples[1],
                    indices=indices,
                    cfg=job_ctx.local,
                    generator=generator,
                    finish=lambda result: finish_job(
                        job_ctx, cid, result, codec_generator, attack=attack, variates=variates
                    ),
                    solo=lambda: train_job(
                        job_ctx,
                        cid,
                        model.weights,
                        samples,
                        generator,
                        codec_generator,
                        task.task_id,
                        attack,
                        variates,
                    ),
                    correction=variates.correction if variates is not None else None,
                    client=int(cid) if world.samples.lazy is not None else None,
                )
            try:
                # Everything the job needs is known now, so it starts at once in real time; on the virtual
                # clock it completes after the simulated download and training.
                trained = await clock.run(world.pool, job, simulated_s=download_s + simulated, until=done_at)
            except Exception as exc:
                kind: FailureKind = "crash" if isinstance(exc, InjectedFault) else "error"
                diagnosis = exc.diagnosis if isinstance(exc, DivergedTraining) else None
                await self._fail(task, kind, f"{type(exc).__name__}: {exc}", None, diagnosis)
                return
            result = trained.result
            upload_s = world.network.upload_seconds(cid, trained.upload_bytes)
            up_at = done_at + upload_s
            if offline_at < up_at:
                await self._fail(task, "offline", "availability window closed during upload", offline_at)
                return
            if residuals is not None and trained.residual is not None:
                with job_ctx.residual_lock:
                    residuals.put(cid, trained.residual)
            if job_ctx.variates is not None and trained.variate is not None:
                with job_ctx.residual_lock:
                    job_ctx.variates.put(cid, trained.variate)
            log.debug(
                "client",
                step=task.task_id,
                train_s=result.train_s,
                sim_train_s=simulated,
                sim_download_s=download_s,
                samples=result.num_samples,
                loss=result.loss,
                peak_mem_bytes=result.peak_mem_bytes,
                encode_s=trained.encode_s,
                download_bytes=model.download_bytes,
                upload_bytes=trained.upload_bytes,
                compression=(codecs.HEADER.size + 4 * job_ctx.num_params) / len(trained.payload),
                **({} if trained.residual_norm is None else {"residual_norm": trained.residual_norm}),
            )
            await clock.elapse(upload_s, until=up_at)
            await world.bus.publish(
                UpdateUploaded(
                    to=task.reply_to,
                    task_id=task.task_id,
                    client_id=cid,
                    base_version=task.base_version,
                    num_samples=result.num_samples,
                    payload=trained.payload,
                    control=trained.control,
                    train_loss=result.loss,
                    simulated_s=clock.now(),
                    sent_wall_s=world.wall(),
                    compute_s=result.train_s,
                    encode_s=trained.encode_s,
                    sim_download_s=download_s,
                    sim_train_s=simulated,
                    sim_upload_s=upload_s,
                    download_bytes=model.download_bytes,
                    peak_mem_bytes=result.peak_mem_bytes,
                    diagnosis=trained.diagnosis,
                )
            )
        finally:
            structlog.contextvars.reset_contextvars(**tokens)

    def _variates(self, task: TaskAssigned, model: ModelSnapshot) -> TaskVariates | None:
        """Return the task's SCAFFOLD state (None without SCAFFOLD), recording ``c_i`` for checkpoints."""
        world, cid = self.world, self.client_id
        store = world.job.variates
        if store is None or model.control is None:
            return None
        with world.job.residual_lock:
            own = store.get(cid)
            if world.pre_task_variates is not None:
                world.pre_task_variates[task.task_id] = own
        generator = seeding.torch_stream(world.seed, seeding.CONTROL_CODEC, cid, task.participation)
        return TaskVariates.of(model.control, own, generator)

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
        if kind == "error":
            world.log.warning("client.failed", step=task.task_id, error=error, metrics=False)
        else:
            world.log.debug("client.failed", step=task.task_id, kind=kind, error=error, metrics=False)
        await world.bus.publish(
            ClientFailed(
                to=task.reply_to,
                task_id=task.task_id,
                client_id=self.client_id,
                base_version=task.base_version,
                error=error,
                simulated_s=world.clock.now(),
                diagnosis=diagnosis,
                kind=kind,
            )
        )
