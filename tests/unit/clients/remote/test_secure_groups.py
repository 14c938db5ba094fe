"""The server's side of secure aggregation with remote clients: groups formed from held updates, rounds closed when
every member posted, messages out of turn refused, the unmasked sum published to the cloud."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest
import torch

from flasync.clients.remote.secure import RemoteGroups
from flasync.core.bus import EventBus
from flasync.core.events import CLOUD, ClientId, SecureGroupClosed, TaskAssigned, Version
from flasync.secure import GroupParams, SecAggClient, SeededRandom, WeightedEncoding
from flasync.secure.messages import decode_message

pytestmark = pytest.mark.timeout(30)

_PARAMS = 40


def _task(client: int, base: int = 0) -> TaskAssigned:
    return TaskAssigned(
        task_id=10 + client, client_id=ClientId(client), participation=0, base_version=Version(base), simulated_s=0.0
    )


class _ManualClock:
    """A clock that moves only when the test says so: ``sleep`` waits for :meth:`advance` past its deadline."""

    def __init__(self) -> None:
        self.t = 0.0
        self.sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        await self.sleep_until(self.t + seconds)

    async def sleep_until(self, when: float) -> None:
        if when <= self.t:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.sleepers.append((when, waiter))
        await waiter

    async def advance(self, seconds: float) -> None:
        """Move time on by ``seconds``, wake the sleepers whose time has come and let them run."""
        self.t += seconds
        for when, waiter in self.sleepers:
            if when <= self.t and not waiter.done():
                waiter.set_result(None)
        self.sleepers = [(w, f) for w, f in self.sleepers if not f.done()]
        for _ in range(5):
            await asyncio.sleep(0)


def _groups(
    bus: EventBus,
    timers: list[asyncio.Task[None]],
    held: list[int],
    clock: _ManualClock | None = None,
    size: int = 3,
    model_version: int = 0,
) -> RemoteGroups:
    return RemoteGroups(
        bits=32,
        clip=1.0,
        group_size=size,
        threshold=2,
        neighbours=None,
        buffer_size=size,
        weights=lambda tau, n: (0.5**tau * n / 100, n / 100),
        num_params=_PARAMS,
        seed=0,
        round_timeout_s=30.0,
        bus=bus,
        in_flight=list,
        spawn=lambda coro, name: _spawn(timers, coro, name),
        clock=clock or _ManualClock(),
        held=lambda task: held.append(task.task_id),
        model_version=lambda: model_version,
    )


def _spawn(timers: list[asyncio.Task[None]], coro: Any, name: str) -> asyncio.Task[None]:
    timers.append(asyncio.get_running_loop().create_task(coro, name=name))
    return timers[-1]


def _respond(client: int, step: dict[str, Any], state: dict[str, Any], delta: torch.Tensor) -> bytes:
    """Return what client ``client`` posts for ``step`` (its state across rounds in ``state``)."""
    if step["round"] == "advertise":
        params = GroupParams(
            bytes.fromhex(step["group_id"]),
            step["bits"],
            step["length"],
            step["threshold"],
            {int(c): frozenset(v) for c, v in step["neighbours"].items()},
        )
        state["member"] = SecAggClient(client, params, SeededRandom((0, client)))
        encoding = WeightedEncoding.create(step["bits"], step["clip"], step["group_size"])
        state["encoded"] = encoding.encode(delta, step["weight"], step["example_weight"])
        return bytes(state["member"].advertise().to_bytes())
    member, incoming = state["member"], decode_message(base64.b64decode(step["message"]))
    if step["round"] == "share":
        return bytes(member.share(incoming).to_bytes())
    if step["round"] == "mask":
        member.receive_shares(incoming)
        return bytes(member.mask(state["encoded"]).to_bytes())
    return bytes(member.unmask(incoming).to_bytes())


async def test_a_full_buffer_runs_its_rounds_as_members_post_and_reveals_the_weighted_sum() -> None:
    """Three holds open a group (their time limits stop); each round closes on its last message; a message out of
    turn is refused; the cloud gets the sum of the members' self-weighted updates and each member learns done."""
    bus = EventBus()
    inbox = bus.subscribe(SecureGroupClosed, address=CLOUD)
    held: list[int] = []
    deltas = {c: torch.linspace(-0.02, 0.02, _PARAMS) * (c + 1) for c in range(3)}
    timers: list[asyncio.Task[None]] = []
    groups = _groups(bus, timers, held)
    assert groups.instruction(0) == {"group": -1, "round": "done", "dropped": True}  # holds nothing here
    for client in range(3):
        groups.hold(_task(client), 50)
    assert held == [10, 11, 12] and groups.active is not None
    groups.hold(_task(0), 50)  # a repeated hold changes nothing
    states: dict[int, dict[str, Any]] = {c: {} for c in range(3)}
    for round_name in ("advertise", "share", "mask", "unmask"):
        steps = {c: groups.instruction(c) for c in range(3)}
        assert all(step is not None and step["round"] == round_name for step in steps.values())
        for client, step in steps.items():
            assert step is not None
            body = _respond(client, step, states[client], deltas[client])
            assert groups.receive(client, 0, round_name, body) is None
            if client == 0 and round_name != "unmask":
                assert groups.receive(0, 0, round_name, body) is not None  # once a round
    closed = await inbox.receive()
    await asyncio.sleep(0)
    assert groups.active is None and all(timer.done() for timer in timers)  # every round's timer stopped
    assert closed.survivors == frozenset(range(3)) and not closed.abandoned and groups.version == 1
    got = torch.frombuffer(bytearray(closed.weighted_sum), dtype=torch.float32)
    want = torch.stack([0.5 * deltas[c] for c in range(3)]).sum(0)
    assert torch.allclose(got, want, atol=3 * 0.5 / ((2**31 - 1) // 3) + 1e-7)
    assert closed.example_weight == pytest.approx(1.5)
    assert {c: groups.instruction(c) for c in range(3)} == {
        c: {"group": 0, "round": "done", "dropped": False} for c in range(3)
    }
    assert sum(closed.upload_bytes.values()) > 3 * 4 * _PARAMS and closed.figures["secagg.abandoned"] == 0.0


async def test_a_malformed_or_foreign_message_is_refused() -> None:
    """A message of the wrong type for its round, or from a client outside the group, is refused with a reason."""
    bus = EventBus()
    timers: list[asyncio.Task[None]] = []
    groups = _groups(bus, timers, [])
    for client in range(3):
        groups.hold(_task(client), 50)
    assert "not in group" in (groups.receive(7, 0, "advertise", b"\x01") or "")
    assert groups.receive(0, 0, "advertise", b"\xff\x00") is not None
    assert "not wait" in (groups.receive(0, 0, "mask", b"\x01") or "")
    for timer in timers:
        timer.cancel()


async def test_a_round_times_out_on_the_runs_clock_and_the_silent_member_is_recovered() -> None:
    """Round timeouts follow the injected clock, not the wall: a round with a silent member stays open until the
    clock reaches ``round_timeout_s``, then closes without it; the others' key is recovered from their shares
    (threshold 2 of 4) when it drops out after sharing, and the round durations are the clock's."""
    clock = _ManualClock()
    bus = EventBus()
    inbox = bus.subscribe(SecureGroupClosed, address=CLOUD)
    deltas = {c: torch.linspace(-0.02, 0.02, _PARAMS) * (c + 1) for c in range(4)}
    timers: list[asyncio.Task[None]] = []
    groups = _groups(bus, timers, [], clock, size=4)
    for client in range(4):
        groups.hold(_task(client), 50)
    states: dict[int, dict[str, Any]] = {c: {} for c in range(4)}
    for round_name in ("advertise", "share", "mask", "unmask"):
        silent = {3} if round_name in ("mask", "unmask") else set()
        talking = [c for c in range(4) if c not in silent]
        for client in talking:
            step = groups.instruction(client)
            assert step is not None and step["round"] == round_name
            body = _respond(client, step, states[client], deltas[client])
            assert groups.receive(client, 0, round_name, body) is None
        await clock.advance(1.0)
        if round_name == "mask":
            assert groups.active is not None and groups.active.phase.name == "MASK"  # client 3 is awaited
            await clock.advance(27.0)
            assert groups.active.phase.name == "MASK"  # 29 s of the clock since the round opened: still open
            await clock.advance(1.0)  # 30 s: the round closes without client 3
            assert groups.active.phase.name == "UNMASK"
            assert groups.instruction(3) == {"group": 0, "round": "done", "dropped": True}
    closed = await inbox.receive()
    assert closed.reason == "", closed.reason
    assert closed.survivors == frozenset({0, 1, 2}) and closed.dropped == frozenset({3}) and closed.recovered == 1
    got = torch.frombuffer(bytearray(closed.weighted_sum), dtype=torch.float32)
    want = 0.5 * (deltas[0] + deltas[1] + deltas[2])
    assert torch.allclose(got, want, atol=3 * 0.5 / ((2**31 - 1) // 4) + 1e-7)
    figures = closed.figures  # each round's duration on the clock: 0 s, 1 s (one step of the test), 30 s, 0 s
    assert [figures[f"secagg.{name}_s"] for name in ("advertise", "share", "mask", "unmask")] == [0.0, 1.0, 30.0, 0.0]
    assert figures["secagg.protocol_s"] == 31.0 and closed.simulated_s == 31.0
    await asyncio.sleep(0)
    assert all(timer.done() for timer in timers)


async def test_a_resumed_servers_first_buffer_steps_from_the_models_version() -> None:
    """A server resumed at version 5 holds none of the old groups: its first buffer steps from version 5 (the
    model's), each member's staleness weight counted against it, never a negative staleness."""
    timers: list[asyncio.Task[None]] = []
    groups = _groups(EventBus(), timers, [], model_version=5)
    for client, base in ((0, 5), (1, 4), (2, 3)):
        groups.hold(_task(client, base), 50)
    steps = [groups.instruction(c) for c in range(3)]
    assert all(step is not None and step["version"] == 5 for step in steps)
    assert [step["weight"] for step in steps if step is not None] == [0.5, 0.25, 0.125]
    for timer in timers:
        timer.cancel()
