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
from flasync.testing import NullLog
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

    def __init__(self) -> None:
        self.notes: list[tuple[int, bool]] = []

    def note(self, message: Any, *, accepted: bool) -> None:
        self.notes.append((message.task_id, accepted))


class _Cloud:
    """A receiver over a real intake, node, FedBuff aggregator, accounting and bus."""

    def __init__(self, tasks: list[tuple[int, int, int]]) -> None:
        self.bus = EventBus()
        self.seen = self.bus.subscribe(capacity=10_000)
        self.intake = Intake(
            registry=TasksInFlight(N, *tasks),  # type: ignore[arg-type]
            codec=codecs.Pipeline(),
            num_params=N,
            device=torch.device("cpu"),
            validator=UpdateValidator(N, max_norm=40.0, zscore_threshold=3.0, min_history=3, norm_bound_factor=4.0),
            max_staleness=2,
            clip_norm=None,
            wall=lambda: 0.0,
        )
        self.weights = torch.zeros(N)
        self.aggregator = BufferedAggregator(
            self.weights,
            size=1000,
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
        self.policy = _Policy()
        self.accounting = Accounting(failure_limit=10)
        self.receiver = CloudReceiver(
            node,
            aggregator=self.aggregator,
            versions=_Versions(),  # type: ignore[arg-type]
            policy=self.policy,  # type: ignore[arg-type]
            accounting=self.accounting,
            bus=self.bus,
            log=NullLog(),
        )

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
    uploads, tasks = [], []
    for k in range(count):
        fate = int(torch.randint(0, 8, (1,), generator=generator))
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


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), count=st.integers(2, 12), wrong_size=st.booleans())
async def test_a_batch_is_received_as_its_uploads_one_by_one(seed: int, count: int, wrong_size: bool) -> None:
    """A batch with refusals of every kind (a norm over the bound, NaN, Inf, stale, no such task, the norm bound, the
    wrong length), decoded and checked together and received at once, publishes the same events in the same order
    (each refusal in its place), notes the policy alike, counts the same and folds the same weights bit for bit as
    its uploads received one by one, each checked at its admission."""
    uploads, tasks = _batch(seed, count, wrong_size)
    together, one_by_one = _Cloud(tasks), _Cloud(tasks)
    entries = together.intake.decode(uploads)
    assert all((entry.alone is None) == wrong_size for entry in entries)
    await together.receiver.receive(list(zip(uploads, entries, strict=True)))
    for upload, entry in zip(uploads, entries, strict=True):
        late: Decoded = entry._replace(alone=None)  # its checks all made at its admission, with the batch's norm
        await one_by_one.receiver.receive([(upload, late)])
    events = together.events()
    assert events == one_by_one.events()
    assert [event.task_id for event in events if isinstance(event, UpdateReceived | UpdateRejected)] == list(
        range(count)
    )
    assert together.policy.notes == one_by_one.policy.notes
    assert together.accounting.state_dict() == one_by_one.accounting.state_dict()
    assert together.intake.state_dict() == one_by_one.intake.state_dict()
    assert torch.equal(together.aggregator.buffer.weighted_sum, one_by_one.aggregator.buffer.weighted_sum)
    assert together.aggregator.count() == one_by_one.aggregator.count()


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
