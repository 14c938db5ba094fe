"""Secure aggregation with remote clients: the server's side of each group's four rounds over HTTP.

A remote client that finished training tells the server it holds its update (``POST /v1/tasks/{id}/held``) and
uploads nothing; its task stays in flight. When its group is complete (FedBuff: ``buffer_size`` clients hold
updates; FedAvg: every task of the round still in flight does) the server names the version the group steps from
and hands each member, at its next ``GET /v1/secagg``, the group's parameters and the weights it applies to its
own update before masking (staleness weight times example weight, and the example weight alone, in ``[0, 1]``).
Each round then goes the same way: every member still in the group posts its message (``POST
/v1/secagg/{group}/{round}``, the message's wire form), and once all have, or ``round_timeout_s`` has passed on
the run's clock (the silent ones have dropped out), the server's :class:`~flasync.secure.SecAggServer` computes
what each member gets next. After round 3 the server unmasks the sum and publishes a
:class:`~flasync.core.events.SecureGroupClosed` to the cloud, as simulated clients' groups do. The server only
ever holds public keys, ciphertexts it cannot open, masked ring vectors and, in round 3, shares of a survivor's
seed or of a dropped client's key.
"""

from __future__ import annotations

import asyncio
import base64
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flasync.core.bus import EventBus
from flasync.core.errors import BusClosed, BusFull
from flasync.core.events import CLOUD, SecureGroupClosed, TaskAssigned, Version
from flasync.secure import GroupParams, Phase, ProtocolAbort, SecAggServer, WeightedEncoding, neighbour_graph
from flasync.secure.messages import Advertise, MaskedInput, ShareBundle, UnmaskRequest, UnmaskResponse, decode_message
from flasync.server.registry import Timer

__all__ = ["RemoteGroups"]

_EXPECTED: dict[Phase, type] = {
    Phase.ADVERTISE: Advertise,
    Phase.SHARE: ShareBundle,
    Phase.MASK: MaskedInput,
    Phase.UNMASK: UnmaskResponse,
}
ROUNDS = {phase.name.lower(): phase for phase in Phase}
"""A round's name in the protocol's paths and instructions -> its phase."""


@dataclass(slots=True)
class _Group:
    """One group's state on the server, round by round."""

    group_id: int
    version: int
    members: dict[int, TaskAssigned]
    params: GroupParams
    server: SecAggServer
    started: float
    phase: Phase = Phase.ADVERTISE
    alive: set[int] = field(default_factory=set)
    received: dict[int, Any] = field(default_factory=dict)
    outgoing: dict[int, dict[str, Any]] = field(default_factory=dict)
    request: UnmaskRequest | None = None
    upload_bytes: dict[int, int] = field(default_factory=dict)
    download_bytes: dict[int, int] = field(default_factory=dict)
    phase_bytes: dict[str, int] = field(default_factory=dict)
    phase_s: dict[str, float] = field(default_factory=dict)
    phase_started: float = 0.0
    timer: asyncio.Task[None] | None = None


