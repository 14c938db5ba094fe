"""The client coroutine: download, train in an executor, encode, upload.

A client exists only while it has a task: the server materialises a :class:`Client` (an id and the indices of its
samples) when it samples one, and the coroutine ends when its update has been published on the bus.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from flasync import codecs, seeding
from flasync.context import RunContext
from flasync.diagnostics import DivergedTraining, TrainingDiagnostics
from flasync.errors import InjectedFault
from flasync.events import ClientFailed, ClientId, TaskAssigned, TaskDiagnosis, UpdateUploaded, Version
from flasync.executors import TrainingJob
from flasync.faults import Fate
from flasync.training import LocalResult, train

__all__ = ["Client", "ModelSnapshot", "TrainedUpdate"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSnapshot:
    """One published global model: weights shared read-only by every client that downloads it.

    ``weights`` is what clients receive (the decoded download, equal to ``exact`` for a lossless download codec);
    ``exact`` is the server's own copy.
    """

    version: Version
    weights: torch.Tensor
    exact: torch.Tensor
    download_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainedUpdate:
    """What a training job hands back to its client coroutine."""

    result: LocalResult
    payload: bytes
    encode_s: float
    residual_norm: float | None
    diagnosis: TaskDiagnosis | None = None
    residual: torch.Tensor | None = None


def _train_job(
    ctx: RunContext,
    client_id: ClientId,
    base: torch.Tensor,
    samples: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    generator: torch.Generator,
    codec_generator: torch.Generator,
    task_id: int = 0,
) -> TrainedUpdate:
    """Train on the worker's model and encode the delta, with error feedback (runs in a worker thread)."""
    model = ctx.executor.models.get()
    device = model.flat.device
    data_x, data_y, indices = samples
    rows: torch.Tensor | None = indices
    if data_x.device != device or data_y.device != device or indices.device != device:
        # Data kept in host memory: the client's samples are gathered and copied to the model's device.
        data_x = data_x[indices].to(device, non_blocking=True)
        data_y = data_y[indices].to(device, non_blocking=True)
        rows = None
    diagnostics = ctx.diagnostics or _NO_DIAGNOSTICS
    result, diagnosis = diagnostics.train(
        model,
        base,
        data_x,
        data_y,
        ctx.local,
        generator,
        task_id=task_id,
        train_fn=train,  # looked up here, so that tests can replace flasync.client.train
        indices=rows,
    )
    return _finish_job(ctx, client_id, result, codec_generator, diagnosis)


def _finish_job(
    ctx: RunContext,
    client_id: ClientId,
    result: LocalResult,
    codec_generator: torch.Generator,
    diagnosis: TaskDiagnosis | None = None,
) -> TrainedUpdate:
    """Check and encode a trained delta, with error feedback (runs in a worker thread).

    The new residual is returned, not stored: the client coroutine stores it when the training ends in (virtual)
    time, so a task abandoned before then leaves the client's residual as it was. ``diagnosis`` is None for a delta
    trained in a cohort: it is diagnosed here (no per-step gradient statistics).
    """
    if diagnosis is None:
        diagnosis = (ctx.diagnostics or _NO_DIAGNOSTICS).diagnose(result)
    if not diagnosis.update_finite:
        # Fail the task before encoding: a NaN would otherwise stay in the client's error-feedback residual forever.
        raise DivergedTraining(f"local training diverged: the update has NaN or Inf (loss {result.loss})", diagnosis)
    start = time.perf_counter()
    residuals = ctx.residuals
    residual = None
    if residuals is not None:
        with ctx.residual_lock:
            residual = residuals.get(client_id)
    delta = result.delta if result.delta.device.type == "cpu" else result.delta.cpu()  # the codec writes bytes
    encoded = ctx.upload_codec.encode(delta, generator=codec_generator, residual=residual)
    encode_s = time.perf_counter() - start
    norm = None
    if residuals is not None and encoded.residual is not None:
        norm = float(torch.linalg.vector_norm(encoded.residual))
    return TrainedUpdate(
        result=result,
        payload=encoded.payload,
        encode_s=encode_s,
        residual_norm=norm,
        diagnosis=diagnosis,
        residual=encoded.residual,
    )


_NO_DIAGNOSTICS = TrainingDiagnostics("off")


def _injected_crash(fraction: float) -> TrainedUpdate:
    """Raise the fault model's crash, in the worker thread like a real training error."""
    raise InjectedFault(f"injected crash after {fraction:.0%} of training")


