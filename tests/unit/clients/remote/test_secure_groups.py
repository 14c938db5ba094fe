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


def _groups(bus: EventBus, timers: list[asyncio.Task[None]], held: list[int]) -> RemoteGroups:
    return RemoteGroups(
        bits=32,
        clip=1.0,
        group_size=3,
        threshold=2,
        neighbours=None,
        buffer_size=3,
        weights=lambda tau, n: (0.5**tau * n / 100, n / 100),
        num_params=_PARAMS,
        seed=0,
        round_timeout_s=30.0,
        bus=bus,
        in_flight=list,
        spawn=lambda coro, name: _spawn(timers, coro, name),
        held=lambda task: held.append(task.task_id),
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