class RemoteGroups:
    """Form secure groups of remote clients holding their updates and run each group's rounds as they post.

    Args:
        bits: The ring's bit width.
        clip: Each weighted coordinate is clipped to ``[-clip, clip]`` (by the clients).
        group_size: The largest group.
        threshold: Shares that unmask a seed or a key.
        neighbours: Each member's neighbours (None: every other member).
        buffer_size: FedBuff's ``K`` (None: FedAvg, one group per round).
        weights: A member's two weights, ``(s(tau) e, e)``, from its staleness ``tau`` and its sample count.
        num_params: Length of the flat model.
        seed: Draws each group's neighbour graph.
        round_timeout_s: Seconds of ``clock`` a round waits for its members.
        bus: Where each group's end goes (to the cloud).
        in_flight: The tasks in flight (a FedAvg round is complete when each of them holds).
        spawn: Starts a background task of the run (the round timers).
        clock: The run's clock: it times each round (its timeout, its duration) and stamps each group's end.
        held: Told each task whose client holds its update (the registry's: its time limit stops).
        model_version: The model's version now (the server's). FedBuff's first group of this process steps from
            it (a server resumed from a checkpoint goes on from the checkpoint's version); the next ones count on.
    """

    def __init__(
        self,
        *,
        bits: int,
        clip: float,
        group_size: int,
        threshold: int,
        neighbours: int | None,
        buffer_size: int | None,
        weights: Callable[[int, int], tuple[float, float]],
        num_params: int,
        seed: int,
        round_timeout_s: float,
        bus: EventBus,
        in_flight: Callable[[], Iterable[TaskAssigned]],
        spawn: Callable[[Coroutine[Any, Any, None], str], asyncio.Task[None]],
        clock: Timer,
        held: Callable[[TaskAssigned], None] = lambda task: None,
        model_version: Callable[[], int] = lambda: 0,
    ) -> None:
        """Start with nobody holding an update."""
        self.encoding = WeightedEncoding.create(bits, clip, group_size)
        self.bits, self.clip, self.group_size = bits, clip, group_size
        self.threshold, self.neighbours, self.buffer_size = threshold, neighbours, buffer_size
        self.weights, self.num_params, self.seed = weights, num_params, seed
        self.round_timeout_s = round_timeout_s
        self.bus, self.in_flight, self.spawn, self.clock = bus, in_flight, spawn, clock
        self.held = held
        self.model_version = model_version
        self.waiting: list[tuple[TaskAssigned, int]] = []
        self.pending: deque[list[tuple[TaskAssigned, int]]] = deque()
        self.active: _Group | None = None
        self.version: int | None = None
        """The version FedBuff's next group steps from (None: read from ``model_version`` when the first starts)."""
        self.groups = 0
        self._of_client: dict[int, _Group] = {}
        self._changed = asyncio.Event()

    # ------------------------------------------------------------------------------------------ holding
    def holds(self, task: TaskAssigned) -> bool:
        """Tell whether ``task``'s client told the server it holds its update (its group has not ended)."""
        ids = {t.task_id for t, _ in self.waiting} | {t.task_id for g in self.pending for t, _ in g}
        if self.active is not None:
            ids |= {t.task_id for t in self.active.members.values()}
        return task.task_id in ids

    def hold(self, task: TaskAssigned, num_samples: int) -> None:
        """Learn that ``task``'s client finished training and holds its update of ``num_samples`` samples."""
        if not self.holds(task):
            self._forget(int(task.client_id))
            self.waiting.append((task, num_samples))
            self.held(task)
        self._close_groups()

    def _close_groups(self) -> None:
        k = self.buffer_size
        if k is not None:
            while len(self.waiting) >= k:
                self.pending.append(self.waiting[:k])
                self.waiting = self.waiting[k:]
        elif self.waiting:
            held = {t.task_id for t, _ in self.waiting}
            if all(task.task_id in held for task in self.in_flight()):
                self.pending.append(self.waiting)
                self.waiting = []
        if self.active is None and self.pending:
            self._start(self.pending.popleft())

    def _start(self, members: list[tuple[TaskAssigned, int]]) -> None:
        """Open a group: name its version and graph, tell each member its parameters and weights."""
        clients = sorted(int(task.client_id) for task, _ in members)
        order = list(np.random.default_rng((self.seed, self.groups, 0)).permutation(len(clients)))
        params = GroupParams(
            group_id=b"flasync-group-" + self.groups.to_bytes(8, "little"),
            bits=self.bits,
            length=self.encoding.length(self.num_params),
            threshold=self.threshold,
            neighbours=neighbour_graph(clients, self.neighbours, order),
        )
        if self.version is None:  # no group of this process has ended: none is on its way to the model
            self.version = self.model_version()
        version = self.version if self.buffer_size is not None else int(members[0][0].base_version)
        group = _Group(
            self.groups,
            version,
            {int(t.client_id): t for t, _ in members},
            params,
            SecAggServer(params),
            self.clock.now(),
            alive=set(clients),
            phase_started=self.clock.now(),
        )
        shared = {
            "group": group.group_id,
            "version": version,
            "group_id": params.group_id.hex(),
            "bits": self.bits,
            "clip": self.clip,
            "group_size": self.group_size,
            "threshold": self.threshold,
            "length": params.length,
            "neighbours": {str(c): sorted(v) for c, v in params.neighbours.items()},
        }
        for task, num_samples in members:
            weight, example = self.weights(version - int(task.base_version), num_samples)
            client = int(task.client_id)
            group.outgoing[client] = {**shared, "round": "advertise", "weight": weight, "example_weight": example}
            self._of_client[client] = group
        self.active = group
        self.groups += 1
        self._timer(group, Phase.ADVERTISE)
        self._notify()

    # -------------------------------------------------------------------------------------------- rounds
    def instruction(self, client_id: int) -> dict[str, Any] | None:
        """Return what ``client_id`` does next in its group (None: it is in none)."""
        self._close_groups()  # a FedAvg round whose last missing member failed is complete now
        group = self._of_client.get(client_id)
        if group is not None:
            return group.outgoing.get(client_id)
        waiting = {int(t.client_id) for t, _ in self.waiting} | {int(t.client_id) for g in self.pending for t, _ in g}
        # Holding nothing here (a server resumed from a checkpoint holds none of its clients' updates): stop waiting.
        return None if client_id in waiting else {"group": -1, "round": "done", "dropped": True}

    def _forget(self, client_id: int) -> None:
        """Forget the ended group a client was in: it holds a new update (for a group to come)."""
        group = self._of_client.get(client_id)
        if group is not None and group is not self.active:
            del self._of_client[client_id]

    async def next_instruction(self, client_id: int, after: str, wait_s: float) -> dict[str, Any] | None:
        """Wait up to ``wait_s`` for an instruction other than ``after`` (``"GROUP/ROUND"``; None: none came)."""
        try:
            async with asyncio.timeout(max(0.0, wait_s)):  # an HTTP request's wait: real time
                while True:
                    found = self.instruction(client_id)
                    if found is not None and f"{found['group']}/{found['round']}" != after:
                        return found
                    await self._changed.wait()
        except TimeoutError:
            return None

    def receive(self, client_id: int, group_id: int, round_name: str, body: bytes) -> str | None:
        """Take a member's message of a round (its wire form); return why it is refused (None: taken)."""
        group = self.active
        phase = ROUNDS.get(round_name)
        if group is None or group.group_id != group_id or phase is None or client_id not in group.members:
            return f"client {client_id} is not in group {group_id}'s protocol"
        if phase != group.phase or client_id not in group.alive or client_id in group.received:
            return f"group {group_id} does not wait for client {client_id}'s {round_name} message now"
        try:
            message = decode_message(body)
        except ValueError as exc:
            return f"a malformed {round_name} message: {exc}"
        if not isinstance(message, _EXPECTED[phase]):
            return f"a {round_name} message must be a {_EXPECTED[phase].__name__}"
        group.received[client_id] = message
        group.upload_bytes[client_id] = group.upload_bytes.get(client_id, 0) + len(body)
        group.phase_bytes[round_name] = group.phase_bytes.get(round_name, 0) + len(body)
        if group.alive <= group.received.keys():
            self._advance(group)
        return None

    def _timer(self, group: _Group, phase: Phase) -> None:
        deadline = self.clock.now() + self.round_timeout_s  # from the round's start, however late its task runs

        async def expire() -> None:
            await self.clock.sleep_until(deadline)
            if self.active is group and group.phase == phase:
                self._advance(group)  # the members that did not answer dropped out

        if group.timer is not None:
            group.timer.cancel()
        group.timer = self.spawn(expire(), f"flasync-secagg-{group.group_id}-{phase.name.lower()}")

    def _advance(self, group: _Group) -> None:
        """Close the group's round: compute what each member still in it gets next, or end the group."""
        name = group.phase.name.lower()
        group.phase_s[name] = self.clock.now() - group.phase_started
        received, group.received = group.received, {}
        if group.phase == Phase.UNMASK:
            self._unmask(group, received)
            return
        try:
            nxt = _next_messages(group, received)
        except ProtocolAbort as abort:
            self._end(group, None, str(abort))
            return
        phase = Phase(group.phase + 1)
        group.phase, group.alive, group.phase_started = phase, set(nxt), self.clock.now()
        round_name = phase.name.lower()
        for client, message in nxt.items():
            data = message.to_bytes()
            group.download_bytes[client] = group.download_bytes.get(client, 0) + len(data)
            group.phase_bytes[name] = group.phase_bytes.get(name, 0) + len(data)
            group.outgoing[client] = {
                "group": group.group_id,
                "round": round_name,
                "message": base64.b64encode(data).decode("ascii"),
            }
        for client in group.members.keys() - nxt.keys():
            group.outgoing[client] = {"group": group.group_id, "round": "done", "dropped": True}
        self._timer(group, phase)
        self._notify()

    def _unmask(self, group: _Group, responses: Mapping[int, UnmaskResponse]) -> None:
        """Unmask the group's sum from the round-3 answers and end it."""
        assert group.request is not None
        try:
            outcome = group.server.unmask(group.request, responses)
        except ProtocolAbort as abort:
            self._end(group, None, str(abort))
            return
        self._end(group, outcome, "")

    def _end(self, group: _Group, outcome: Any, reason: str) -> None:
        """Publish the group's end to the cloud, tell its members, start the next group."""
        if group.timer is not None and group.timer is not asyncio.current_task():
            group.timer.cancel()
        survivors: frozenset[int] = frozenset() if outcome is None else outcome.survivors
        weighted = b""
        total = 0.0
        if outcome is not None:
            summed, total = self.encoding.decode(outcome.total)
            weighted = summed.float().numpy().tobytes()
        figures: dict[str, float] = {}
        for phase in Phase:
            name = phase.name.lower()
            figures[f"secagg.{name}_bytes"] = float(group.phase_bytes.get(name, 0))
            figures[f"secagg.{name}_s"] = group.phase_s.get(name, 0.0)
        dropped = frozenset(group.members) - survivors
        recovered = 0 if outcome is None else len(outcome.recovered)
        figures.update(
            {
                "secagg.dropped": float(len(dropped)),
                "secagg.recovered": float(recovered),
                "secagg.abandoned": float(outcome is None),
                "secagg.protocol_s": self.clock.now() - group.started,
            }
        )
        plain = 4 * self.num_params * len(survivors)
        if plain:
            figures["secagg.bytes_ratio"] = sum(group.phase_bytes.values()) / plain
        message = SecureGroupClosed(
            to=CLOUD,
            group=group.group_id,
            version=Version(group.version),
            members=tuple(group.members[c] for c in sorted(group.members)),
            survivors=survivors,
            dropped=dropped,
            recovered=recovered,
            weighted_sum=weighted,
            example_weight=total,
            upload_bytes=dict(group.upload_bytes),
            download_bytes=dict(group.download_bytes),
            figures=figures,
            reason=reason,
            simulated_s=self.clock.now(),
        )
        if self.buffer_size is not None and outcome is not None:
            self.version = group.version + 1
        for client in group.members:
            group.outgoing[client] = {"group": group.group_id, "round": "done", "dropped": client not in survivors}
        self.active = None
        try:
            self.bus.publish_nowait(message)
        except (BusFull, BusClosed):
            self.spawn(self.bus.publish(message), "flasync-secagg-end")
        self._notify()
        self._close_groups()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


def _next_messages(group: _Group, received: dict[int, Any]) -> dict[int, Any]:
    """Return the messages each member still in ``group`` gets after its round 0, 1 or 2.

    Raises:
        ProtocolAbort: Too few members answered for the protocol to go on.
    """
    server = group.server
    if group.phase == Phase.ADVERTISE:
        return dict(server.broadcast_keys(received))
    if group.phase == Phase.SHARE:
        return dict(server.relay_shares(received))
    group.request = server.collect(received)
    return dict.fromkeys(sorted(group.request.survivors), group.request)
