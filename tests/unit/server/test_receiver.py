"""The cloud's receiver: a batch of uploads taken together is taken as its uploads one by one."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flasync import codecs
from flasync.aggregation import BufferedAggregator, FlatSGD, PolynomialStaleness, SampleExampleWeight
from flasync.codecs.validation import UpdateValidator
from flasync.core.bus import EventBus
from flasync.core.client_table import ClientTable
from flasync.core.events import (
    CLOUD,
    ClientId,
    UpdateReceived,
    UpdateRejected,
    UpdatesReceived,
    UpdateUploaded,
    Version,
)
from flasync.server import Accounting, Intake
from flasync.server.intake import Decoded
from flasync.server.node import AggregationNode
from flasync.server.receiver import CloudReceiver
from tests.unit.server.stand_ins import TasksInFlight

pytestmark = pytest.mark.timeout(60)

N = 6
VERSION = 3


class _Versions:
    """The cloud's versions as the receiver reads them."""

    version = Version(VERSION)

    def elapsed_s(self) -> float:
        return 1.0


class _Policy:
    """Records what it learns of each upload."""

    def __init__(self, ready: Any = None) -> None:
        self.notes: list[tuple[int, bool]] = []
        self.ready = ready

    def note(self, message: Any, *, accepted: bool) -> None:
        self.notes.append((message.task_id, accepted))

    def step_due(self) -> bool:
        return bool(self.ready())


