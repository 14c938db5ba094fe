"""Vectorized cohorts (flasync.training.cohort) against one-client-at-a-time training, and the batching executor."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import flasync
from flasync.core import seeding
from flasync.core.clock import VirtualClock
from flasync.core.errors import ConfigError, TrainingError
from flasync.testing import small_config
from flasync.training.cohort import CohortMember, CohortResult, CohortTrainer, unsupported_reason
from flasync.training.diagnostics import TrainingDiagnostics
from flasync.training.executors import threads as threads_module
from flasync.training.executors.threads import CohortBatcher, ModelPool, TrainingJob, cohorts_for, resolve_device
from flasync.training.local import FlatModel, LocalResult, LocalTraining, flat_parameters, train
from flasync.training.models import MLP, SmallCNN
from tests.conftest import Focal

FEATURES, CLASSES = 64, 10
SIZES = (37, 50, 5, 64, 100, 17, 1)  # ragged: short last batches, different step counts, a one-sample client
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


pytestmark = pytest.mark.usefixtures("seeded_torch", "one_intra_op_thread")


def _mlp() -> nn.Module:
    return MLP(FEATURES, [32], CLASSES)


def _cnn() -> nn.Module:
    return SmallCNN(in_channels=1, image_size=(8, 8), num_classes=CLASSES, channels=(4, 6))


class _BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out


class _ValueBranching(nn.Module):
    """A model vmap cannot batch (it reads a tensor's value in Python), with nothing a static check sees."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x)
        return out * 2 if float(out.detach().sum()) > 1e9 else out


def _data(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    total = sum(SIZES)
    x = torch.randn(total, FEATURES)
    y = torch.randint(0, CLASSES, (total,))
    order = torch.randperm(total)
    parts, offset = [], 0
    for size in SIZES:
        parts.append(order[offset : offset + size].to(device))
        offset += size
    return x.to(device), y.to(device), parts


def _no_single_sample_batches(parts: list[torch.Tensor], batch: int = 16) -> list[torch.Tensor]:
    """Drop clients whose last batch would hold one sample (BatchNorm cannot train on those)."""
    return [p for p in parts if p.numel() % batch != 1]


def _members(parts: list[torch.Tensor]) -> list[CohortMember]:
    return [CohortMember(indices=p, generator=seeding.torch_stream(3, seeding.TASK, k, 0)) for k, p in enumerate(parts)]


def _alone(
    factory: Callable[[], nn.Module],
    base: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    parts: list[torch.Tensor],
    cfg: LocalTraining,
) -> list[LocalResult]:
    model = FlatModel(factory().to(x.device))
    return [
        train(model, base, x[p], y[p], cfg, seeding.torch_stream(3, seeding.TASK, k, 0)) for k, p in enumerate(parts)
    ]


CONFIGS = [
    pytest.param(LocalTraining(epochs=1, batch_size=32, lr=0.01), id="plain-sgd"),
    pytest.param(
        LocalTraining(epochs=2, batch_size=16, lr=0.1, momentum=0.9, weight_decay=1e-3, clip_norm=0.5),
        id="momentum-wd-clip",
    ),
    pytest.param(LocalTraining(epochs=3, max_steps=7, batch_size=8, lr=0.05, momentum=0.5), id="max-steps"),
    pytest.param(LocalTraining(epochs=2, batch_size=16, lr=0.1, momentum=0.5, proximal_mu=0.5), id="fedprox"),
    pytest.param(LocalTraining(epochs=2, batch_size=16, lr=0.1, momentum=0.5, objective=Focal()), id="focal-loss"),
]


@pytest.mark.parametrize("factory", [_mlp, _cnn], ids=["mlp", "cnn"])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_vectorized_equals_one_client_at_a_time(factory: Callable[[], nn.Module], cfg: LocalTraining) -> None:
    """Every member's delta is within 1e-5 of training it alone; steps, samples and mean loss match."""
    x, y, parts = _data()
    base = flat_parameters(factory())
    outcome = CohortTrainer(factory()).train(base, x, y, _members(parts), cfg)
    assert outcome.vectorized
    assert outcome.fallback_reason is None
    expected = _alone(factory, base, x, y, parts, cfg)
    assert len(outcome.results) == len(parts)
    for got, want in zip(outcome.results, expected, strict=True):
        assert got.steps == want.steps
        assert got.num_samples == want.num_samples
        assert torch.allclose(got.delta, want.delta, rtol=0, atol=1e-5)
        assert got.loss == pytest.approx(want.loss, rel=1e-5)
        assert bool(got.delta.abs().sum() > 0)
        assert got.update_norm == pytest.approx(float(torch.linalg.vector_norm(got.delta)), rel=1e-6)
        if want.num_samples >= cfg.batch_size:  # same first-batch shape: the same memory estimate
            assert got.peak_mem_bytes == want.peak_mem_bytes


@pytest.mark.parametrize("cfg", CONFIGS)
def test_a_models_cohort_forward_gives_the_vmap_paths_deltas_bit_for_bit(cfg: LocalTraining) -> None:
    """The MLP's batched forward (baddbmm per layer) trains a cohort exactly as vmap over its forward does."""
    x, y, parts = _data()
    base = flat_parameters(_mlp())
    own = CohortTrainer(_mlp())
    assert own._cohort_forward is not None
    plain = CohortTrainer(_mlp())
    plain._cohort_forward = None  # vmap over forward
    got = own.train(base, x, y, _members(parts), cfg)
    want = plain.train(base, x, y, _members(parts), cfg)
    assert got.vectorized and want.vectorized
    for a, b in zip(got.results, want.results, strict=True):
        assert torch.equal(a.delta, b.delta)
        assert a.loss == b.loss


@pytest.mark.parametrize("offset", [0, 3])
def test_slices_of_one_index_tensor_are_gathered_in_one_step_with_the_same_deltas(
    monkeypatch: pytest.MonkeyPatch, offset: int
) -> None:
    """Members whose indices are slices of one tensor (the engine's partition index) find their samples in one
    gather from it, with no per-member copy; the deltas and losses equal those of members holding copies."""
    x, y, parts = _data()
    base = flat_parameters(_mlp())
    whole = torch.cat([torch.arange(offset), *parts])[offset:]  # the slices' tensor starts inside its storage
    sliced, start = [], 0
    for part in parts:
        sliced.append(whole[start : start + part.numel()])
        start += part.numel()
    padded: list[int] = []
    pad = nn.utils.rnn.pad_sequence

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        padded.append(1)
        return pad(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(nn.utils.rnn, "pad_sequence", counted)
    cfg = LocalTraining(epochs=2, batch_size=16, lr=0.05)
    got = CohortTrainer(_mlp()).train(base, x, y, _members(sliced), cfg)
    assert not padded
    want = CohortTrainer(_mlp()).train(base, x, y, _members([p.clone() for p in parts]), cfg)
    assert padded == [1]
    assert got.vectorized and want.vectorized
    for a, b in zip(got.results, want.results, strict=True):
        assert torch.equal(a.delta, b.delta)
        assert a.loss == b.loss


def test_a_failing_cohort_forward_trains_one_client_at_a_time() -> None:
    """A model whose cohort_forward raises on the first step falls back to per-client training, saying so."""

    class Broken(MLP):
        def cohort_forward(self, params: object, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("shapes do not fit")

    x, y, parts = _data()
    factory = lambda: Broken(FEATURES, [32], CLASSES)  # noqa: E731
    base = flat_parameters(factory())
    cfg = LocalTraining(epochs=1, batch_size=16, lr=0.05)
    outcome = CohortTrainer(factory()).train(base, x, y, _members(parts), cfg)
    assert not outcome.vectorized
    assert outcome.fallback_reason == "cohort_forward failed: RuntimeError: shapes do not fit"
    for got, want in zip(outcome.results, _alone(factory, base, x, y, parts, cfg), strict=True):
        assert torch.equal(got.delta, want.delta)


def test_bf16_autocast_is_close_to_one_client_at_a_time() -> None:
    """Under bf16 autocast the cohort stays close to per-client bf16 training (bf16 rounding differs slightly)."""
    x, y, parts = _data()
    cfg = LocalTraining(epochs=1, batch_size=16, lr=0.05, precision="bf16")
    base = flat_parameters(_mlp())
    outcome = CohortTrainer(_mlp()).train(base, x, y, _members(parts), cfg)
    assert outcome.vectorized
    for got, want in zip(outcome.results, _alone(_mlp, base, x, y, parts, cfg), strict=True):
        assert torch.allclose(got.delta, want.delta, rtol=0, atol=2e-3)


@pytest.mark.parametrize(
    ("factory", "reason"),
    [
        (_BatchNormNet, "BatchNorm1d"),
        (lambda: nn.Sequential(nn.Linear(FEATURES, 8), nn.Dropout(0.2), nn.Linear(8, CLASSES)), "random"),
        (_ValueBranching, "vmap cannot batch the model"),
    ],
    ids=["batchnorm", "dropout", "vmap-error"],
)
def test_unsupported_models_fall_back_with_a_reason(factory: Callable[[], nn.Module], reason: str) -> None:
    """A model vmap cannot batch is trained one client at a time, from untouched generators, and says why."""
    x, y, parts = _data()
    parts = _no_single_sample_batches(parts)
    cfg = LocalTraining(epochs=1, batch_size=16, lr=0.05, momentum=0.9)
    base = flat_parameters(factory())
    with torch.random.fork_rng(devices=[]):
        outcome = CohortTrainer(factory()).train(base, x, y, _members(parts), cfg)
    assert not outcome.vectorized
    assert outcome.fallback_reason is not None and reason in outcome.fallback_reason
    if reason != "random":  # dropout draws from torch's global generator: compare only deterministic models
        for got, want in zip(outcome.results, _alone(factory, base, x, y, parts, cfg), strict=True):
            assert torch.equal(got.delta, want.delta)


def test_static_check_names_the_layer() -> None:
    """unsupported_reason names the offending layer, and passes the built-in models."""
    assert unsupported_reason(_mlp()) is None
    assert unsupported_reason(_cnn()) is None
    reason = unsupported_reason(_BatchNormNet())
    assert reason is not None and "body.1" in reason


def test_a_member_without_samples_is_an_error() -> None:
    """An empty client fails the cohort call before anything trains."""
    x, y, parts = _data()
    parts[2] = parts[2][:0]
    with pytest.raises(TrainingError, match="member 2 has no samples"):
        CohortTrainer(_mlp()).train(flat_parameters(_mlp()), x, y, _members(parts), LocalTraining())


# ------------------------------------------------------------------------------------------------ batching
def _job(
    base: torch.Tensor, x: torch.Tensor, y: torch.Tensor, part: torch.Tensor, k: int, pool: ModelPool
) -> TrainingJob[LocalResult]:
    cfg = LocalTraining(epochs=1, batch_size=16, lr=0.05, momentum=0.9)
    generator = seeding.torch_stream(3, seeding.TASK, k, 0)
    return TrainingJob(
        base=base,
        x=x,
        y=y,
        indices=part,
        cfg=cfg,
        generator=generator,
        finish=lambda result: result,
        solo=lambda: train(pool.get(), base, x[part], y[part], cfg, generator),
    )


@pytest.mark.parametrize("factory", [_mlp, _BatchNormNet], ids=["vectorized", "fallback"])
async def test_batcher_trains_jobs_of_different_bases_together(factory: Callable[[], nn.Module]) -> None:
    """Held jobs train as cohorts of up to max_cohort whatever their bases; each future gets its own result."""
    x, y, parts = _data()
    parts = _no_single_sample_batches(parts)
    base = flat_parameters(factory())
    other = base + 0.01 * torch.randn(base.shape, generator=torch.Generator().manual_seed(1))
    pool = ModelPool(factory)
    reasons: list[str] = []
    batcher = CohortBatcher(ThreadPoolExecutor(1), pool, max_cohort=3, on_fallback=reasons.append)
    bases = [base if k % 2 == 0 else other for k in range(len(parts))]
    assert len(parts) == 5
    try:
        futures = [
            asyncio.wrap_future(batcher.submit(_job(b, x, y, p, k, pool)))
            for k, (b, p) in enumerate(zip(bases, parts, strict=True))
        ]
        results = await asyncio.gather(*futures)
    finally:
        batcher.shutdown()
    assert batcher.cohorts == 2  # one group, bases mixed: a cohort of 3 and one of 2
    cfg = LocalTraining(epochs=1, batch_size=16, lr=0.05, momentum=0.9)
    model = FlatModel(factory())
    for k, (got, b, p) in enumerate(zip(results, bases, parts, strict=True)):
        want = train(model, b, x[p], y[p], cfg, seeding.torch_stream(3, seeding.TASK, k, 0))
        assert torch.allclose(got.delta, want.delta, rtol=0, atol=1e-5)
    if factory is _BatchNormNet:
        assert batcher.fallback_clients == len(parts) and reasons and "BatchNorm1d" in reasons[0]
    else:
        assert batcher.vectorized_clients == len(parts) and not reasons


@pytest.mark.parametrize("full", [False, True], ids=["flushed", "full"])
@pytest.mark.parametrize(("clients", "parallel", "cohorts"), [(70, 2, [35, 35]), (63, 2, [63]), (70, 1, [70])])
async def test_a_large_group_is_split_into_a_cohort_for_each_thread(
    clients: int, parallel: int, cohorts: list[int], full: bool
) -> None:
    """A group of at least 2 x MIN_SPLIT jobs, flushed or started when it reaches ``max_cohort``, trains as
    ``parallel`` cohorts of nearly equal size, each member with the result of one cohort for all (bit for bit)."""
    torch.manual_seed(0)
    x, y = torch.randn(clients * 20, FEATURES), torch.randint(0, CLASSES, (clients * 20,))
    parts = list(torch.arange(clients * 20).split(20))
    base = flat_parameters(_mlp())
    pool = ModelPool(_mlp)
    sizes: list[int] = []

    def train_cohort(cohort_base, cx, cy, members, cfg, jobs):  # type: ignore[no-untyped-def]
        sizes.append(len(members))
        return pool.cohort_trainer().train(cohort_base, cx, cy, members, cfg)

    max_cohort = clients if full else 256
    batcher = CohortBatcher(
        ThreadPoolExecutor(parallel), pool, train_cohort=train_cohort, parallel=parallel, max_cohort=max_cohort
    )
    try:
        futures = [batcher.submit(_job(base, x, y, p, k, pool)) for k, p in enumerate(parts)]
        if not full:
            batcher.flush()
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
    finally:
        batcher.shutdown()
    assert sorted(sizes) == cohorts
    members = [
        CohortMember(indices=p, generator=seeding.torch_stream(3, seeding.TASK, k, 0)) for k, p in enumerate(parts)
    ]
    whole = CohortTrainer(_mlp()).train(
        base, x, y, members, LocalTraining(epochs=1, batch_size=16, lr=0.05, momentum=0.9)
    )
    assert all(torch.equal(got.delta, want.delta) for got, want in zip(results, whole.results, strict=True))


@pytest.mark.parametrize("factory", [_mlp, _BatchNormNet], ids=["vectorized", "fallback"])
async def test_a_job_given_its_streams_seed_trains_as_one_given_the_generator(factory: Callable[[], nn.Module]) -> None:
    """A job may carry its random stream's seed instead of the generator (made where it trains): a cohort, or the
    fallback one client at a time, gives bit for bit the deltas of jobs carrying generators seeded alike."""
    x, y, parts = _data()
    parts = _no_single_sample_batches(parts)
    base = flat_parameters(factory())
    pool = ModelPool(factory)
    seeded = [
        dataclasses.replace(_job(base, x, y, p, k, pool), generator=seeding.stream_seed(3, seeding.TASK, k, 0))
        for k, p in enumerate(parts)
    ]
    assert all(isinstance(job.generator, int) for job in seeded)
    outcomes = []
    for jobs in (seeded, [_job(base, x, y, p, k, pool) for k, p in enumerate(parts)]):
        batcher = CohortBatcher(ThreadPoolExecutor(1), pool, max_cohort=len(parts))
        try:
            outcomes.append(await asyncio.gather(*(asyncio.wrap_future(batcher.submit(job)) for job in jobs)))
        finally:
            batcher.shutdown()
    for with_seed, with_generator in zip(*outcomes, strict=True):
        assert torch.equal(with_seed.delta, with_generator.delta)
    assert seeded[0].stream().initial_seed() == seeding.stream_seed(3, seeding.TASK, 0, 0)


@pytest.mark.parametrize("factory", [_mlp, _BatchNormNet], ids=["vectorized", "fallback"])
async def test_a_job_given_its_streams_key_and_its_indices_span_trains_as_one_given_both(
    factory: Callable[[], nn.Module],
) -> None:
    """A job may carry its random stream's key and the span of its sample indices in a shared index tensor (the
    stream made and the indices sliced where it trains): a cohort, or the fallback one client at a time, gives bit
    for bit the deltas of jobs carrying their generators and their own indices."""
    x, y, parts = _data()
    parts = _no_single_sample_batches(parts)
    base = flat_parameters(factory())
    pool = ModelPool(factory)
    index = torch.cat(parts)
    stops = torch.cumsum(torch.tensor([len(p) for p in parts]), 0).tolist()
    spans = list(zip([0, *stops[:-1]], stops, strict=True))
    keyed = [
        dataclasses.replace(
            _job(base, x, y, p, k, pool), generator=(3, seeding.TASK, k, 0), indices=index, span=spans[k]
        )
        for k, p in enumerate(parts)
    ]
    assert all(torch.equal(job.rows(), p) for job, p in zip(keyed, parts, strict=True))
    outcomes = []
    for jobs in (keyed, [_job(base, x, y, p, k, pool) for k, p in enumerate(parts)]):
        batcher = CohortBatcher(ThreadPoolExecutor(1), pool, max_cohort=len(parts))
        try:
            outcomes.append(await asyncio.gather(*(asyncio.wrap_future(batcher.submit(job)) for job in jobs)))
        finally:
            batcher.shutdown()
    for with_key, with_generator in zip(*outcomes, strict=True):
        assert torch.equal(with_key.delta, with_generator.delta)
        assert with_key.num_samples == with_generator.num_samples


@pytest.mark.parametrize("count", [1, 5, 40])  # below and above the count from which seeds are mixed as arrays
def test_the_streams_of_keyed_jobs_are_those_of_their_seeds_whatever_else_the_cohort_holds(count: int) -> None:
    """Jobs keyed under one seed and purpose get the streams of their keys' seeds (mixed together); a cohort that
    also holds a seed, a generator or another purpose's key gives each job its own stream just the same."""
    rng = torch.Generator().manual_seed(count)
    ids = torch.randint(0, 1 << 40, (count,), generator=rng).tolist()
    counters = torch.randint(0, 1 << 20, (count,), generator=rng).tolist()
    x, y, parts = _data()
    pool = ModelPool(_mlp)
    base = flat_parameters(_mlp())

    def with_generator(key: Any) -> TrainingJob[Any]:
        return dataclasses.replace(_job(base, x, y, parts[0], 0, pool), generator=key)

    keys: list[Any] = [(11, seeding.TASK, i, c) for i, c in zip(ids, counters, strict=True)]
    mixes = [keys, [*keys, 123], [*keys, (11, seeding.CODEC, 1, 2)], [torch.Generator().manual_seed(5), *keys]]
    for mix in mixes:
        streams = threads_module._streams([with_generator(key) for key in mix])
        for key, stream in zip(mix, streams, strict=True):
            if isinstance(key, tuple):
                assert stream.initial_seed() == seeding.stream_seed(*key)
            elif isinstance(key, int):
                assert stream.initial_seed() == key
            else:
                assert stream is key
        want = seeding.torch_stream(11, seeding.TASK, ids[0], counters[0])
        first = next(k for k, key in enumerate(mix) if key is keys[0])
        assert torch.equal(torch.rand(8, generator=streams[first]), torch.rand(8, generator=want))


async def test_batcher_with_a_remote_cohort_trainer_keeps_one_base_per_cohort() -> None:
    """A train_cohort that takes one base for all members (Ray's) is given cohorts of a single base."""
    x, y, parts = _data()
    base = flat_parameters(_mlp())
    other = base.clone()
    pool = ModelPool(_mlp)
    seen: list[set[int]] = []

    def train_cohort(cohort_base, cx, cy, members, cfg, jobs):  # type: ignore[no-untyped-def]
        seen.append({id(job.base) for job in jobs} | {id(cohort_base)})
        return pool.cohort_trainer().train(cohort_base, cx, cy, members, cfg)

    batcher = CohortBatcher(ThreadPoolExecutor(1), pool, train_cohort=train_cohort)
    jobs = [_job(base if k % 2 == 0 else other, x, y, p, k, pool) for k, p in enumerate(parts[:4])]
    try:
        await asyncio.gather(*(asyncio.wrap_future(batcher.submit(j)) for j in jobs))
    finally:
        batcher.shutdown()
    assert sorted(len(ids) for ids in seen) == [1, 1]


@pytest.mark.parametrize("cfg", CONFIGS[:4])
def test_members_with_their_own_bases_equal_one_client_at_a_time(cfg: LocalTraining) -> None:
    """A cohort whose members start from different weights gives each the delta of training it alone from its own."""
    x, y, parts = _data()
    base = flat_parameters(_mlp())
    noise = torch.Generator().manual_seed(2)
    bases = [base if k % 3 == 0 else base + 0.05 * torch.randn(base.shape, generator=noise) for k in range(len(parts))]
    members = [
        CohortMember(indices=p, generator=seeding.torch_stream(3, seeding.TASK, k, 0), base=b)
        for k, (p, b) in enumerate(zip(parts, bases, strict=True))
    ]
    outcome = CohortTrainer(_mlp()).train(base, x, y, members, cfg)
    assert outcome.vectorized
    model = FlatModel(_mlp())
    for k, (got, b, p) in enumerate(zip(outcome.results, bases, parts, strict=True)):
        want = train(model, b, x[p], y[p], cfg, seeding.torch_stream(3, seeding.TASK, k, 0))
        assert torch.allclose(got.delta, want.delta, rtol=0, atol=1e-5)
        assert got.loss == pytest.approx(want.loss, rel=1e-5)


async def _batch_of_one(batcher: CohortBatcher, job: TrainingJob[Any]) -> Any:
    """Submit ``job`` as a batch of one (as a client coroutine does with a task alone); return or raise its outcome."""
    (outcome,) = await batcher.submit_many_async([job])
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def _submitter(batcher: CohortBatcher, how: str) -> Callable[[TrainingJob[Any]], Awaitable[object]]:
    """Submit through ``submit`` (a thread future, bridged) or as a batch of one (a loop future)."""
    if how == "submit":
        return lambda fn: asyncio.wrap_future(batcher.submit(fn))
    return lambda fn: _batch_of_one(batcher, fn)


async def test_batcher_passes_other_callables_through() -> None:
    """Anything that is not a TrainingJob runs in the inner pool as submitted."""
    batcher = CohortBatcher(ThreadPoolExecutor(1), ModelPool(_mlp))
    try:
        assert await asyncio.wrap_future(batcher.submit(lambda: 41 + 1)) == 42
    finally:
        batcher.shutdown()


@pytest.mark.parametrize("how", ["submit", "batch_of_one"])
async def test_failed_member_fails_alone(how: str) -> None:
    """A job whose finish raises gets that exception; the other members of its cohort succeed."""
    x, y, parts = _data()
    base = flat_parameters(_mlp())
    pool = ModelPool(_mlp)
    batcher = CohortBatcher(ThreadPoolExecutor(1), pool)
    jobs = [_job(base, x, y, p, k, pool) for k, p in enumerate(parts[:3])]

    def boom(result: LocalResult) -> LocalResult:
        raise TrainingError("diverged")

    jobs[1] = TrainingJob(**{**{f: getattr(jobs[1], f) for f in TrainingJob.__dataclass_fields__}, "finish": boom})
    submit = _submitter(batcher, how)
    try:
        outcomes = await asyncio.gather(*(submit(j) for j in jobs), return_exceptions=True)
    finally:
        batcher.shutdown()
    assert isinstance(outcomes[1], TrainingError)
    assert isinstance(outcomes[0], LocalResult) and isinstance(outcomes[2], LocalResult)


@pytest.mark.parametrize("how", ["submit", "batch_of_one"])
async def test_a_cohort_whose_jobs_share_finish_many_is_finished_in_one_call(how: str) -> None:
    """Jobs that all carry one ``finish_many`` get what it returns for them, an exception in its place as that job's
    error; a cohort with a job of another ``finish_many`` finishes each job with its own ``finish``."""
    x, y, parts = _data()
    base = flat_parameters(_mlp())
    pool = ModelPool(_mlp)
    calls: list[tuple[int, bool]] = []

    def many(jobs: Sequence[TrainingJob[Any]], outcome: CohortResult) -> list[Any]:
        calls.append((len(jobs), outcome.deltas is not None))
        assert outcome.deltas is not None
        for row, result in zip(outcome.deltas, outcome.results, strict=True):
            assert torch.equal(row, result.delta)
        return [TrainingError("diverged") if k == 1 else result for k, result in enumerate(outcome.results)]

    def with_many(job: TrainingJob[Any], finish_many: Any) -> TrainingJob[Any]:
        return dataclasses.replace(job, finish_many=finish_many)

    jobs = [with_many(_job(base, x, y, p, k, pool), many) for k, p in enumerate(parts[:3])]
    batcher = CohortBatcher(ThreadPoolExecutor(1), pool)
    submit = _submitter(batcher, how)
    try:
        outcomes = await asyncio.gather(*(submit(j) for j in jobs), return_exceptions=True)
        assert calls == [(3, True)]
        assert isinstance(outcomes[1], TrainingError)
        assert isinstance(outcomes[0], LocalResult) and isinstance(outcomes[2], LocalResult)
        jobs[2] = with_many(jobs[2], None)
        outcomes = await asyncio.gather(*(submit(j) for j in jobs), return_exceptions=True)
    finally:
        batcher.shutdown()
    assert calls == [(3, True)]  # not called again: every job finished on its own
    assert all(isinstance(outcome, LocalResult) for outcome in outcomes)


@pytest.mark.parametrize("wants", [("cpu", "cpu", "cpu"), ("cpu", None, "cpu")], ids=["agree", "differ"])
async def test_a_cohort_returns_deltas_where_all_its_jobs_want_them(
    monkeypatch: pytest.MonkeyPatch, wants: tuple[str | None, ...]
) -> None:
    """Jobs that all name where they want their deltas get them there from the trainer; jobs that differ, as trained."""
    asked: list[torch.device | None] = []
    original = CohortTrainer.train

    def spy(self: CohortTrainer, *args: object, **kwargs: object) -> object:
        asked.append(kwargs.get("deltas_on"))  # type: ignore[arg-type]
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(CohortTrainer, "train", spy)
    x, y, parts = _data()
    base = flat_parameters(_mlp())
    pool = ModelPool(_mlp)
    batcher = CohortBatcher(ThreadPoolExecutor(1), pool)
    jobs = [
        TrainingJob(
            **{
                **{f: getattr(job, f) for f in TrainingJob.__dataclass_fields__},
                "deltas_on": None if where is None else torch.device(where),
            }
        )
        for job, where in zip([_job(base, x, y, p, k, pool) for k, p in enumerate(parts[:3])], wants, strict=True)
    ]
    try:
        results = await asyncio.gather(*(_batch_of_one(batcher, j) for j in jobs))
    finally:
        batcher.shutdown()
    assert asked == [torch.device("cpu") if None not in wants else None]
    assert all(isinstance(r, LocalResult) and r.delta.device.type == "cpu" for r in results)


def test_a_diverged_members_norm_is_left_to_the_diagnosis() -> None:
    """A member whose delta's norm is not finite gets no update_norm, so the diagnosis checks its elements itself."""
    x, y, parts = _data()
    base = flat_parameters(_mlp())
    cfg = LocalTraining(epochs=2, batch_size=16, lr=1e30)
    outcome = CohortTrainer(_mlp()).train(base, x, y, _members(parts), cfg)
    assert outcome.vectorized
    for got in outcome.results:
        finite = bool(torch.isfinite(got.delta).all())
        if got.update_norm is not None:
            assert finite and got.update_norm == pytest.approx(float(torch.linalg.vector_norm(got.delta)), rel=1e-6)
        assert TrainingDiagnostics("off").diagnose(got).update_finite == finite
    assert not all(bool(torch.isfinite(got.delta).all()) for got in outcome.results)


async def test_loop_futures_get_the_same_results_in_few_loop_callbacks() -> None:
    """Jobs submitted alone (batches of one): each one's loop future gets its own result, and a cohort of them
    reaches the loop in chunks."""
    x, y, parts = _data()
    base = flat_parameters(_mlp())
    pool = ModelPool(_mlp)
    batcher = CohortBatcher(ThreadPoolExecutor(1), pool, max_cohort=len(parts))
    loop = asyncio.get_running_loop()
    calls = 0
    original = loop.call_soon_threadsafe

    def counting(callback, *args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return original(callback, *args, **kwargs)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign,assignment]
    try:
        futures = [batcher.submit_many_async([_job(base, x, y, p, k, pool)]) for k, p in enumerate(parts)]
        assert all(isinstance(f, asyncio.Future) and f.get_loop() is loop for f in futures)
        results = [one for (one,) in await asyncio.gather(*futures)]
    finally:
        del loop.call_soon_threadsafe
        batcher.shutdown()
    assert batcher.cohorts == 1 and calls <= 2  # the cohort's start may wake the loop once; its results once
    cfg = LocalTraining(epochs=1, batch_size=16, lr=0.05, momentum=0.9)
    model = FlatModel(_mlp())
    for k, (got, p) in enumerate(zip(results, parts, strict=True)):
        want = train(model, base, x[p], y[p], cfg, seeding.torch_stream(3, seeding.TASK, k, 0))
        assert torch.allclose(got.delta, want.delta, rtol=0, atol=1e-5)


async def test_a_cancelled_loop_future_stays_cancelled_and_shutdown_cancels_held_ones() -> None:
    """A client cancelled while its job is held or training keeps its cancellation; the others get results; jobs
    still held at shutdown are cancelled on their loop."""
    x, y, parts = _data()
    base = flat_parameters(_mlp())
    pool = ModelPool(_mlp)
    batcher = CohortBatcher(ThreadPoolExecutor(1), pool)
    futures = [batcher.submit_many_async([_job(base, x, y, p, k, pool)]) for k, p in enumerate(parts[:3])]
    futures[1].cancel()
    try:
        outcomes = await asyncio.gather(*futures, return_exceptions=True)
        assert isinstance(outcomes[1], asyncio.CancelledError)
        assert isinstance(outcomes[0][0], LocalResult) and isinstance(outcomes[2][0], LocalResult)  # type: ignore[index]
        held = batcher.submit_many_async([_job(base, x, y, parts[3], 3, pool)])
    finally:
        batcher.shutdown()
    with pytest.raises(asyncio.CancelledError):
        await held


async def test_a_group_of_jobs_gets_each_result_in_order_from_one_future() -> None:
    """submit_many_async: one loop future resolves, once every job is done, with each job's result (a failed one's
    exception as a value) in submission order, the results of each job submitted alone; its members split over
    cohorts (max_cohort) still resolve it once."""
    x, y, parts = _data()
    base = flat_parameters(_mlp())
    pool = ModelPool(_mlp)

    def boom(result: LocalResult) -> LocalResult:
        raise TrainingError("diverged")

    def jobs() -> list[TrainingJob[LocalResult]]:  # each with a fresh generator
        made = [_job(base, x, y, p, k, pool) for k, p in enumerate(parts)]
        made[2] = TrainingJob(**{**{f: getattr(made[2], f) for f in TrainingJob.__dataclass_fields__}, "finish": boom})
        return made

    batcher = CohortBatcher(ThreadPoolExecutor(1), pool, max_cohort=3)
    alone = CohortBatcher(ThreadPoolExecutor(1), pool, max_cohort=len(parts))
    try:
        group = batcher.submit_many_async(jobs())
        assert isinstance(group, asyncio.Future) and group.get_loop() is asyncio.get_running_loop()
        together = await group
        each = await asyncio.gather(*(_batch_of_one(alone, j) for j in jobs()), return_exceptions=True)
        assert await batcher.submit_many_async([]) == []
    finally:
        batcher.shutdown()
        alone.shutdown()
    assert batcher.cohorts == 2 and alone.cohorts == 1  # 3 + 3 + a last one trained alone, against 7 together
    assert isinstance(together[2], TrainingError) and isinstance(each[2], TrainingError)
    for k, (got, want) in enumerate(zip(together, each, strict=True)):
        if k != 2:
            assert torch.allclose(got.delta, want.delta, rtol=0, atol=1e-5)  # the last one trained alone
            assert got.loss == pytest.approx(want.loss, rel=1e-5)


async def test_a_cancelled_group_trains_none_of_its_held_jobs() -> None:
    """Cancelling a group's future while its jobs are held keeps it cancelled and starts none of them; the clock's
    wait for a held group starts it."""
    x, y, parts = _data()
    base = flat_parameters(_mlp())
    pool = ModelPool(_mlp)
    batcher = CohortBatcher(ThreadPoolExecutor(1), pool)
    trained: list[int] = []
    jobs = [
        TrainingJob(
            **{
                **{f: getattr(j, f) for f in TrainingJob.__dataclass_fields__},
                "finish": lambda r, k=k: trained.append(k),
            }
        )
        for k, j in enumerate(_job(base, x, y, p, k, pool) for k, p in enumerate(parts[:3]))
    ]
    try:
        group = batcher.submit_many_async(jobs)
        assert group.held  # type: ignore[attr-defined]
        group.cancel()
        batcher.flush()
        with pytest.raises(asyncio.CancelledError):
            await group
        kept = batcher.submit_many_async(jobs[:2])
        batcher._needed(kept)  # what the virtual clock does when it must wait for the group
        assert not kept.held  # type: ignore[attr-defined]
        await kept
    finally:
        batcher.shutdown()
    assert sorted(trained) == [0, 1]


def test_job_of_makes_the_job_the_constructor_makes() -> None:
    """TrainingJob.of gives every attribute the value the keyword constructor gives it."""
    x, y, parts = _data()
    base = flat_parameters(_mlp())
    made = _job(base, x, y, parts[0], 0, ModelPool(_mlp))
    names = list(TrainingJob.__dataclass_fields__)
    values = {name: getattr(made, name) for name in names}
    values.update(correction=base * 0, client=7, deltas_on=torch.device("cpu"), span=(1, 3))
    quick = TrainingJob.of(*(values[name] for name in names))
    assert type(quick) is TrainingJob
    assert all(getattr(quick, name) is values[name] for name in names)
    assert quick.rows().tolist() == made.indices[1:3].tolist()
    values.update(solo=None)
    with pytest.raises(TypeError, match="solo or alone"):
        TrainingJob.of(*(values[name] for name in names))()


async def test_runs_of_delivered_outcomes_settle_groups_as_one_by_one() -> None:
    """Outcomes of jobs of several groups, in any order, handed over as runs of consecutive jobs of one group, leave
    every group with the outcomes, in job order, that delivering each alone leaves; a cancelled group keeps none."""
    loop = asyncio.get_running_loop()
    rng = random.Random(5)
    for _ in range(20):
        sizes = [rng.randrange(1, 12) for _ in range(3)]
        groups = [threads_module._GroupFuture(loop, size) for size in sizes]
        alone = [threads_module._GroupFuture(loop, size) for size in sizes]
        slots = [(g, k) for g, size in enumerate(sizes) for k in range(size)]
        if rng.random() < 0.5:
            rng.shuffle(slots)
        cancelled = rng.randrange(4)  # 3: none
        if cancelled < 3:
            groups[cancelled].cancel()
        error = TrainingError("boom")
        outcomes = [
            (threads_module._Slot(groups[g], k), (g, k), error if rng.random() < 0.2 else None) for g, k in slots
        ]
        for loop_runs in threads_module._runs(outcomes).values():
            threads_module._settle(loop_runs)
        for slot, value, failed in outcomes:
            alone[groups.index(slot.group)].deliver(slot.index, value if failed is None else failed)
        for g, (group, each) in enumerate(zip(groups, alone, strict=True)):
            if g == cancelled:
                assert group.cancelled()
            else:
                assert group.result() == each.result() and len(each.result()) == sizes[g]


class _Recording(ThreadPoolExecutor):
    """A pool that records the cohorts it is given and runs none."""

    def __init__(self) -> None:
        super().__init__(1)
        self.cohorts: list[list[int]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        self.cohorts.append([id(job) for job in args[0].jobs])
        return super().submit(lambda: None)


@pytest.mark.parametrize("elsewhere", [False, True], ids=["here", "train_cohort"])
async def test_jobs_of_one_group_are_held_together_as_one_by_one(elsewhere: bool) -> None:
    """Jobs of one configuration, data set (and base, trained elsewhere) submitted together fill the cohorts that
    each one submitted in turn fills, full ones started at once and the rest held, whatever was held before; jobs of
    mixed groups too."""
    x, y, parts = _data()
    base = flat_parameters(_mlp())
    pool = ModelPool(_mlp)
    cfg = LocalTraining(epochs=1, batch_size=16, lr=0.05)
    other = LocalTraining(epochs=2, batch_size=16, lr=0.05)
    train_cohort = (lambda *args: None) if elsewhere else None

    def jobs(configs: Sequence[LocalTraining]) -> list[TrainingJob[Any]]:
        return [
            dataclasses.replace(_job(base, x, y, parts[k % len(parts)], k, pool), cfg=c) for k, c in enumerate(configs)
        ]

    for configs in ([cfg] * 11, [cfg, other, cfg, cfg, other, cfg, cfg, cfg]):
        made = jobs(configs)
        seen = []
        for together in (True, False):
            inner = _Recording()
            batcher = CohortBatcher(inner, pool, max_cohort=3, train_cohort=train_cohort)  # type: ignore[arg-type]
            batcher.attach(VirtualClock())  # started by the clock (or when full), never by a timer
            try:
                batcher._hold_many(made[:2], [threads_module._HeldFuture() for _ in range(2)])  # held before
                rest = made[2:]
                if together:
                    batcher._hold_many(rest, [threads_module._HeldFuture() for _ in rest])
                else:
                    for job in rest:
                        batcher._hold(job, threads_module._HeldFuture())
                held = [[id(job) for job in h.jobs] for h in batcher._held.values()]
                seen.append((inner.cohorts, held))
            finally:
                batcher.shutdown(wait=True, cancel_futures=True)
        assert seen[0] == seen[1] and seen[0][0]  # some cohorts filled and started


# ------------------------------------------------------------------------------------------------ engine
SERVERS = [
    {"kind": "fedavg", "clients_per_round": 8},
    {"kind": "fedbuff", "buffer_size": 4, "concurrency": 8},
]


@pytest.mark.parametrize("server", SERVERS, ids=["fedavg", "fedbuff"])
@pytest.mark.slow
async def test_vectorized_runs_are_deterministic(server: dict[str, object]) -> None:
    """Same seed, same weights bit for bit, with one or two workers; accuracy as with the thread executor."""
    hashes = set()
    for workers in (1, 2, 1):
        config = small_config("executor.kind=vectorized", f"executor.workers={workers}", server=server)
        summary = await flasync.Federation(config).run()
        hashes.add(summary.weights_sha256)
    assert len(hashes) == 1
    threads = await flasync.Federation(small_config(server=server)).run()
    assert summary.accuracy == pytest.approx(threads.accuracy, abs=0.02)
    assert summary.updates_accepted == threads.updates_accepted


@pytest.mark.slow
async def test_vectorized_fedbuff_trains_clients_of_several_versions_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FedBuff cohorts hold clients dispatched at different versions; the final weights are within 1e-5 of threads."""
    bases_per_cohort: list[int] = []
    real_train = CohortTrainer.train

    def spy(self: CohortTrainer, base: torch.Tensor, *args: object, **kwargs: object) -> object:
        members = args[2]
        assert isinstance(members, list)
        bases_per_cohort.append(len({id(base)} | {id(m.base) for m in members if m.base is not None}))
        return real_train(self, base, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(CohortTrainer, "train", spy)
    server = {"kind": "fedbuff", "buffer_size": 4, "concurrency": 12}
    vectorized = flasync.Federation(small_config("executor.kind=vectorized", server=server))
    await vectorized.run()
    threads = flasync.Federation(small_config("executor.kind=thread", server=server))
    await threads.run()
    assert max(bases_per_cohort) >= 2
    assert torch.allclose(vectorized.weights, threads.weights, rtol=0, atol=1e-5)


@pytest.mark.slow
async def test_vectorized_run_with_an_unbatchable_model_falls_back() -> None:
    """A model with BatchNorm trains one client at a time under the vectorized executor, and finishes."""
    config = small_config("executor.kind=vectorized", "data.kind=synthetic", "data.num_features=64")
    summary = await flasync.Federation(config, model_factory=_BatchNormNet).run()
    assert summary.updates_accepted > 0


def test_device_config_is_validated() -> None:
    """A device that is neither cpu, cuda, cuda:N nor auto is a config error naming the field."""
    with pytest.raises(ConfigError, match=r"executor\.device"):
        small_config("executor.device=gpu")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type in {"cpu", "cuda"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
async def test_cuda_without_cuda_is_a_config_error() -> None:
    """Asking for CUDA on a machine without it, or for fp16 on the CPU, fails before the run starts."""
    with pytest.raises(ConfigError, match=r"executor\.device: device 'cuda' was asked for but CUDA is not available"):
        await flasync.Federation(small_config("executor.device=cuda")).run()
    with pytest.raises(ConfigError, match="fp16 needs a CUDA device"):
        await flasync.Federation(small_config("client.precision=fp16")).run()


# ---------------------------------------------------------------------------------------------------- GPU
@CUDA
@pytest.mark.parametrize("factory", [_mlp, _cnn], ids=["mlp", "cnn"])
def test_vectorized_equals_alone_on_cuda(factory: Callable[[], nn.Module]) -> None:
    """On the GPU too, the cohort matches one-at-a-time training (TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    x, y, parts = _data("cuda")
    cfg = LocalTraining(epochs=2, batch_size=16, lr=0.1, momentum=0.9, clip_norm=0.5)
    base = flat_parameters(factory()).cuda()
    outcome = CohortTrainer(factory().cuda()).train(base, x, y, _members(parts), cfg)
    assert outcome.vectorized
    for got, want in zip(outcome.results, _alone(factory, base, x, y, parts, cfg), strict=True):
        assert got.delta.device.type == "cuda"
        assert torch.allclose(got.delta, want.delta, rtol=0, atol=1e-5)


@CUDA
def test_a_cohorts_deltas_cross_from_cuda_to_the_host_in_one_copy() -> None:
    """deltas_on=cpu returns the same deltas and norms as training leaves on the GPU, on the host."""
    x, y, parts = _data("cuda")
    cfg = LocalTraining(epochs=1, batch_size=16, lr=0.05, momentum=0.9)
    base = flat_parameters(_mlp()).cuda()
    trainer = CohortTrainer(_mlp().cuda())
    on_device = trainer.train(base, x, y, _members(parts), cfg)
    on_host = trainer.train(base, x, y, _members(parts), cfg, deltas_on=torch.device("cpu"))
    assert on_host.vectorized
    for a, b in zip(on_device.results, on_host.results, strict=True):
        assert a.delta.device.type == "cuda" and b.delta.device.type == "cpu"
        assert torch.equal(a.delta.cpu(), b.delta)
        assert a.update_norm == b.update_norm


@CUDA
def test_host_data_is_prefetched_to_cuda() -> None:
    """Data left in (pinned) host memory trains to the same result as data on the GPU."""
    x, y, parts = _data()
    cfg = LocalTraining(epochs=1, batch_size=16, lr=0.05)
    base = flat_parameters(_mlp()).cuda()
    trainer = CohortTrainer(_mlp().cuda())
    on_host = trainer.train(base, x.pin_memory(), y.pin_memory(), _members(parts), cfg)
    on_device = trainer.train(base, x.cuda(), y.cuda(), _members([p.cuda() for p in parts]), cfg)
    for a, b in zip(on_host.results, on_device.results, strict=True):
        assert torch.equal(a.delta, b.delta)


@CUDA
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("kind", ["thread", "vectorized"])
async def test_cuda_runs(precision: str, kind: str) -> None:
    """Runs on the GPU with each precision and executor, and learns."""
    config = small_config(f"executor.kind={kind}", "executor.device=cuda", f"client.precision={precision}")
    summary = await flasync.Federation(config).run()
    assert summary.accuracy > 0.5


@pytest.mark.slow
async def test_lazy_synthetic_clients_scale_to_a_large_population() -> None:
    """200,000 clients whose data is drawn when sampled: a vectorized run is deterministic and equals threads."""
    config = small_config(
        "executor.kind=vectorized",
        "population.num_clients=200000",
        "data.kind=synthetic",
        "data.lazy=true",
        "data.test_samples=200",
        "client.epochs=1",
        "stop.max_versions=3",
        server={"kind": "fedavg", "clients_per_round": 16},
    )
    runs = [await flasync.Federation(config).run() for _ in range(2)]
    threads = await flasync.Federation(
        config.model_copy(update={"executor": config.executor.model_copy(update={"kind": "thread"})})
    ).run()
    assert runs[0].weights_sha256 == runs[1].weights_sha256
    assert runs[0].updates_accepted == threads.updates_accepted == 48
    assert runs[0].accuracy == pytest.approx(threads.accuracy, abs=0.02)


@CUDA
async def test_cuda_workers_train_on_their_own_streams_deterministically() -> None:
    """Two workers, each on its own CUDA stream, give the same weights run after run."""
    config = small_config("executor.device=cuda", "executor.workers=2")
    first = await flasync.Federation(config).run()
    second = await flasync.Federation(config).run()
    assert first.weights_sha256 == second.weights_sha256


def test_gradient_checkpointing_falls_back_to_one_client_at_a_time() -> None:
    """Checkpointed training is not vectorized; the per-client results still match training alone."""
    x, y, parts = _data()
    base = flat_parameters(_mlp())
    cfg = LocalTraining(epochs=1, batch_size=16, lr=0.05, checkpoint_segments=2)
    outcome = CohortTrainer(_mlp()).train(base, x, y, _members(parts), cfg)
    assert not outcome.vectorized
    assert outcome.fallback_reason is not None and "checkpointing" in outcome.fallback_reason
    for got, want in zip(outcome.results, _alone(_mlp, base, x, y, parts, cfg), strict=True):
        torch.testing.assert_close(got.delta, want.delta)


def test_vectorized_corrections_equal_one_client_at_a_time() -> None:
    """Each member's own correction row (SCAFFOLD's c - c_i) gives what train() gives that client alone."""
    x, y, parts = _data()
    parts = _no_single_sample_batches(parts)
    cfg = LocalTraining(epochs=2, batch_size=16, lr=0.05, momentum=0.9)
    module = _mlp()
    base = flat_parameters(module).detach().clone()
    n = base.numel()
    corrections = [torch.full((n,), 0.01 * (k + 1)) if k % 2 == 0 else None for k in range(len(parts))]
    members = [
        CohortMember(indices=part, generator=seeding.torch_stream(3, k), correction=corrections[k])
        for k, part in enumerate(parts)
    ]
    outcome = CohortTrainer(module).train(base, x, y, members, cfg)
    assert outcome.vectorized
    for k, part in enumerate(parts):
        alone = train(
            FlatModel(_mlp()), base, x[part], y[part], cfg, seeding.torch_stream(3, k), correction=corrections[k]
        )
        torch.testing.assert_close(outcome.results[k].delta, alone.delta, rtol=1e-4, atol=1e-5)


def test_an_objective_that_is_not_vectorizable_trains_one_client_at_a_time() -> None:
    """A cohort whose objective says it is not vectorizable falls back, naming the objective; results match."""
    x, y, parts = _data()
    base = flat_parameters(_mlp())
    cfg = LocalTraining(epochs=1, batch_size=16, lr=0.05, objective=Focal(vectorizable=False))
    outcome = CohortTrainer(_mlp()).train(base, x, y, _members(parts), cfg)
    assert not outcome.vectorized
    assert outcome.fallback_reason == "the objective Focal is not vectorizable"
    for got, want in zip(outcome.results, _alone(_mlp, base, x, y, parts, cfg), strict=True):
        assert torch.equal(got.delta, want.delta)


def test_the_vectorized_executor_refuses_an_objective_that_is_not_vectorizable() -> None:
    """Federation(objective=...) with executor.kind=vectorized is a one-line ConfigError naming the objective."""
    with pytest.raises(ConfigError, match=r"^executor\.kind: the objective Focal is not vectorizable;[^\n]*$"):
        flasync.Federation(small_config("executor.kind=vectorized"), objective=Focal(vectorizable=False))


@pytest.mark.parametrize(
    ("overrides", "kind", "why"),
    [
        ((), "thread", "fedbuff with 8 clients in flight (< 16 for its own cohort_forward)"),
        (
            ("server={kind: fedbuff, concurrency: 20}", "population.num_clients=100"),
            "vectorized",
            "fedbuff with 20 clients in flight",
        ),
        (
            ("server={kind: fedbuff, concurrency: 20}", "population.num_clients=100", "model={kind: cnn}"),
            "thread",
            "fedbuff with 20 clients in flight (< 48 for vmap)",
        ),
        (
            ("server={kind: fedbuff, concurrency: 64}", "population.num_clients=100", "model={kind: cnn}"),
            "vectorized",
            "fedbuff with 64 clients in flight",
        ),
        (("server={kind: fedasync, concurrency: 8}",), "thread", "fedasync with 8 clients in flight (< 16"),
        (("server={kind: fedavg, clients_per_round: 10}",), "thread", "rounds of 10 clients (< 32)"),
        (("server={kind: fedavg, clients_per_round: 40}", "population.num_clients=50"), "vectorized", "40 clients"),
        (
            (
                "server={kind: fedavg, clients_per_round: 40}",
                "population.num_clients=50",
                "client.checkpoint_segments=2",
            ),
            "thread",
            "gradient checkpointing",
        ),
    ],
    ids=[
        "fedbuff",
        "fedbuff-own-cohort-forward",
        "fedbuff-vmap-few-in-flight",
        "fedbuff-vmap-many-in-flight",
        "fedasync",
        "small-rounds",
        "large-rounds",
        "checkpointing",
    ],
)
def test_auto_picks_vectorized_for_large_rounds_and_many_clients_in_flight(
    overrides: tuple[str, ...], kind: str, why: str
) -> None:
    """executor.kind = auto (the default) trains large rounds and many clients in flight as cohorts, and says why."""
    from flasync.runtime.prepare import RunInputs
    from flasync.runtime.sizing import choose_executor

    config = small_config(*overrides)
    assert config.executor.kind == "auto"
    chosen, reason = choose_executor(config, RunInputs(config).prepare())
    assert chosen == kind and why in reason


@pytest.mark.parametrize(
    ("overrides", "kind", "why"),
    [
        ((), "vectorized", "fedbuff with 8 clients in flight on cuda"),
        (("model={kind: cnn}",), "vectorized", "fedbuff with 8 clients in flight on cuda"),
        (("server={kind: fedbuff, concurrency: 1}",), "thread", "fedbuff with 1 clients in flight (< 2 for cuda)"),
        (("server={kind: fedavg, clients_per_round: 4}",), "vectorized", "FedAvg rounds of 4 clients on cuda"),
        (("server={kind: fedavg, clients_per_round: 1}",), "thread", "rounds of 1 clients (< 2)"),
        (("server={kind: fedavg, clients_per_round: 4}", "client.checkpoint_segments=2"), "thread", "checkpointing"),
    ],
    ids=["fedbuff", "fedbuff-vmap", "one-in-flight", "small-rounds", "one-a-round", "checkpointing"],
)
def test_auto_on_an_accelerator_picks_cohorts_from_two_clients(overrides: tuple[str, ...], kind: str, why: str) -> None:
    """On a CUDA device (where one client's training is bound by kernel launches) auto trains cohorts whenever two
    clients train at once; what cannot be batched still trains on the threads. (Only the choice is tested: the
    device is named, not used.)"""
    import dataclasses

    from flasync.runtime.prepare import RunInputs
    from flasync.runtime.sizing import choose_executor

    config = small_config(*overrides)
    prepared = dataclasses.replace(RunInputs(config).prepare(), device=torch.device("cuda"))
    chosen, reason = choose_executor(config, prepared)
    assert chosen == kind and why in reason


def test_auto_says_which_executor_it_picked_and_trains_with_it() -> None:
    """The run logs executor.auto with the choice; a large FedAvg round under auto equals kind = vectorized."""
    from structlog.testing import capture_logs

    overrides = ("server={kind: fedavg, clients_per_round: 40}", "population.num_clients=50", "stop.max_versions=2")
    with capture_logs() as logs:
        auto = flasync.run(small_config(*overrides, "tracking.log_level=info"))
    picked = [e["detail"] for e in logs if e["event"] == "executor.auto"]
    assert picked == ["vectorized: FedAvg rounds of 40 clients: one cohort each"]
    vectorized = flasync.run(small_config(*overrides, "executor.kind=vectorized"))
    threads = flasync.run(small_config(*overrides, "executor.kind=thread"))
    assert auto.weights_sha256 == vectorized.weights_sha256
    assert threads.updates_accepted == auto.updates_accepted


@pytest.mark.parametrize(
    ("kind", "device", "cores", "available", "expected", "why"),
    [
        ("vectorized", "cpu", 2, None, 2, "one per core (2, at most 4)"),
        ("vectorized", "cpu", 16, 64 << 30, 4, "one per core (16, at most 4)"),
        ("vectorized", "cpu", 1, None, 1, "one per core (1, at most 4)"),
        # 1M parameters, cohorts of 256: 3 GiB each; 7 GiB free holds one in its half.
        ("vectorized", "cpu", 8, 7 << 30, 1, "as many cohorts of 256 as half the free memory holds"),
        ("thread", "cpu", 8, None, 1, "one training thread"),
        ("vectorized", "cuda", 8, None, 1, "one training thread"),
    ],
)
def test_unset_workers_give_vectorized_cpu_cohorts_a_thread_per_core_within_memory(
    kind: str, device: str, cores: int, available: int | None, expected: int, why: str
) -> None:
    """executor.workers unset: one training thread per core (at most 4) for vectorized cohorts on the CPU, no more
    cohorts at once than half the free memory holds; one thread for the threads executor and on a GPU."""
    from flasync.runtime.sizing import default_workers

    workers, reason = default_workers(
        kind, torch.device(device), cores=cores, num_params=1 << 20, max_cohort=256, available_bytes=available
    )
    assert workers == expected and why in reason


@pytest.mark.parametrize(
    ("jobs", "member_cpu_s", "parts"),
    [
        (70, None, 2),  # nothing trained yet: at least MIN_SPLIT members a cohort
        (63, None, 1),
        (100, 1e-4, 1),  # 5 ms a cohort: cheaper than the GIL's hand-overs between two threads
        (240, 1e-4, 2),  # 12 ms a cohort
        (70, 2e-3, 2),  # a heavy model: split as soon as the cohorts hold MIN_SPLIT members
        (300, 1e-4, 2),  # never more than parallel
    ],
)
def test_a_group_is_split_only_into_cohorts_worth_a_thread(jobs: int, member_cpu_s: float | None, parts: int) -> None:
    """A group is split into cohorts of at least MIN_SPLIT members that each train for at least MIN_PART_S of CPU at
    the pace of the last cohort trained, at most one a thread."""
    found = cohorts_for(
        jobs,
        parallel=2,
        member_cpu_s=member_cpu_s,
        min_split=CohortBatcher.MIN_SPLIT,
        min_part_s=CohortBatcher.MIN_PART_S,
    )
    assert found == parts


async def test_a_trained_cohort_sets_the_pace_the_split_is_judged_by() -> None:
    """A cohort trained on the batcher's own trainer records its CPU per member (read from the training thread's CPU
    clock), which then decides the split: a group whose cohorts would train for less than MIN_PART_S each stays
    whole."""
    readings = iter([1.0, 1.004])  # 4 ms of CPU for a cohort of 40: 0.1 ms a member
    torch.manual_seed(0)
    x, y = torch.randn(40 * 20, FEATURES), torch.randint(0, CLASSES, (40 * 20,))
    parts = list(torch.arange(40 * 20).split(20))
    base = flat_parameters(_mlp())
    pool = ModelPool(_mlp)
    batcher = CohortBatcher(ThreadPoolExecutor(2), pool, parallel=2, cpu_time=lambda: next(readings))
    try:
        assert batcher.parts(100) == 2  # nothing trained yet
        futures = [batcher.submit(_job(base, x, y, p, k, pool)) for k, p in enumerate(parts)]
        batcher.flush()
        await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        assert batcher._member_cpu_s == pytest.approx(1e-4)
        assert batcher.parts(100) == 1  # two cohorts of 5 ms
        assert batcher.parts(240) == 2  # two cohorts of 12 ms
    finally:
        batcher.shutdown()


async def test_cohorts_trained_off_the_cpu_leave_the_split_to_min_split() -> None:
    """On an accelerator the training thread's CPU only launches kernels: a cohort trained there sets no pace, and
    groups keep being split by MIN_SPLIT alone."""
    readings = iter([1.0, 1.004])
    torch.manual_seed(0)
    x, y = torch.randn(40 * 20, FEATURES), torch.randint(0, CLASSES, (40 * 20,))
    parts = list(torch.arange(40 * 20).split(20))
    base = flat_parameters(_mlp())

    class OnAnAccelerator(ModelPool):
        """Trainers that say they train on a GPU (and train on the CPU here)."""

        def cohort_trainer(self) -> CohortTrainer:
            real = super().cohort_trainer()
            return SimpleNamespace(device=torch.device("cuda"), train=real.train)  # type: ignore[return-value]

    pool = OnAnAccelerator(_mlp)
    batcher = CohortBatcher(ThreadPoolExecutor(2), pool, parallel=2, cpu_time=lambda: next(readings))
    try:
        futures = [batcher.submit(_job(base, x, y, p, k, pool)) for k, p in enumerate(parts)]
        batcher.flush()
        await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        assert batcher._member_cpu_s is None
        assert batcher.parts(100) == 2
    finally:
        batcher.shutdown()


@pytest.mark.slow
def test_a_round_trains_on_a_thread_per_core_in_cohorts_side_by_side_with_the_weights_of_one_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With executor.workers unset (two cores here), a round of 70 is split into two cohorts of 35 that train side by
    side (the MLP and a CNN), and one of 40 cut by max_cohort = 8 trains on two threads too; each run says so and ends
    with the weights of one training thread, whose round of 70 is one cohort. (Every round splits here: no least
    CPU per split-off cohort.)"""
    from structlog.testing import capture_logs

    from flasync.runtime import sizing

    monkeypatch.setattr(sizing, "_cores", lambda: 2)
    monkeypatch.setattr(CohortBatcher, "MIN_PART_S", 0.0)
    sizes: list[int] = []
    real = CohortTrainer.train

    def recorded(
        self: CohortTrainer,
        base: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        members: list[CohortMember],
        *args: object,
        **kwargs: object,
    ) -> object:
        sizes.append(len(members))
        return real(self, base, x, y, members, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(CohortTrainer, "train", recorded)
    for clients, cohort, expected, model in (
        (70, 256, [35, 35], "mlp"),
        (70, 256, [35, 35], "cnn"),  # through vmap, not the MLP's own cohort_forward
        (40, 8, [8] * 5, "mlp"),
    ):
        overrides = (
            f"server={{kind: fedavg, clients_per_round: {clients}}}",
            "population.num_clients=80",
            "stop.max_versions=2",
            "executor.kind=vectorized",
            f"executor.max_cohort={cohort}",
            f"model={{kind: {model}}}",
        )
        sizes.clear()
        with capture_logs() as logs:
            unset = flasync.run(small_config(*overrides, "tracking.log_level=info"))
        said = [e["detail"] for e in logs if e["event"] == "executor.workers"]
        assert said == ["2 training threads: one per core (2, at most 4) for vectorized cohorts"]
        assert sorted(sizes) == sorted(expected * 2)  # two rounds
        sizes.clear()
        one = flasync.run(small_config(*overrides, "executor.workers=1"))
        assert sorted(sizes) == sorted(([clients] if clients <= cohort else expected) * 2)
        assert unset.weights_sha256 == one.weights_sha256


@pytest.mark.parametrize(
    ("cfg", "written_out"),
    [
        (LocalTraining(epochs=1, batch_size=16, lr=0.05), True),
        (LocalTraining(epochs=1, batch_size=16, lr=0.05, precision="bf16"), False),
        (LocalTraining(epochs=1, batch_size=16, lr=0.05, objective=Focal(vectorizable=True)), False),
    ],
)
def test_the_mlp_written_out_backward_is_used_for_plain_float32_cross_entropy(
    cfg: LocalTraining, written_out: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MLP's own cohort_gradients replace autograd for float32 cross-entropy (within 1e-5 of one client at a
    time); mixed precision and other objectives go through autograd, and so does a subclass with its own forward."""
    calls: list[int] = []
    real = MLP.cohort_gradients

    def counted(self: MLP, *args: object) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        calls.append(1)
        return real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(MLP, "cohort_gradients", counted)
    x, y, parts = _data()
    base = flat_parameters(_mlp())
    outcome = CohortTrainer(_mlp()).train(base, x, y, _members(parts), cfg)
    assert outcome.vectorized and bool(calls) is written_out
    if written_out:
        for got, want in zip(outcome.results, _alone(_mlp, base, x, y, parts, cfg), strict=True):
            assert torch.allclose(got.delta, want.delta, rtol=0, atol=1e-5)

    class Doubled(MLP):
        def cohort_forward(self, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return 2 * super().cohort_forward(params, x)

    calls.clear()
    CohortTrainer(Doubled(FEATURES, [32], CLASSES)).train(base, x, y, _members(parts), cfg)
    assert not calls


def test_an_mlp_with_a_layer_its_written_out_backward_does_not_take_trains_through_autograd() -> None:
    """An MLP whose ReLU was replaced (cohort_forward follows its layers, cohort_gradients knows Linear and ReLU
    only) still trains vectorized, through autograd, within 1e-5 of one client at a time."""

    def factory() -> nn.Module:
        model = MLP(FEATURES, [32], CLASSES)
        model.layers[1] = nn.Tanh()
        return model

    x, y, parts = _data()
    base = flat_parameters(factory())
    cfg = LocalTraining(epochs=1, batch_size=16, lr=0.05)
    outcome = CohortTrainer(factory()).train(base, x, y, _members(parts), cfg)
    assert outcome.vectorized and outcome.fallback_reason is None
    for got, want in zip(outcome.results, _alone(factory, base, x, y, parts, cfg), strict=True):
        assert torch.allclose(got.delta, want.delta, rtol=0, atol=1e-5)
