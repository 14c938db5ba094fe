"""Simulated clients holding their updates for secure aggregation: groups formed at arrival, weighted by the members,
run through the protocol in virtual time, checkpointed while they fill."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from flasync.aggregation import EqualExampleWeight, PolynomialStaleness
from flasync.clients.simulated.population import Network
from flasync.clients.simulated.secure import SecureRoom
from flasync.config.population import NetworkConfig
from flasync.core.bus import EventBus
from flasync.core.clock import VirtualClock
from flasync.core.events import CLOUD, ClientId, SecureGroupClosed, TaskAssigned, Version
from flasync.secure import Link, SecureAggregator

pytestmark = pytest.mark.timeout(30)

_PARAMS = 50


def _task(client: int, base: int = 0) -> TaskAssigned:
    return TaskAssigned(
        task_id=100 + client,
        client_id=ClientId(client),
        participation=0,
        base_version=Version(base),
        simulated_s=0.0,
    )


def _delta(client: int) -> torch.Tensor:
    return torch.linspace(-0.01, 0.01, _PARAMS) * (client + 1)


async def _with_room(
    body: Callable[[SecureRoom, VirtualClock, Any, list[TaskAssigned]], Awaitable[None]],
    *,
    buffer_size: int | None,
    group_size: int = 4,
    dropout: float = 0.0,
    online: Callable[[int, float], bool] | None = None,
    offline_at: Callable[[int, float], float] | None = None,
) -> None:
    """Run ``body(room, clock, inbox, in_flight)`` with a room on a driven virtual clock."""
    clock = VirtualClock()
    bus = EventBus(on_activity=clock.poke)
    inbox = bus.subscribe(SecureGroupClosed, address=CLOUD)
    in_flight: list[TaskAssigned] = []
    aggregator = SecureAggregator(
        bits=32,
        clip=1.0,
        group_size=group_size,
        threshold=2,
        neighbours=None,
        seed=0,
        link=Link(),
        dropout_rate=dropout,
    )
    with ThreadPoolExecutor(1) as pool:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(clock.drive())
            room = SecureRoom(
                aggregator=aggregator,
                buffer_size=buffer_size,
                staleness=PolynomialStaleness(a=0.5),
                example_weight=EqualExampleWeight(),
                example_scale=1.0,
                network=Network(NetworkConfig(), 10, 0),
                clock=clock,
                bus=bus,
                pool=pool,
                in_flight=lambda: iter(in_flight),
                spawn=lambda coro, name: tg.create_task(coro, name=name),
                online=online,
                offline_at=offline_at,
            )
            try:
                await body(room, clock, inbox, in_flight)
            finally:
                clock.stop()


async def test_a_full_buffer_runs_the_protocol_and_reveals_its_weighted_sum_only() -> None:
    """K holds form one group at the K-th's time; its end comes after the four rounds with the staleness-weighted
    sum (each member weighted itself against the version the buffer steps from) and nothing of one member."""

    async def body(room: SecureRoom, clock: VirtualClock, inbox: Any, in_flight: list[TaskAssigned]) -> None:
        room.version = 2
        for client in range(3):
            room.hold(_task(client, base=client), _delta(client), 10, at=0.0)
        assert not room.pending and [h.task.client_id for h in room.waiting] == [0, 1, 2]
        await clock.sleep(1.0)
        room.hold(_task(3, base=2), _delta(3), 10, at=clock.now())
        closed = await inbox.receive()
        assert closed.version == 2 and closed.survivors == frozenset(range(4)) and not closed.abandoned
        phases = sum(v for k, v in closed.figures.items() if k.endswith("_s") and k[7:-2] in _PHASES)
        assert closed.simulated_s == pytest.approx(1.0 + phases) and phases > 0
        got = torch.frombuffer(bytearray(closed.weighted_sum), dtype=torch.float32)
        staleness = PolynomialStaleness(a=0.5)
        want = torch.stack([staleness(2 - min(c, 2)) * _delta(c) for c in range(4)]).sum(0)
        assert torch.allclose(got, want, atol=4 * 0.5 / ((2**31 - 1) // 4)), (got - want).abs().max()
        assert closed.example_weight == pytest.approx(4.0)
        assert room.version == 3 and room.groups == 1 and not room.waiting and not room.pending
        assert sum(closed.upload_bytes.values()) > 4 * 4 * _PARAMS  # every masked coordinate and the keys

    await _with_room(body, buffer_size=4)


_PHASES = ("advertise", "share", "mask", "unmask")


async def test_a_round_is_complete_once_every_task_in_flight_holds_or_was_released() -> None:
    """FedAvg: the group waits for every member still in flight; a failed member's release completes it."""

    async def body(room: SecureRoom, clock: VirtualClock, inbox: Any, in_flight: list[TaskAssigned]) -> None:
        tasks = [_task(c) for c in range(4)]
        in_flight.extend(tasks)
        for task in tasks[:3]:
            room.hold(task, _delta(task.client_id), 10, at=0.0)
        assert not room.pending and len(room.waiting) == 3
        in_flight.remove(tasks[3])  # it failed: the registry released it
        room.released(tasks[3])
        closed = await inbox.receive()
        assert closed.survivors == frozenset(range(3)) and [t.task_id for t in closed.members] == [100, 101, 102]
        assert closed.version == 0 and closed.example_weight == pytest.approx(3.0)

    await _with_room(body, buffer_size=None)


