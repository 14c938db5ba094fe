"""Tests for flasync.training.jobs: what a finished training job keeps."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from flasync import codecs
from flasync.algorithms.error_feedback import ErrorFeedback
from flasync.core import seeding
from flasync.core.events import ClientId, TaskAssigned, Version
from flasync.core.snapshots import ModelSnapshot
from flasync.data import Partition
from flasync.training.cohort import CohortMember, CohortResult, CohortTrainer
from flasync.training.diagnostics import DivergedTraining, TrainingDiagnostics
from flasync.training.executors.threads import ModelPool, TrainingJob
from flasync.training.jobs import ClientSamples, Finish, JobContext, TrainedUpdate, finish_cohort, finish_job, train_job
from flasync.training.local import LocalTraining, flat_parameters
from flasync.training.models import MLP
from flasync.training.plugins import TaskPart
from flasync.training.residuals import ResidualStore
from tests.unit.training.job_inputs import small_job


def _trained_cohort() -> tuple[CohortResult, LocalTraining, torch.Tensor, torch.Tensor]:
    """A vectorized cohort of three members of the MLP 8-16-3, its configuration, base and data."""
    torch.manual_seed(0)
    x, y = torch.randn(96, 8), torch.randint(0, 3, (96,))
    order = torch.randperm(96)
    parts = [order[:40], order[40:72], order[72:]]
    cfg = LocalTraining(epochs=1, batch_size=16, lr=0.1)
    base = flat_parameters(MLP(8, [16], 3))
    members = [
        CohortMember(indices=p, generator=seeding.torch_stream(0, seeding.TASK, k, 0)) for k, p in enumerate(parts)
    ]
    outcome = CohortTrainer(MLP(8, [16], 3)).train(base, x, y, members, cfg)
    assert outcome.vectorized and outcome.deltas is not None
    return outcome, cfg, base, x


def test_a_finished_cohort_member_keeps_its_payload_and_no_row_of_the_cohort() -> None:
    """A vectorized cohort's deltas are rows of one tensor; finishing a member encodes its row and keeps no tensor
    of it, so an upload delivered late holds its bytes, not every other member's delta."""
    outcome, cfg, base, _ = _trained_cohort()
    storages = {r.delta.untyped_storage().data_ptr() for r in outcome.results}
    assert len(storages) == 1  # one tensor's rows, not a copy per member
    ctx = JobContext(
        models=ModelPool(lambda: MLP(8, [16], 3)), local=cfg, upload_codec=codecs.Pipeline(), num_params=base.numel()
    )
    for k, result in enumerate(outcome.results):
        trained = finish_job(ctx, ClientId(k), result, None)
        assert trained.result.delta.numel() == 0
        assert torch.equal(codecs.decode(trained.payload, expected_elements=base.numel()), result.delta)
        assert (trained.result.num_samples, trained.result.loss) == (result.num_samples, result.loss)


def _jobs(finishes: list[Any], base: torch.Tensor, x: torch.Tensor, cfg: LocalTraining) -> list[TrainingJob[Any]]:
    return [
        TrainingJob(
            base=base,
            x=x,
            y=x,
            indices=torch.arange(1),
            cfg=cfg,
            generator=torch.Generator(),
            finish=finish,
            solo=lambda: None,
            finish_many=finish_cohort,
        )
        for finish in finishes
    ]


def _same(together: TrainedUpdate, alone: TrainedUpdate) -> None:
    assert together.payload == alone.payload
    assert together.diagnosis == alone.diagnosis
    assert dataclasses.replace(together.result, train_s=0.0) == dataclasses.replace(alone.result, train_s=0.0)
    assert together.result.delta.numel() == 0 and together.finished == () and together.extra == b""


def test_a_cohort_finished_together_gives_what_each_member_finished_alone_gives() -> None:
    """finish_cohort encodes the cohort's rows in one pass: each payload, diagnosis and figure is finish_job's."""
    outcome, cfg, base, x = _trained_cohort()
    for level in ("off", "basic"):
        ctx = JobContext(
            models=ModelPool(lambda: MLP(8, [16], 3)),
            local=cfg,
            upload_codec=codecs.Pipeline(),
            num_params=base.numel(),
            diagnostics=TrainingDiagnostics(level),
        )
        finishes = [Finish(ctx, ClientId(k), None) for k in range(3)]
        together = finish_cohort(_jobs(finishes, base, x, cfg), outcome)
        for finished, finish, result in zip(together, finishes, outcome.results, strict=True):
            assert isinstance(finished, TrainedUpdate)
            _same(finished, finish(result))