class _Log:
    """A logger that records every line: its level, event and fields."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def debug(self, event: str, **fields: Any) -> None:
        self.lines.append(("debug", event, fields))

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append(("info", event, fields))

    def warning(self, event: str, **fields: Any) -> None:
        self.lines.append(("warning", event, fields))


class _Cloud:
    """A receiver over a real intake, node, FedBuff aggregator, accounting and bus."""

    def __init__(
        self,
        tasks: list[tuple[int, int, int]],
        *,
        history: bool = True,
        clip_norm: float | None = None,
        clients: bool = False,
        runs: bool = True,
        size: int = 1000,
    ) -> None:
        self.bus = EventBus()
        self.seen = self.bus.subscribe(capacity=10_000)
        self.registry = TasksInFlight(N, *tasks)
        bounds: dict[str, Any] = {"zscore_threshold": 3.0, "norm_bound_factor": 4.0} if history else {}
        self.intake = Intake(
            registry=self.registry,  # type: ignore[arg-type]
            codec=codecs.Pipeline(),
            num_params=N,
            device=torch.device("cpu"),
            validator=UpdateValidator(N, max_norm=40.0, min_history=3, **bounds),
            max_staleness=2,
            clip_norm=clip_norm,
            wall=lambda: 0.0,
        )
        self.weights = torch.zeros(N)
        self.aggregator = BufferedAggregator(
            self.weights,
            size=size,
            optimizer=FlatSGD(self.weights),
            staleness=PolynomialStaleness(),
            example_weight=SampleExampleWeight(),
        )
        node = AggregationNode(
            where=CLOUD,
            intake=self.intake,
            bus=self.bus,
            wall=lambda: 0.0,
            edge_codec=codecs.Pipeline(),
            num_params=N,
            device=torch.device("cpu"),
        )
        self.policy = _Policy(self.aggregator.ready)
        self.log = _Log()
        self.accounting = Accounting(failure_limit=10, clients=ClientTable(4, 2) if clients else None)
        self.receiver = CloudReceiver(
            node,
            aggregator=self.aggregator,
            versions=_Versions(),  # type: ignore[arg-type]
            policy=self.policy,  # type: ignore[arg-type]
            accounting=self.accounting,
            bus=self.bus,
            log=self.log,
        )
        if not runs:  # each upload taken alone, as before runs were settled together
            self.receiver._runs = None

    def events(self) -> list[Any]:
        """What was published, batches spelt out as their members."""
        out: list[Any] = []
        for event in self.seen.queued():
            out.extend(event.members if isinstance(event, UpdatesReceived) else (event,))
        return out


def _batch(seed: int, count: int, wrong_size: bool) -> tuple[list[UpdateUploaded], list[tuple[int, int, int]]]:
    """Uploads of every fate (good, a norm over the bound, NaN, Inf, stale, no such task, the norm bound, a wrong
    length) and the tasks in flight they answer."""
    generator = torch.Generator().manual_seed(seed)
    uploads: list[UpdateUploaded] = []
    tasks: list[tuple[int, int, int]] = []
    for k in range(count):
        fate = int(torch.randint(0, 9, (1,), generator=generator))
        if (
            fate == 8 and uploads and not (wrong_size and k == count // 2)
        ):  # an upload again: its task was answered (or was never there)
            uploads.append(uploads[int(torch.randint(0, len(uploads), (1,), generator=generator))])
            continue
        fate = min(fate, 7)
        delta = torch.randn(N, generator=generator) * float(torch.empty(1).uniform_(0.5, 3.0, generator=generator))
        base = 0 if fate == 4 else int(torch.randint(1, VERSION + 1, (1,), generator=generator))
        if fate == 1:
            delta = delta * 100.0
        elif fate == 2:
            delta[k % N] = math.nan
        elif fate == 3:
            delta[k % N] = -math.inf
        elif fate == 6:
            delta = delta * 10.0
        if wrong_size and k == count // 2:
            delta = torch.ones(N + 2)
        uploads.append(
            UpdateUploaded(
                task_id=k,
                client_id=ClientId(k),
                base_version=Version(base),
                num_samples=1 + k % 5,
                payload=codecs.Pipeline().encode(delta).payload,
                train_loss=0.0,
                simulated_s=float(k),
                sent_wall_s=0.0,
            )
        )
        if fate != 5:
            tasks.append((k, k, base))
    return uploads, tasks


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    count=st.integers(2, 12),
    wrong_size=st.booleans(),
    history=st.booleans(),
    clip=st.booleans(),
    clients=st.booleans(),
)
async def test_a_batch_is_received_as_its_uploads_one_by_one(
    seed: int, count: int, wrong_size: bool, history: bool, clip: bool, clients: bool
) -> None:
    """A batch with refusals of every kind (a norm over the bound, NaN, Inf, stale, no such task, an upload again, the
    norm bound, the wrong length) and plain uploads between them, decoded and checked together and received at once
    (its runs of plain uploads settled together), publishes the same events in the same order (each refusal in its
    place), notes the policy alike, logs the same lines, releases the same tasks, counts the same (per client too),
    keeps the same validator history and folds the same weights bit for bit as its uploads received one by one, each
    checked at its admission and taken alone, and as the batch received two uploads at a time; with or without the
    checks against the norms seen before, with or without clipping."""
    uploads, tasks = _batch(seed, count, wrong_size)
    options: dict[str, Any] = {"history": history, "clip_norm": 2.0 if clip else None, "clients": clients}
    together, one_by_one, pairs = (
        _Cloud(tasks, **options),
        _Cloud(tasks, runs=False, **options),
        _Cloud(tasks, **options),
    )
    entries = together.intake.decode(uploads)
    assert all((entry.alone is None) == wrong_size for entry in entries)
    await together.receiver.receive(list(zip(uploads, entries, strict=True)))
    for upload, entry in zip(uploads, entries, strict=True):
        late: Decoded = entry._replace(alone=None)  # its checks all made at its admission, with the batch's norm
        await one_by_one.receiver.receive([(upload, late)])
    for first in range(0, count, 2):  # the batch in twos (a run of one last where the count is odd), the same rows
        await pairs.receiver.receive(list(zip(uploads, entries, strict=True))[first : first + 2])
    events = together.events()
    for other in (one_by_one, pairs):
        assert events == other.events()
        assert together.policy.notes == other.policy.notes
        assert together.log.lines == other.log.lines
        assert together.registry.released == other.registry.released
        assert together.accounting.state_dict() == other.accounting.state_dict()
        assert together.intake.state_dict() == other.intake.state_dict()
        assert together.intake.validator._seen == other.intake.validator._seen
        assert torch.equal(together.aggregator.buffer.weighted_sum, other.aggregator.buffer.weighted_sum)
        assert together.aggregator.buffer.total_example_weight == other.aggregator.buffer.total_example_weight
        assert together.aggregator.count() == other.aggregator.count()
    assert [event.task_id for event in events if isinstance(event, UpdateReceived | UpdateRejected)] == [
        upload.task_id for upload in uploads
    ]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    count=st.integers(2, 12),
    size=st.integers(1, 8),
    history=st.booleans(),
)
async def test_a_batch_taken_with_refills_stops_at_the_version_and_refills_between_uploads_as_one_by_one(
    seed: int, count: int, size: int, history: bool
) -> None:
    """With a refill hook, a batch with refusals of every kind into a buffer of ``size`` is taken up to the upload
    that makes the version due, and the hook is called after each other upload's outcome, in the state one-by-one
    receipt leaves between two uploads (the same tasks released, what a refill's draws read): the same uploads taken,
    events, notes, counts and weights as each upload received alone with a refill after each until the version is
    due."""
    uploads, tasks = _batch(seed, count, wrong_size=False)
    together, one_by_one = _Cloud(tasks, history=history, size=size), _Cloud(tasks, history=history, size=size)
    seen: dict[str, list[list[int]]] = {"together": [], "one_by_one": []}

    def hook(cloud: _Cloud, name: str) -> Any:
        return lambda: seen[name].append(list(cloud.registry.released))

    entries = together.intake.decode(uploads)
    taken = await together.receiver.receive(
        list(zip(uploads, entries, strict=True)), now=2.5, refill=hook(together, "together")
    )
    alone = 0
    for upload, entry in zip(uploads, entries, strict=True):
        await one_by_one.receiver.receive([(upload, entry)], now=2.5)
        alone += 1
        if one_by_one.aggregator.ready():
            break
        hook(one_by_one, "one_by_one")()
    assert taken == alone and (taken == count or together.aggregator.ready())
    assert seen["together"] == seen["one_by_one"]
    assert together.events() == one_by_one.events()
    assert together.policy.notes == one_by_one.policy.notes
    assert together.accounting.state_dict() == one_by_one.accounting.state_dict()
    assert torch.equal(together.aggregator.buffer.weighted_sum, one_by_one.aggregator.buffer.weighted_sum)
    assert together.aggregator.count() == one_by_one.aggregator.count() <= size


async def test_an_update_the_buffer_cannot_weigh_fails_the_batch_after_the_updates_before_it() -> None:
    """An update whose weights the buffer refuses (no samples, under sample weighting) raises where it would alone:
    the plain updates before it are admitted, counted and folded, it and those after it are not."""
    generator = torch.Generator().manual_seed(5)
    uploads = [
        UpdateUploaded(
            task_id=k,
            client_id=ClientId(k),
            base_version=Version(VERSION),
            num_samples=0 if k == 5 else 1 + k,
            payload=codecs.Pipeline().encode(torch.randn(N, generator=generator)).payload,
            train_loss=0.0,
            simulated_s=float(k),
            sent_wall_s=0.0,
        )
        for k in range(8)
    ]
    tasks = [(k, k, VERSION) for k in range(8)]
    results = []
    for runs in (True, False):
        cloud = _Cloud(tasks, runs=runs)
        entries = cloud.intake.decode(uploads)
        with pytest.raises(ValueError, match="example_weight"):
            await cloud.receiver.receive(list(zip(uploads, entries, strict=True)))
        results.append(cloud)
    together, one_by_one = results
    assert together.registry.released == one_by_one.registry.released
    assert together.accounting.state_dict() == one_by_one.accounting.state_dict()
    assert together.intake.state_dict() == one_by_one.intake.state_dict()
    assert torch.equal(together.aggregator.buffer.weighted_sum, one_by_one.aggregator.buffer.weighted_sum)
    assert together.events() == one_by_one.events() == []
    assert together.registry.released == [0, 1, 2, 3, 4, 5] and together.aggregator.count() == 5


class _Clocked(_Versions):
    """Versions whose run started ``elapsed`` seconds ago (set by the test)."""

    elapsed = 0.0

    def elapsed_s(self) -> float:
        return self.elapsed


async def test_the_first_accepted_update_times_the_start_up_and_later_ones_keep_it() -> None:
    """The run's start-up is the time of its first accepted update: a refused one before it does not set it, and
    neither does any update after it (nor one received once a checkpoint restored it)."""
    uploads, tasks = _batch(3, 12, wrong_size=False)
    cloud, versions = _Cloud(tasks), _Clocked()
    cloud.receiver.versions = versions  # type: ignore[assignment]
    stats = cloud.accounting.stats
    for number, upload in enumerate(uploads):
        versions.elapsed = 10.0 + number
        accepted = stats.updates_accepted
        await cloud.receiver.receive([(upload, cloud.intake.decode([upload])[0])])
        if not accepted:
            assert (stats.updates_accepted == 0) == math.isnan(stats.first_update_s)
            if stats.updates_accepted:
                assert stats.first_update_s == 10.0 + number
    assert stats.updates_accepted and stats.first_update_s < 10.0 + len(uploads) - 1
    restored = _Cloud(tasks)
    restored.accounting.stats.first_update_s = 0.25
    restored.receiver.versions = versions  # type: ignore[assignment]
    for upload in uploads:
        await restored.receiver.receive([(upload, restored.intake.decode([upload])[0])])
    assert restored.accounting.stats.updates_accepted and restored.accounting.stats.first_update_s == 0.25


@pytest.mark.parametrize("now", [None, 12.5])
async def test_the_events_of_a_run_equal_those_the_keyword_constructor_makes(now: float | None) -> None:
    """The events of a run of plain uploads settled together (made column by column from their fields in order)
    equal, field for field and class for class, the events the keyword constructor makes of each upload's figures
    (received at ``now`` when given, else when sent), and stay frozen; the policy learns of each, in order."""
    generator = torch.Generator().manual_seed(11)
    uploads = [
        UpdateUploaded(
            task_id=k,
            client_id=ClientId(100 + k),
            base_version=Version(1 + k % VERSION),
            num_samples=1 + k,
            payload=codecs.Pipeline().encode(torch.randn(N, generator=generator)).payload,
            train_loss=0.0,
            simulated_s=0.5 * k,
            sent_wall_s=-0.25 * k,
            tier="edge-7" if k % 2 else "client",
        )
        for k in range(7)
    ]
    cloud = _Cloud([(k, 100 + k, 1 + k % VERSION) for k in range(7)], history=False)
    ticks = iter(range(1, 100))
    cloud.intake.wall = lambda: 0.875 * next(ticks)  # the batch's decoding takes 0.875 s: 0.125 s each
    entries = cloud.intake.decode(uploads)
    await cloud.receiver.receive(list(zip(uploads, entries, strict=True)), now=now)
    events = cloud.events()
    expected = [
        UpdateReceived(
            task_id=upload.task_id,
            client_id=upload.client_id,
            base_version=upload.base_version,
            version=Version(VERSION),
            staleness=VERSION - upload.base_version,
            upload_bytes=upload.upload_bytes,
            simulated_s=upload.simulated_s if now is None else now,
            tier=upload.tier,
            decode_s=0.125,
            queue_wait_s=-upload.sent_wall_s,  # received at wall time 0
        )
        for upload in uploads
    ]
    assert events == expected
    assert all(type(event) is UpdateReceived for event in events)
    assert cloud.policy.notes == [(upload.task_id, True) for upload in uploads]
    with pytest.raises(AttributeError):
        events[0].staleness = 0  # type: ignore[misc]