async def test_dropouts_beyond_the_threshold_abandon_the_group_and_keep_the_version() -> None:
    """Every member dropping: the group ends without a sum, counted as abandoned; the buffer's version stays."""

    async def body(room: SecureRoom, clock: VirtualClock, inbox: Any, in_flight: list[TaskAssigned]) -> None:
        for client in range(3):
            room.hold(_task(client), _delta(client), 10, at=0.0)
        closed = await inbox.receive()
        assert closed.abandoned and closed.reason and closed.figures["secagg.abandoned"] == 1.0
        assert closed.dropped == frozenset(range(3)) and room.version == 0 and room.groups == 1

    await _with_room(body, buffer_size=3, group_size=3, dropout=1.0)


async def test_a_member_offline_when_its_group_starts_drops_out() -> None:
    """A client whose availability window closed while it held its update does not take part: the others' sum."""

    async def body(room: SecureRoom, clock: VirtualClock, inbox: Any, in_flight: list[TaskAssigned]) -> None:
        for client in range(4):
            room.hold(_task(client), _delta(client), 10, at=0.0)
        closed = await inbox.receive()
        assert closed.dropped == frozenset({2}) and closed.survivors == frozenset({0, 1, 3})
        assert closed.recovered == 0 and not closed.abandoned

    await _with_room(body, buffer_size=4, online=lambda client, t: client != 2)


async def _window_run(closing: dict[int, float]) -> SecureGroupClosed:
    """Return the end of one group of four whose members' availability windows close at ``closing`` (else never)."""
    ends: list[SecureGroupClosed] = []

    async def body(room: SecureRoom, clock: VirtualClock, inbox: Any, in_flight: list[TaskAssigned]) -> None:
        for client in range(4):
            room.hold(_task(client), _delta(client), 10, at=0.0)
        ends.append(await inbox.receive())

    await _with_room(
        body,
        buffer_size=4,
        online=lambda client, t: t < closing.get(client, float("inf")),
        offline_at=lambda client, t: closing.get(client, float("inf")),
    )
    return ends[0]


def _round_ends(closed: SecureGroupClosed) -> list[float]:
    """Return when each protocol round of a group that started at 0 ended."""
    ends, t = [], 0.0
    for phase in _PHASES:
        t += closed.figures[f"secagg.{phase}_s"]
        ends.append(t)
    return ends