def test_a_member_whose_delta_is_not_finite_fails_alone() -> None:
    """A row with NaN is that member's DivergedTraining, as finish_job raises it; the others are finished."""
    outcome, cfg, base, x = _trained_cohort()
    assert outcome.deltas is not None
    outcome.deltas[1, 3] = float("nan")
    results = list(outcome.results)
    results[1] = dataclasses.replace(results[1], update_norm=None)
    outcome = dataclasses.replace(outcome, results=results)
    ctx = JobContext(
        models=ModelPool(lambda: MLP(8, [16], 3)), local=cfg, upload_codec=codecs.Pipeline(), num_params=base.numel()
    )
    finished = finish_cohort(_jobs([Finish(ctx, ClientId(k), None) for k in range(3)], base, x, cfg), outcome)
    assert isinstance(finished[1], DivergedTraining) and "NaN or Inf" in str(finished[1])
    with pytest.raises(DivergedTraining):
        finish_job(ctx, ClientId(1), results[1], None)
    assert isinstance(finished[0], TrainedUpdate) and isinstance(finished[2], TrainedUpdate)


def test_a_cohort_that_cannot_be_encoded_together_is_finished_one_by_one() -> None:
    """A lossy codec, error feedback, an attack or a finish of another kind: each job's own finish, with its own
    generator and residual, and an exception of one job is that job's alone."""
    outcome, cfg, base, x = _trained_cohort()
    pool = ModelPool(lambda: MLP(8, [16], 3))
    n = base.numel()
    lossy = JobContext(models=pool, local=cfg, upload_codec=codecs.Pipeline([codecs.Float16()]), num_params=n)
    feedback = JobContext(models=pool, local=cfg, upload_codec=codecs.Pipeline([codecs.TopK(0.5)]), num_params=n)
    residuals = ErrorFeedback(ResidualStore(n))
    snapshot = ModelSnapshot(version=Version(0), weights=base, exact=base, download_bytes=0)

    def residual_of(k: int) -> tuple[TaskPart, ...]:
        task = TaskAssigned(task_id=k, client_id=ClientId(k), participation=0, base_version=Version(0), simulated_s=0.0)
        return (residuals.task(task, snapshot),)

    plain = JobContext(models=pool, local=cfg, upload_codec=codecs.Pipeline(), num_params=n)

    def boom(result: Any) -> Any:
        raise RuntimeError("boom")

    for finishes in (
        [Finish(lossy, ClientId(k), None) for k in range(3)],
        [Finish(feedback, ClientId(k), None, parts=residual_of(k)) for k in range(3)],
        [
            Finish(plain, ClientId(0), None),
            Finish(plain, ClientId(1), None, attack=-2.0),
            Finish(plain, ClientId(2), None),
        ],
        [Finish(plain, ClientId(0), None), boom, Finish(plain, ClientId(2), None)],
    ):
        together = finish_cohort(_jobs(finishes, base, x, cfg), outcome)
        for k, (finished, finish, result) in enumerate(zip(together, finishes, outcome.results, strict=True)):
            if finish is boom:
                assert isinstance(finished, RuntimeError)
                continue
            alone = Finish(finish.ctx, ClientId(k), None, attack=finish.attack, parts=finish.parts)(result)
            assert isinstance(finished, TrainedUpdate) and finished.payload == alone.payload


def test_the_spans_of_clients_samples_are_where_their_indices_lie() -> None:
    """ClientSamples.spans gives, for any clients in any order (empty ones, the first and the last included), the
    positions in the index tensor whose slice is that client's indices."""
    rng = np.random.default_rng(7)
    counts = rng.integers(0, 6, size=50)
    counts[[0, 17, 49]] = [3, 0, 4]
    offsets = np.concatenate([[0], np.cumsum(counts)])
    order = rng.permutation(int(offsets[-1]))
    samples = ClientSamples(
        x=torch.zeros(len(order), 2),
        y=torch.zeros(len(order)),
        partition=Partition(order, offsets),
        index=torch.from_numpy(order),
    )
    for clients in ([0], [49, 17, 0], rng.integers(0, 50, size=30).tolist(), list(range(50))):
        starts, stops = samples.spans(clients)
        assert all(isinstance(v, int) for v in (*starts, *stops))
        for client, start, stop in zip(clients, starts, stops, strict=True):
            assert torch.equal(samples.index[start:stop], samples.indices(client))
            assert stop - start == counts[client]