class Client:
    """A sampled client: its id, its samples, and the coroutine that runs one task.

    Args:
        client_id: Index in the population.
        ctx: The run's shared wiring.
    """

    __slots__ = ("client_id", "ctx")

    def __init__(self, client_id: ClientId, ctx: RunContext) -> None:
        """Bind the client to the run."""
        self.client_id = client_id
        self.ctx = ctx

    async def run(self, task: TaskAssigned, model: ModelSnapshot) -> None:
        """Run one task: download ``model``, train locally, upload the encoded delta on the bus.

        Every step is placed at an absolute time counted from the dispatch (``task.simulated_s``), so a task
        re-dispatched from a checkpoint keeps the timeline it started with. The run's fault model may make the
        task crash, hang or drop out (see :mod:`flasync.faults`). A failure of local training is published as
        :class:`ClientFailed`; it never propagates.
        """
        ctx, cid = self.ctx, self.client_id
        clock, log = ctx.clock, ctx.log
        with structlog.contextvars.bound_contextvars(client_id=int(cid), base_version=int(task.base_version)):
            download_s = ctx.network.download_seconds(cid, model.download_bytes)
            samples = ctx.client_samples(cid)
            indices = samples[2]
            steps = ctx.local.steps_for(len(indices))
            # A client's k-th participation draws the same numbers whenever and by whom it is dispatched.
            simulated = ctx.population.train_seconds(cid, steps, task.participation)
            done_at = task.simulated_s + (download_s + simulated)
            if ctx.pre_task_residuals is not None and ctx.residuals is not None:
                with ctx.residual_lock:  # what a checkpoint taken while this task is in flight must restore
                    ctx.pre_task_residuals[task.task_id] = ctx.residuals.get(cid)
            faults = ctx.faults
            fate = faults.fate(cid, task.participation) if faults is not None else None
            offline_at = faults.offline_at(cid, task.simulated_s) if faults is not None else float("inf")
            if fate is not None and fate.fate is Fate.HANG:
                await asyncio.get_running_loop().create_future()  # never answers; the server times the task out
            if fate is not None and fate.fate is Fate.DROPOUT:
                left_at = task.simulated_s + (download_s + fate.fraction * simulated)
                await self._fail(task, "dropout", f"dropped out after {fate.fraction:.0%} of training", left_at)
                return
            if offline_at < done_at:
                await self._fail(task, "offline", "availability window closed during training", offline_at)
                return
            generator = seeding.torch_stream(ctx.config.seed, seeding.TASK, cid, task.participation)
            codec_generator = seeding.torch_stream(ctx.config.seed, seeding.CODEC, cid, task.participation)
            job: Callable[[], TrainedUpdate]
            if fate is not None and fate.fate is Fate.CRASH:
                fraction = fate.fraction
                job = functools.partial(_injected_crash, fraction)
                done_at = task.simulated_s + (download_s + fraction * simulated)
            else:
                # A batching executor trains this job together with others of the same base version.
                job = TrainingJob(
                    base=model.weights,
                    x=samples[0],
                    y=samples[1],
                    indices=indices,
                    cfg=ctx.local,
                    generator=generator,
                    finish=lambda result: _finish_job(ctx, cid, result, codec_generator),
                    solo=lambda: _train_job(ctx, cid, model.weights, samples, generator, codec_generator, task.task_id),
                )
            try:
                # Everything the job needs is known now, so it starts at once in real time; on the virtual
                # clock it completes after the simulated download and training.
                trained = await clock.run(ctx.executor.pool, job, simulated_s=download_s + simulated, until=done_at)
            except Exception as exc:
                kind = "crash" if isinstance(exc, InjectedFault) else "error"
                diagnosis = exc.diagnosis if isinstance(exc, DivergedTraining) else None
                await self._fail(task, kind, f"{type(exc).__name__}: {exc}", None, diagnosis)
                return
            result = trained.result
            upload_s = ctx.network.upload_seconds(cid, len(trained.payload))
            up_at = done_at + upload_s
            if offline_at < up_at:
                await self._fail(task, "offline", "availability window closed during upload", offline_at)
                return
            if ctx.residuals is not None and trained.residual is not None:
                with ctx.residual_lock:
                    ctx.residuals.put(cid, trained.residual)
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
                upload_bytes=len(trained.payload),
                compression=(codecs.HEADER.size + 4 * ctx.num_params) / len(trained.payload),
                **({} if trained.residual_norm is None else {"residual_norm": trained.residual_norm}),
            )
            if clock.virtual:
                await clock.sleep_until(up_at)
            else:
                await clock.sleep(upload_s)
            await ctx.bus.publish(
                UpdateUploaded(
                    to=task.reply_to,
                    task_id=task.task_id,
                    client_id=cid,
                    base_version=task.base_version,
                    num_samples=result.num_samples,
                    payload=trained.payload,
                    train_loss=result.loss,
                    simulated_s=clock.now(),
                    sent_wall_s=ctx.wall(),
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

    async def _fail(
        self, task: TaskAssigned, kind: str, error: str, at: float | None, diagnosis: TaskDiagnosis | None = None
    ) -> None:
        """Publish :class:`ClientFailed` at time ``at`` (now if None)."""
        ctx = self.ctx
        if at is not None:
            await ctx.clock.sleep_until(at)
        if kind == "error":
            ctx.log.warning("client.failed", step=task.task_id, error=error, metrics=False)
        else:
            ctx.log.debug("client.failed", step=task.task_id, kind=kind, error=error, metrics=False)
        await ctx.bus.publish(
            ClientFailed(
                to=task.reply_to,
                task_id=task.task_id,
                client_id=self.client_id,
                base_version=task.base_version,
                error=error,
                simulated_s=ctx.clock.now(),
                diagnosis=diagnosis,
                kind=kind,
            )
        )