async def test_a_member_whose_window_closes_during_a_round_drops_out_at_that_round() -> None:
    """A window closing mid-protocol drops the member at the round during which it closes (its pairwise masks
    recovered from the others' shares); a window closing after the protocol changes nothing; the same windows give
    the same outcome."""
    plain = await _window_run({})
    ends = _round_ends(plain)
    assert plain.dropped == frozenset() and all(b > a for a, b in zip([0.0, *ends], ends, strict=False))
    mid_mask = (ends[1] + ends[2]) / 2  # client 2 goes offline while it sends its masked input
    windows = {2: mid_mask, 3: ends[3] + 1.0}
    closed = await _window_run(windows)
    assert closed.dropped == frozenset({2}) and closed.survivors == frozenset({0, 1, 3}) and not closed.abandoned
    assert closed.recovered == 1  # it shared, so its key is rebuilt to cancel its masks
    got = torch.frombuffer(bytearray(closed.weighted_sum), dtype=torch.float32)
    staleness = PolynomialStaleness(a=0.5)
    want = staleness(0) * (_delta(0) + _delta(1) + _delta(3))
    assert torch.allclose(got, want, atol=4 * 0.5 / ((2**31 - 1) // 4))
    assert _round_ends(closed)[:2] == ends[:2]  # it took part in rounds 0 and 1, and sent nothing from round 2 on
    assert closed.figures["secagg.mask_bytes"] < plain.figures["secagg.mask_bytes"]
    again = await _window_run(windows)
    simulated = {k: v for k, v in closed.figures.items() if k != "secagg.cpu_s"}  # all but the machine's CPU time
    assert (again.weighted_sum, again.simulated_s, again.dropped) == (closed.weighted_sum, closed.simulated_s, {2})
    assert {k: v for k, v in again.figures.items() if k != "secagg.cpu_s"} == simulated
    early = await _window_run({1: ends[0] / 2})  # offline during round 0: nothing of it to recover
    assert early.dropped == frozenset({1}) and early.recovered == 0 and not early.abandoned


async def test_windows_closing_beyond_the_threshold_abandon_the_group() -> None:
    """Three of four members going offline while they share leave fewer than the threshold: the group is abandoned
    and counted, and its buffer's version does not step."""
    plain = await _window_run({})
    mid_share = (_round_ends(plain)[0] + _round_ends(plain)[1]) / 2
    closed = await _window_run(dict.fromkeys((0, 1, 2), mid_share))
    assert closed.abandoned and closed.dropped == frozenset({0, 1, 2}) and closed.figures["secagg.abandoned"] == 1.0


async def test_a_half_full_buffer_survives_a_checkpoint() -> None:
    """The waiting clients' updates and the room's counters come back from state_dict, copied, against the tasks."""

    async def body(room: SecureRoom, clock: VirtualClock, inbox: Any, in_flight: list[TaskAssigned]) -> None:
        tasks = [_task(c) for c in range(2)]
        for task in tasks:
            room.hold(task, _delta(task.client_id), 10 + task.client_id, at=0.5)
        room.version, room.groups = 7, 3
        state = room.state_dict()
        state["waiting"][0]["delta"].zero_()  # a copy: the room's own is untouched
        assert room.waiting[0].delta.abs().sum() > 0
        other = SecureRoom(**{name: getattr(room, name) for name in _ARGS})
        other.load_state_dict(room.state_dict(), {t.task_id: t for t in tasks})
        assert other.version == 7 and other.groups == 3 and other.holds(tasks[1]) and not other.holds(_task(5))
        assert [(h.task, h.num_samples, h.held_s) for h in other.waiting] == [(tasks[0], 10, 0.5), (tasks[1], 11, 0.5)]
        assert torch.equal(other.waiting[1].delta, _delta(1))

    await _with_room(body, buffer_size=4)


_ARGS = (
    "aggregator",
    "buffer_size",
    "staleness",
    "example_weight",
    "example_scale",
    "network",
    "clock",
    "bus",
    "pool",
    "in_flight",
    "spawn",
)