def test_a_job_trained_alone_from_its_indices_span_and_streams_key_equals_one_given_both() -> None:
    """train_job slices a span of the index tensor and makes the streams of the keys it is given (task and codec):
    the same payload, bit for bit, as with the client's own indices and the generators seeded alike."""
    x, y, index, _, base, ctx = small_job()
    task, codec = (5, seeding.TASK, 4, 2), (5, seeding.CODEC, 4, 2)
    keyed = train_job(ctx, ClientId(4), base, (x, y, index), task, codec, span=(13, 41))
    given = train_job(
        ctx,
        ClientId(4),
        base,
        (x, y, index[13:41]),
        seeding.torch_stream(*task),
        seeding.torch_stream(*codec),
    )
    assert keyed.payload == given.payload and keyed.result.num_samples == 28
    assert keyed.upload_bytes == len(keyed.payload) + len(keyed.extra)


class _Prepare:
    """A context's ``prepare`` that records the payloads it is given and answers one marker per payload."""

    def __init__(self, answer: bool = True) -> None:
        self.calls: list[list[bytes]] = []
        self.answer = answer

    def __call__(self, payloads: Any) -> list[object] | None:
        self.calls.append(list(payloads))
        return [("row", payload) for payload in payloads] if self.answer else None


def _with_a_diverged_member(outcome: CohortResult) -> CohortResult:
    """The cohort with a NaN in member 1's delta."""
    deltas = outcome.deltas
    assert deltas is not None
    deltas = deltas.clone()
    deltas[1, 3] = float("nan")
    results = [dataclasses.replace(r, delta=deltas[k]) for k, r in enumerate(outcome.results)]
    results[1] = dataclasses.replace(results[1], update_norm=None)
    return dataclasses.replace(outcome, results=results, deltas=deltas)


def test_a_cohorts_payloads_are_prepared_together_in_the_worker_and_each_update_carries_its_entry() -> None:
    """With a context's ``prepare``, the payloads of a cohort encoded together (and of one finished member by member,
    under a lossy codec) are prepared in one call, in order; each update carries its own entry and is otherwise what
    it is without ``prepare``; a member that diverged fails as it does without."""
    trained, cfg, base, x = _trained_cohort()
    pool, n = ModelPool(lambda: MLP(8, [16], 3)), base.numel()
    for codec in (codecs.Pipeline(), codecs.Pipeline([codecs.Float16()])):
        for outcome in (trained, _with_a_diverged_member(trained)):
            prepare = _Prepare()
            ctx = JobContext(models=pool, local=cfg, upload_codec=codec, num_params=n, prepare=prepare)
            without = JobContext(models=pool, local=cfg, upload_codec=codec, num_params=n, no_delta=ctx.no_delta)
            together = finish_cohort(_jobs([Finish(ctx, ClientId(k), None) for k in range(3)], base, x, cfg), outcome)
            alone = finish_cohort(_jobs([Finish(without, ClientId(k), None) for k in range(3)], base, x, cfg), outcome)
            sent = [update.payload for update in together if isinstance(update, TrainedUpdate)]
            (call,) = prepare.calls
            # Encoded together, every row's payload is prepared (a diverged one's too, never sent); else those sent.
            assert [payload for payload in call if payload in sent] == sent and len(call) in (len(sent), 3)
            for finished, reference in zip(together, alone, strict=True):
                if isinstance(reference, DivergedTraining):
                    assert isinstance(finished, DivergedTraining)
                    continue
                assert isinstance(finished, TrainedUpdate) and isinstance(reference, TrainedUpdate)
                assert finished.prepared == ("row", finished.payload) and reference.prepared is None
                _same(finished, reference)


def test_a_cohort_whose_payloads_cannot_be_prepared_carries_no_entry() -> None:
    """Where ``prepare`` declines (None), or one member alone is left to send, no update carries an entry."""
    outcome, cfg, base, x = _trained_cohort()
    pool, n = ModelPool(lambda: MLP(8, [16], 3)), base.numel()
    declines = JobContext(models=pool, local=cfg, upload_codec=codecs.Pipeline(), num_params=n, prepare=_Prepare(False))
    finished = finish_cohort(_jobs([Finish(declines, ClientId(k), None) for k in range(3)], base, x, cfg), outcome)
    assert all(isinstance(f, TrainedUpdate) and f.prepared is None for f in finished)

    def boom(result: Any) -> Any:
        raise RuntimeError("boom")

    prepare = _Prepare()
    lossy = JobContext(
        models=pool, local=cfg, upload_codec=codecs.Pipeline([codecs.Float16()]), num_params=n, prepare=prepare
    )
    finishes: list[Any] = [Finish(lossy, ClientId(0), None), boom, boom]
    finished = finish_cohort(_jobs(finishes, base, x, cfg), outcome)
    assert isinstance(finished[0], TrainedUpdate) and finished[0].prepared is None and not prepare.calls
