"""The worker-thread side of a client task: train, diagnose, encode.

A job runs in a training executor's worker, never on the event loop. It gets a :class:`JobContext` (the worker's
models, the local hyper-parameters, the upload codec, the diagnostics) and the task's parts of the run's plug-ins
(:mod:`flasync.training.plugins`), and returns a :class:`TrainedUpdate`: the encoded delta and its figures. What a
plug-in keeps for the client is returned, not stored: the client coroutine stores it when the training ends in
(virtual) time, so a task abandoned before then leaves the client's state as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from flasync.codecs import Pipeline
from flasync.core.errors import InjectedFault
from flasync.core.events import ClientId, TaskDiagnosis
from flasync.data import Partition, SyntheticClients
from flasync.training.cohort import CohortResult
from flasync.training.diagnostics import DivergedTraining, TrainingDiagnostics
from flasync.training.executors.threads import ModelPool, StreamKey, TrainingJob, task_stream
from flasync.training.local import LocalResult, LocalTraining, train
from flasync.training.plugins import Finished, TaskPart

__all__ = [
    "ClientSamples",
    "Finish",
    "JobContext",
    "TrainedUpdate",
    "correction_of",
    "finish_cohort",
    "finish_job",
    "injected_fault",
    "mask_of",
    "start_of",
    "train_job",
]

_NO_DIAGNOSTICS = TrainingDiagnostics("off")


@dataclass(frozen=True, slots=True, kw_only=True)
class JobContext:
    """What a training job needs in its worker thread.

    Attributes:
        models: The worker threads' reusable models.
        local: Local training hyper-parameters.
        upload_codec: How deltas are encoded for upload.
        num_params: Length of the flat model.
        diagnostics: Training diagnostics (None: NaN/Inf checks only).
        wall: Monotonic real seconds (encode timing).
        no_delta: The empty tensor every finished update's result holds instead of its delta (one for all: an
            allocation per update is most of what keeping the figures without the delta costs).
        prepare: Decodes the payloads of a cohort's uploads together as their receiver would, one entry per payload
            in order, or None where they cannot be (the cloud intake's
            :class:`~flasync.server.intake.RowDecoder`): called in the worker right after a cohort is encoded, so
            the receiver finds each delta decoded and checked (None: the receiver decodes them).
    """

    models: ModelPool
    local: LocalTraining
    upload_codec: Pipeline
    num_params: int
    diagnostics: TrainingDiagnostics | None = None
    wall: Callable[[], float] = time.perf_counter
    no_delta: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    prepare: Callable[[Sequence[bytes]], Sequence[object] | None] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainedUpdate:
    """What a training job hands back to its client coroutine.

    ``result`` holds the training's figures with an empty ``delta``: ``payload`` carries the update (a cohort's
    deltas are rows of one tensor, which one member's kept delta would keep whole until its upload is delivered).
    ``extra`` is what a plug-in sends beside the delta, and ``finished`` what each of the task's plug-in parts
    handed back, in the order of the parts. ``upload_bytes`` is what the upload sends: the delta and a plug-in's
    extra (counted where the update is made, in the worker). ``prepared`` is what the receiver would make of the
    payload, made ahead in the worker, with the rest of its cohort or alone (:attr:`JobContext.prepare`; None:
    nothing): its delta is a row of the tensor its cohort's payloads were decoded into, which it keeps until it is
    handled.
    """

    result: LocalResult
    payload: bytes
    encode_s: float
    diagnosis: TaskDiagnosis | None = None
    extra: bytes = b""
    finished: tuple[Finished, ...] = ()
    prepared: object = None
    upload_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        """Count the bytes the upload sends."""
        object.__setattr__(self, "upload_bytes", len(self.payload) + len(self.extra))


@dataclass(frozen=True, slots=True)
class ClientSamples:
    """Where each client's training samples are: rows of one contiguous data set, or drawn when sampled.

    Args:
        x: All training inputs ``(N, *features)``.
        y: All training labels ``(N,)``.
        partition: Client id -> rows of ``x``.
        index: ``partition.indices`` as one int64 tensor on the data's device, sliced per client.
        lazy: Clients whose samples are drawn when they are sampled (then ``x`` and ``y`` only give the device).
    """

    x: torch.Tensor
    y: torch.Tensor
    partition: Partition
    index: torch.Tensor
    lazy: SyntheticClients | None = None

    def __call__(self, client_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return ``(x, y, indices)``: a data tensor pair and the positions of ``client_id``'s samples in it."""
        lazy = self.lazy
        if lazy is None:
            return self.x, self.y, self.indices(client_id)
        data = lazy.client(client_id)
        device = self.x.device
        x, y = data.x.to(device), data.y.to(device)
        return x, y, torch.arange(len(y), device=device)

    def indices(self, client_id: int) -> torch.Tensor:
        """Return the rows of ``client_id``'s samples in :attr:`x` (a view, no copy)."""
        row = self.partition.offsets.item  # Python ints, without a NumPy scalar each
        return self.index[row(client_id) : row(client_id + 1)]

    def spans(self, client_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """Return where each of ``client_ids``'s samples lie in :attr:`index`: their starts and stops, in one pass
        (``index[start:stop]`` is :meth:`indices` of the client)."""
        offsets = self.partition.offsets
        ids = np.asarray(client_ids, dtype=np.int64)
        starts: list[int] = offsets[ids].tolist()
        stops: list[int] = offsets[ids + 1].tolist()
        return starts, stops


def train_job(
    ctx: JobContext,
    client_id: ClientId,
    base: torch.Tensor,
    samples: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    generator: torch.Generator | int | StreamKey,
    codec_generator: torch.Generator | StreamKey | None,
    task_id: int = 0,
    attack: float = 1.0,
    parts: tuple[TaskPart, ...] = (),
    span: tuple[int, int] | None = None,
) -> TrainedUpdate:
    """Train on the worker's model and encode the delta, with the plug-ins' ``parts`` (runs in a worker thread); an
    update that sends nothing beside its delta carries its receiver's decoding too (:attr:`JobContext.prepare`).

    ``generator`` is the task's random stream, or the seed or key of one (made here, in the worker), and
    ``codec_generator`` the codec's (or its key). With ``span``, the client's sample indices are
    ``samples[2][start:stop]`` (sliced here, in the worker).
    """
    generator = task_stream(generator)
    model = ctx.models.get()
    device = model.flat.device
    data_x, data_y, indices = samples
    if span is not None:
        indices = indices[span[0] : span[1]]
    rows: torch.Tensor | None = indices
    if data_x.device != device or data_y.device != device or indices.device != device:
        # Data kept in host memory: the client's samples are gathered and copied to the model's device.
        data_x = data_x[indices].to(device, non_blocking=True)
        data_y = data_y[indices].to(device, non_blocking=True)
        rows = None
    diagnostics = ctx.diagnostics or _NO_DIAGNOSTICS
    correction = correction_of(parts)
    mask = mask_of(parts)
    result, diagnosis = diagnostics.train(
        model,
        base,
        data_x,
        data_y,
        ctx.local,
        generator,
        task_id=task_id,
        train_fn=train,  # looked up here, so that tests can replace flasync.training.jobs.train
        indices=rows,
        correction=None if correction is None else correction.to(device),
        mask=None if mask is None else mask.to(device),
    )
    update = finish_job(ctx, client_id, result, codec_generator, diagnosis, attack, parts)
    return cast(TrainedUpdate, _with_prepared(ctx, [update])[0])  # with its receiver's decoding where it has one


def finish_job(
    ctx: JobContext,
    client_id: ClientId,
    result: LocalResult,
    codec_generator: torch.Generator | StreamKey | None,
    diagnosis: TaskDiagnosis | None = None,
    attack: float = 1.0,
    parts: tuple[TaskPart, ...] = (),
) -> TrainedUpdate:
    """Check and encode a trained delta, and finish the plug-ins' ``parts`` of the task (runs in a worker thread).

    ``diagnosis`` is None for a delta trained in a cohort: it is diagnosed here (no per-step gradient statistics).
    ``attack`` multiplies the delta before it is encoded: a simulated Byzantine client (``faults.byzantine``). A
    part's residual (error feedback) is carried into the codec; then every part takes the encoded delta.

    Raises:
        DivergedTraining: If the delta has NaN or Inf (before encoding: a NaN would otherwise stay in the client's
            error-feedback residual for ever).
    """
    if diagnosis is None:
        diagnosis = (ctx.diagnostics or _NO_DIAGNOSTICS).diagnose(result)
    if not diagnosis.update_finite:
        raise _diverged(result, diagnosis)
    for part in parts:
        type(part).finish_together((part,), (result,))
    for part in parts:
        part.withhold(result.delta)
    start = ctx.wall()
    residual = None
    for part in parts:
        residual = part.residual()
        if residual is not None:
            break
    delta = result.delta if result.delta.device.type == "cpu" else result.delta.cpu()  # the codec writes bytes
    if attack != 1.0:
        delta = delta * attack
    codec = ctx.upload_codec
    if isinstance(codec_generator, tuple):  # its key: the stream is made here
        codec_generator = task_stream(codec_generator)
    encoded = codec.encode(delta, generator=codec_generator, residual=residual)
    finished = tuple(part.finish(delta, result, encoded, codec) for part in parts) if parts else ()
    extra = b"".join(done.extra for done in finished) if finished else b""  # at most one plug-in sends one
    return TrainedUpdate(
        result=result.without_delta(ctx.no_delta),  # the payload carries it
        payload=encoded.payload,
        encode_s=ctx.wall() - start,
        diagnosis=diagnosis,
        extra=extra,
        finished=finished,
    )


def correction_of(parts: tuple[TaskPart, ...]) -> torch.Tensor | None:
    """Return the gradient correction a task's plug-in parts give (None: none)."""
    for part in parts:
        if part.correction is not None:
            return part.correction
    return None


def start_of(parts: tuple[TaskPart, ...]) -> torch.Tensor | None:
    """Return the weights a task's plug-in parts start local training from (None: the downloaded model's)."""
    for part in parts:
        if part.start is not None:
            return part.start
    return None


def mask_of(parts: tuple[TaskPart, ...]) -> torch.Tensor | None:
    """Return the gradient mask a task's plug-in parts give (None: none)."""
    for part in parts:
        if part.mask is not None:
            return part.mask
    return None


class Finish:
    """A task's :func:`finish_job`, as a training job's ``finish``: called with the task's training result.

    A plain slotted class: one is made per task on the event loop, and a frozen dataclass's constructor costs several
    times this one's. Its fields are not changed once made.

    Args:
        ctx: The run's job context.
        client_id: The task's client.
        codec_generator: The codec's random stream, or its key (None: the codec draws none).
        attack: The factor a simulated Byzantine client multiplies its delta by (1: an honest client).
        parts: The task's plug-in parts.
        task_id: The task (what its diagnostics name when it is trained alone).
    """

    __slots__ = ("attack", "client_id", "codec_generator", "ctx", "parts", "task_id")

    def __init__(
        self,
        ctx: JobContext,
        client_id: ClientId,
        codec_generator: torch.Generator | StreamKey | None,
        attack: float = 1.0,
        parts: tuple[TaskPart, ...] = (),
        task_id: int = 0,
    ) -> None:
        """Bind the task's finishing."""
        self.ctx = ctx
        self.client_id = client_id
        self.codec_generator = codec_generator
        self.attack = attack
        self.parts = parts
        self.task_id = task_id

    def __call__(self, result: LocalResult) -> TrainedUpdate:
        """Check and encode ``result``'s delta for this task."""
        return finish_job(self.ctx, self.client_id, result, self.codec_generator, attack=self.attack, parts=self.parts)


def finish_cohort(jobs: Sequence[TrainingJob[Any]], outcome: CohortResult) -> list[Any]:
    """Finish the jobs of a trained cohort: each job's ``finish`` of its own result, or the exception it raises.

    Where every job's ``finish`` is a :class:`Finish` of one context whose codec is lossless, with no plug-in part
    or attack, and the cohort's deltas are the rows of one tensor, the rows are encoded together
    (:meth:`~flasync.codecs.Pipeline.encode_rows`): the same payloads, diagnoses and figures as :func:`finish_job`
    of each, each update's ``encode_s`` its share of the cohort's encoding.

    Where the jobs' context can prepare their receiver's decoding (:attr:`JobContext.prepare`), the payloads of the
    updates that send nothing beside their delta are decoded together then, and each update carries its entry.
    """
    results, deltas = outcome.results, outcome.deltas
    ctx = _plain_context(jobs) if deltas is not None else None
    payloads, encode_s = None, 0.0
    if ctx is not None and deltas is not None:
        start = ctx.wall()
        payloads = ctx.upload_codec.encode_rows(deltas.cpu())
        encode_s = (ctx.wall() - start) / len(jobs)
    if ctx is None or payloads is None:
        _finish_together(jobs, results)
        finished: list[Any] = [_finish_one(job, result) for job, result in zip(jobs, results, strict=True)]
        return _with_prepared(_shared_context(jobs), finished)
    diagnose = (ctx.diagnostics or _NO_DIAGNOSTICS).diagnose
    empty = ctx.no_delta
    prepared = ctx.prepare(payloads) if ctx.prepare is not None else None
    rows = prepared if prepared is not None else [None] * len(payloads)
    finished = []
    for result, payload, row in zip(results, payloads, rows, strict=True):
        diagnosis = diagnose(result)
        if not diagnosis.update_finite:
            finished.append(_diverged(result, diagnosis))
            continue
        finished.append(
            TrainedUpdate(
                result=result.without_delta(empty),
                payload=payload,
                encode_s=encode_s,
                diagnosis=diagnosis,
                prepared=row,
            )
        )
    return finished


def _with_prepared(ctx: JobContext | None, finished: list[Any]) -> list[Any]:
    """Give the updates among ``finished`` that send nothing beside their delta their entries of ``ctx.prepare``
    (decoded together); the rest as they are."""
    if ctx is None or ctx.prepare is None:
        return finished
    plain = [k for k, update in enumerate(finished) if isinstance(update, TrainedUpdate) and not update.extra]
    if not plain:
        return finished
    rows = ctx.prepare([finished[k].payload for k in plain])
    if rows is None:
        return finished
    for k, row in zip(plain, rows, strict=True):
        finished[k] = dataclasses.replace(finished[k], prepared=row)
    return finished


def _shared_context(jobs: Sequence[TrainingJob[Any]]) -> JobContext | None:
    """The context every job's ``finish`` shares, where each is a :class:`Finish` (None otherwise)."""
    first = jobs[0].finish if jobs else None
    if not isinstance(first, Finish):
        return None
    ctx = first.ctx
    for job in jobs:
        finish = job.finish
        if not isinstance(finish, Finish) or finish.ctx is not ctx:
            return None
    return ctx


def _finish_together(jobs: Sequence[TrainingJob[Any]], results: Sequence[LocalResult]) -> None:
    """Let the plug-in parts of a cohort's tasks do together the work they share (each class's parts at once)."""
    groups: dict[type[TaskPart], tuple[list[TaskPart], list[LocalResult]]] = {}
    for job, result in zip(jobs, results, strict=True):
        finish = job.finish
        if not isinstance(finish, Finish):
            continue
        for part in finish.parts:
            group = groups.setdefault(type(part), ([], []))
            group[0].append(part)
            group[1].append(result)
    for cls, (parts, members) in groups.items():
        if len(parts) > 1:
            # On an error each task does its own part's work again as it finishes, and meets the error itself.
            with contextlib.suppress(Exception):
                cls.finish_together(parts, members)


def _plain_context(jobs: Sequence[TrainingJob[Any]]) -> JobContext | None:
    """The context every job's ``finish`` shares, where each is a :class:`Finish` with no plug-in part or attack (None
    otherwise)."""
    ctx = _shared_context(jobs)
    if ctx is None:
        return None
    for job in jobs:
        finish = cast(Finish, job.finish)
        if finish.attack != 1.0 or finish.parts:
            return None
    return ctx


def _finish_one(job: TrainingJob[Any], result: LocalResult) -> Any:
    """Return ``job.finish(result)``, or the exception it raises."""
    try:
        return job.finish(result)
    except Exception as exc:
        return exc


def _diverged(result: LocalResult, diagnosis: TaskDiagnosis) -> DivergedTraining:
    """The error of a task whose delta has NaN or Inf."""
    return DivergedTraining(f"local training diverged: the update has NaN or Inf (loss {result.loss})", diagnosis)


def injected_fault(fraction: float) -> InjectedFault:
    """Return the fault model's crash after ``fraction`` of the training (a task fails with it as with a training
    error)."""
    return InjectedFault(f"injected crash after {fraction:.0%} of training")
