"""The remote transport: tasks handed to devices over the network instead of to in-process coroutines.

The task registry hands every task to :meth:`RemoteTransport.start_task` at dispatch (its ``post`` seam, no
coroutine per task): the task is posted to its client's mailbox, where it waits until that client asks for it
(nothing runs for it meanwhile: a mailbox holding a task the registry no longer has in flight, timed out, say, is
found so and emptied when it is next looked at), and a client's upload goes onto the run's bus as the
same :class:`~flasync.core.events.UpdateUploaded` a simulated client publishes, so it meets the same intake (decoding,
shape, NaN and norm checks), aggregator, accounting, tracking and checkpoints. A task whose client never answers is
timed out by the registry like any other.

This module knows no HTTP: :mod:`flasync.runtime.serve` maps requests onto it. What it refuses before the intake (a
token
answering a task that is not its own, a replay, an oversized body, a malformed report) is a :class:`Refusal` with
an HTTP status, counted per reason and logged as a ``remote.refused`` metric.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from flasync.clients.remote.secure import RemoteGroups
from flasync.codecs import HEADER, Pipeline
from flasync.core.bus import EventBus
from flasync.core.errors import BusClosed, BusFull, ConfigError
from flasync.core.events import (
    ClientConnected,
    ClientEvaluated,
    ClientFailed,
    ClientId,
    TaskAssigned,
    UpdateUploaded,
    Version,
)
from flasync.core.instruments import debug_many, logs_debug
from flasync.core.snapshots import ModelSnapshot

if TYPE_CHECKING:
    from flasync.config import RemoteConfig, RunConfig
    from flasync.server.registry import TaskRegistry, Timer

__all__ = [
    "NEXT_TASK_TURNS",
    "EvaluationReport",
    "Incarnations",
    "ModelDownload",
    "Offer",
    "Refusal",
    "RemoteTransport",
    "Report",
    "Tokens",
    "load_tokens",
    "parse_tokens",
    "transport_for",
]

_MAX_TOKEN_CHARS = 512
_REMEMBERED_ANSWERS = 1 << 16
_RESUMABLE = "KILLED"  # a run ending with this tracking status may be resumed: its clients are told to retry
_MAX_POLLS_PER_CLIENT = 2


# --------------------------------------------------------------------------------------------------- tokens
class Tokens:
    """Bearer tokens bound to client ids, each request's token found with one dictionary lookup.

    Tokens are kept as SHA-256 digests and looked up by the digest of the token a request sends: the lookup's time
    depends on that digest (its hash and the bytes it shares with a stored one), never on a token's characters, and
    not on the number of tokens.

    Args:
        bindings: Token -> client id.
    """

    def __init__(self, bindings: Mapping[str, int]) -> None:
        """Hash and keep the bindings."""
        self._by_digest: dict[bytes, ClientId] = {}
        for token, client_id in bindings.items():
            self._by_digest[_digest(token)] = ClientId(int(client_id))

    def __len__(self) -> int:
        """Count the tokens."""
        return len(self._by_digest)

    def client_ids(self) -> list[ClientId]:
        """Return the bound client ids, sorted."""
        return sorted(self._by_digest.values())

    def client_of(self, token: str) -> ClientId | None:
        """Return the client ``token`` is bound to (None: no such token)."""
        if not token or len(token) > _MAX_TOKEN_CHARS:
            return None
        return self._by_digest.get(_digest(token))


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def parse_tokens(text: str, *, num_clients: int, where: str = "tokens file") -> Tokens:
    """Read lines ``CLIENT_ID TOKEN`` (blank lines and ``#`` comments skipped).

    Args:
        text: The file's text.
        num_clients: Client ids must be in ``0 .. num_clients - 1``.
        where: Names the source in error messages.

    Raises:
        ConfigError: A malformed line, a client id out of range, a token given twice or too short.
    """
    bindings: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[0].isdigit():
            raise ConfigError(f"{where}, line {number}: expected 'CLIENT_ID TOKEN'")
        client_id, token = int(parts[0]), parts[1]
        if client_id >= num_clients:
            raise ConfigError(
                f"{where}, line {number}: client id {client_id} is not below population.num_clients ({num_clients})"
            )
        if len(token) < 16 or len(token) > _MAX_TOKEN_CHARS:
            raise ConfigError(f"{where}, line {number}: a token needs 16 to {_MAX_TOKEN_CHARS} characters")
        if token in bindings:
            raise ConfigError(f"{where}, line {number}: this token is already bound to client {bindings[token]}")
        bindings[token] = client_id
    if not bindings:
        raise ConfigError(f"{where}: no 'CLIENT_ID TOKEN' line")
    return Tokens(bindings)


def load_tokens(path: str | Path, *, num_clients: int) -> Tokens:
    """Read a tokens file (see :func:`parse_tokens`).

    Raises:
        ConfigError: The file cannot be read or is malformed.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"remote.tokens_file: cannot read {path}: {type(exc).__name__}") from None
    return parse_tokens(text, num_clients=num_clients, where=f"remote.tokens_file {path}")


# ----------------------------------------------------------------------------------------------- messages
@dataclass(frozen=True, slots=True)
class Refusal:
    """A request the transport refuses: an HTTP ``status``, a short ``reason`` key and a one-line ``detail``."""

    status: int
    reason: str
    detail: str
    retry_after_s: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Offer:
    """A task given to a client: train from the model of ``base_version``, answer ``task_id``."""

    task_id: int
    base_version: int
    participation: int
    download_bytes: int
    incarnation: str = ""
    """The server process that dispatched the task (see :class:`Incarnations`); the client sends it back."""

    def to_json(self) -> dict[str, int | str]:
        """Return the offer as a JSON object."""
        return {
            "task_id": self.task_id,
            "base_version": self.base_version,
            "participation": self.participation,
            "download_bytes": self.download_bytes,
            "incarnation": self.incarnation,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelDownload:
    """The encoded model of one version as it is downloaded.

    Attributes:
        version: The model's version.
        payload: Its encoding (empty when the client holds it already: ``modified`` is False).
        etag: A strong HTTP entity tag of the encoding (quoted; the same for every request for that version).
        modified: False when the client named ``etag`` as one it holds (HTTP 304: nothing is sent).
    """

    version: int
    payload: bytes
    etag: str
    modified: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class EvaluationReport:
    """A client's evaluation of the model it downloaded, sent with its update (client-side evaluation).

    Attributes:
        num_samples: Held-out samples evaluated.
        accuracy: Share of them predicted right.
        loss: Mean cross-entropy over them.
        when: ``before`` or ``after`` local training.
        eval_s: Wall seconds of the evaluation.
        metrics: The figures of the run's added metrics (``eval.metrics``), by name.
    """

    num_samples: int
    accuracy: float
    loss: float
    when: Literal["before", "after"] = "before"
    eval_s: float = 0.0
    metrics: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: object, *, max_num_samples: int, metric_names: Sequence[str]) -> EvaluationReport:
        """Validate a decoded JSON object holding every metric of ``metric_names`` and no other.

        Raises:
            ValueError: A missing, mistyped or out-of-range field (one line).
        """
        if not isinstance(data, dict):
            raise ValueError("evaluation must be a JSON object")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown evaluation field {sorted(unknown)[0]!r}")
        samples = data.get("num_samples")
        if not isinstance(samples, int) or isinstance(samples, bool) or not 0 <= samples <= max_num_samples:
            raise ValueError(f"evaluation.num_samples must be an integer in 0 .. {max_num_samples}")
        when = data.get("when", "before")
        if when not in ("before", "after"):
            raise ValueError("evaluation.when must be 'before' or 'after'")
        metrics = data.get("metrics", {})
        if not isinstance(metrics, dict) or sorted(metrics) != sorted(metric_names):
            raise ValueError(f"evaluation.metrics must hold exactly this run's metrics: {sorted(metric_names)}")
        figures = {name: _finite(data.get(name), f"evaluation.{name}") for name in ("accuracy", "loss", "eval_s")}
        if not 0.0 <= figures["accuracy"] <= 1.0 or figures["loss"] < 0 or figures["eval_s"] < 0:
            raise ValueError("evaluation.accuracy must be in 0 .. 1, its loss and eval_s >= 0")
        values = {str(k): _finite(v, f"evaluation.metrics.{k}") for k, v in metrics.items()}
        return cls(num_samples=samples, when=when, metrics=values, **figures)

    def event(self, client_id: ClientId, task: TaskAssigned, simulated_s: float) -> ClientEvaluated:
        """Return the report as the bus carries it, counted towards the task's base version."""
        return ClientEvaluated(
            client_id=client_id,
            task_id=task.task_id,
            version=task.base_version,
            when=self.when,
            num_samples=self.num_samples,
            accuracy=self.accuracy,
            loss=self.loss,
            metrics=dict(self.metrics),
            simulated_s=simulated_s,
            eval_s=self.eval_s,
        )


def _names_etag(if_none_match: str, etag: str) -> bool:
    """Tell whether an ``If-None-Match`` header names ``etag`` (or is ``*``), weak tags compared weakly."""
    for tag in if_none_match.split(","):
        tag = tag.strip()
        if tag == "*" or tag.removeprefix("W/") == etag:
            return True
    return False


def _finite(value: object, name: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number")
    return float(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    """What a client says about its training (JSON beside the binary update; it weighs and describes the update).

    Attributes:
        num_samples: Samples trained on (weighs the update; bounded by ``remote.max_num_samples``).
        train_loss: Mean training loss.
        train_s: Wall seconds of local training.
        encode_s: Wall seconds of encoding.
        download_s: Wall seconds the model download took.
        peak_mem_bytes: Peak tensor memory of training.
        evaluation: The client's evaluation of the model it downloaded (None: it did not evaluate).
    """

    num_samples: int
    train_loss: float
    train_s: float = 0.0
    encode_s: float = 0.0
    download_s: float = 0.0
    peak_mem_bytes: int = 0
    evaluation: EvaluationReport | None = None

    @classmethod
    def from_json(cls, data: object, *, max_num_samples: int, metric_names: Sequence[str] = ()) -> Report:
        """Validate a decoded JSON object (``metric_names``: the metrics an evaluation holds besides accuracy and
        loss).

        Raises:
            ValueError: A missing, mistyped or out-of-range field (one line).
        """
        if not isinstance(data, dict):
            raise ValueError("the report must be a JSON object")
        unknown = data.keys() - _REPORT_FIELDS
        if unknown:
            raise ValueError(f"unknown report field {sorted(unknown)[0]!r}")
        samples = data.get("num_samples")
        if not isinstance(samples, int) or isinstance(samples, bool) or not 1 <= samples <= max_num_samples:
            raise ValueError(f"num_samples must be an integer in 1 .. {max_num_samples}")
        figures: dict[str, float] = {}
        for name in ("train_loss", "train_s", "encode_s", "download_s"):
            value = data.get(name, 0.0)
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number")
            figures[name] = float(value)
        for name in ("train_s", "encode_s", "download_s"):
            if figures[name] < 0:
                raise ValueError(f"{name} must be >= 0")
        memory = data.get("peak_mem_bytes", 0)
        if not isinstance(memory, int) or isinstance(memory, bool) or memory < 0:
            raise ValueError("peak_mem_bytes must be a non-negative integer")
        evaluation = data.get("evaluation")
        if evaluation is not None:
            evaluation = EvaluationReport.from_json(
                evaluation, max_num_samples=max_num_samples, metric_names=metric_names
            )
        return cls(num_samples=samples, peak_mem_bytes=memory, evaluation=evaluation, **figures)


_REPORT_FIELDS = frozenset(Report.__dataclass_fields__)


@dataclass(slots=True)
class _Posted:
    task: TaskAssigned
    download_bytes: int
    """The size of the task's model as the run counts its download."""
    session: str | None = None
    """The connection the task was handed to (None: not yet handed out)."""


# ------------------------------------------------------------------------------------------- incarnations
class Incarnations:
    """Which server process dispatched each task in flight, so that a resumed run refuses a dead process's tasks.

    Each server process of a run (the first, and each ``flasync serve --resume``) names itself with a random
    string, its incarnation, sent with every task it hands out and sent back with the task's answer. A resumed
    process goes on from a checkpoint: it takes over the tasks in flight there with the incarnations that dispatched
    them (this object is the checkpoint component ``remote``), and dispatches task ids the dead process may have
    dispatched too, after that checkpoint, for other models. An answer naming another incarnation than the one
    that dispatched the task is one to a task of the lost stretch of the run: refused (``stale_task``), counted,
    never aggregated.

    Args:
        in_flight: Returns the ids of the tasks in flight.
        name: This process's incarnation (default: 16 random hex digits, new in every process).
    """

    def __init__(self, in_flight: Callable[[], Iterable[int]], name: str | None = None) -> None:
        """Name this process; no task is taken over yet."""
        self._in_flight = in_flight
        self.name = name if name is not None else secrets.token_hex(8)
        self._taken_over: dict[int, str] = {}

    def of(self, task_id: int) -> str:
        """Return the incarnation that dispatched ``task_id``: its own for a task taken over, else this one."""
        return self._taken_over.get(task_id, self.name)

    def state_dict(self) -> dict[str, Any]:
        """Return each task in flight with the incarnation that dispatched it."""
        return {"tasks": [[task_id, self.of(task_id)] for task_id in self._in_flight()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take over the tasks of :meth:`state_dict` (a checkpoint without it: every answer must name this
        process, so the tasks it holds are trained again rather than answered by a client of the dead one)."""
        self._taken_over = {int(task_id): str(name) for task_id, name in state.get("tasks", [])}


# ------------------------------------------------------------------------------------------------ devices
class _DeviceRegistry:
    """Which remote devices are connected: each one's last request, the polls it has open and the task it took.

    Each figure is kept twice: by device (a dictionary, for one device's question) and as an array over the
    population (for :meth:`online_mask`, which the sampler asks at every dispatch: array operations over the
    population, never a pass over dictionaries).

    Args:
        wall: Monotonic real seconds.
    """

    def __init__(self, wall: Callable[[], float]) -> None:
        """Start with no device heard from."""
        self._wall = wall
        self.num_clients = 0
        self._bus: EventBus | None = None
        self.seen: dict[ClientId, float] = {}  # a device's last request (wall seconds)
        self.handed: dict[ClientId, int] = {}  # the task a device took and has not answered, since it last asked
        self.polls: Counter[ClientId] = Counter()
        self._seen_at = np.empty(0, dtype=np.float64)  # -inf: never heard from
        self._free = np.empty(0, dtype=bool)  # not holding a task it took
        self._polling = np.empty(0, dtype=bool)

    def attach(self, bus: EventBus, num_clients: int) -> None:
        """Tell the run's server (on ``bus``) of devices that come online, from a population of ``num_clients``."""
        self._bus, self.num_clients = bus, num_clients
        self._seen_at = np.full(num_clients, -np.inf)
        self._free = np.ones(num_clients, dtype=bool)
        self._polling = np.zeros(num_clients, dtype=bool)
        for client_id, at in self.seen.items():
            if client_id < num_clients:
                self._seen_at[client_id] = at
        for client_id, count in self.polls.items():
            if client_id < num_clients:
                self._polling[client_id] = count > 0
        for client_id in self.handed:
            if client_id < num_clients:
                self._free[client_id] = False

    def heard(self, client_id: ClientId, *, asking: bool = False) -> None:
        """Note that ``client_id`` made a request now; one asking for a task (``asking``) after a silence longer than
        :attr:`online_window_s` is published as :class:`ClientConnected`, so that the server may start its task now
        rather than once the next answer arrives."""
        now, last = self._wall(), self.seen.get(client_id)
        self.seen[client_id] = now
        if client_id < self.num_clients:
            self._seen_at[client_id] = now
        if asking and self._bus is not None and (last is None or now - last > self.online_window_s):
            with contextlib.suppress(BusFull, BusClosed):  # then the next answer fills the server's free slots
                self._bus.publish_nowait(ClientConnected(client_id=client_id))

    def hand(self, client_id: ClientId, task_id: int) -> None:
        """Note that ``client_id`` took ``task_id`` (it is not given another before it asks again)."""
        self.handed[client_id] = task_id
        if client_id < self.num_clients:
            self._free[client_id] = False

    def asks(self, client_id: ClientId) -> None:
        """Forget the task ``client_id`` took: it asks again (alive, and given its task again if one is in flight)."""
        if self.handed.pop(client_id, None) is not None and client_id < self.num_clients:
            self._free[client_id] = True

    def poll(self, client_id: ClientId, change: int) -> None:
        """Count a poll of ``client_id`` that opens (``change`` 1) or closes (-1)."""
        count = self.polls[client_id] = self.polls[client_id] + change
        if not count:
            del self.polls[client_id]
        if client_id < self.num_clients:
            self._polling[client_id] = count > 0

    def online(self, client_id: int, t: float) -> bool:
        """Tell whether device ``client_id`` is connected: asking for a task now, or heard from within
        :attr:`online_window_s` (``t`` is not needed)."""
        if client_id in self.polls:
            return True
        if client_id in self.handed:
            # It took a task and has not been heard from since: training it (not to be sampled anyway), or gone
            # (its task timed out): either way not given another one before it asks again.
            return False
        seen = self.seen.get(ClientId(client_id))
        return seen is not None and self._wall() - seen <= self.online_window_s

    def online_mask(self, t: float) -> np.ndarray:
        """Return a boolean array over the population: which devices are connected now (:meth:`online` of each:
        heard within the window and not holding a task, or polling)."""
        mask: np.ndarray = self._seen_at >= self._wall() - self.online_window_s
        mask &= self._free
        mask |= self._polling
        return mask

    @property
    def online_window_s(self) -> float:
        """How long after its last request a device not waiting for a task counts as connected (a connected idle
        device is always waiting: it asks again as soon as a poll ends or its upload is answered)."""
        return 3.0

    def forget_task(self, client_id: ClientId, task_id: int) -> None:
        """Forget that device ``client_id`` took ``task_id`` (it was answered)."""
        if self.handed.get(client_id) == task_id:
            self.asks(client_id)


# ----------------------------------------------------------------------------------------------- hand-out
NEXT_TASK_TURNS = 8
"""Turns of the event loop an upload's answer lets pass for the device's next task (``next=inline``): the intake
takes the update and the server posts the freed device's task within a few; each turn only runs what is ready."""


class _TaskHandout:
    """Each client's mailbox of one task, the polls waiting on it, and the connection a task is handed to.

    A task stays in its mailbox until it is answered or the registry releases it (a time limit): the registry's
    release is not told to the mailbox, which finds it out when the task is next looked for (``in_flight``), so a
    posted task costs no coroutine waiting for its release.

    Args:
        settings: The ``remote`` config section (poll and waiting limits, ``Retry-After``).
        devices: Where polls and handed tasks are noted.
        refuse: Counts and logs a refusal, and returns it.
        ended: Returns the refusal of a request after the run ended.
        incarnations: Names the process that dispatched each task.
    """

    def __init__(
        self,
        settings: RemoteConfig,
        devices: _DeviceRegistry,
        refuse: Callable[[ClientId | None, Refusal], Refusal],
        ended: Callable[[], Refusal],
        incarnations: Incarnations,
    ) -> None:
        """Start with empty mailboxes."""
        self.in_flight: Callable[[TaskAssigned], bool] = lambda task: False
        """Tells whether a task is still in flight (the run's registry's ``holds``, given when a run is attached)."""
        self.settings = settings
        self._devices = devices
        self._incarnations = incarnations
        self._refuse = refuse
        self._ended = ended
        self.closed = False
        self._posted: dict[ClientId, _Posted] = {}
        self._wakers: dict[ClientId, asyncio.Event] = {}
        self._ready_waiters: dict[ClientId, list[asyncio.Future[None]]] = {}  # answers waiting a few turns
        self.waiting = 0
        self.handed = 0  # tasks handed to a connection (a task asked for again is counted once)

    def post(self, task: TaskAssigned, snapshot: ModelSnapshot) -> None:
        """Post ``task`` (from ``snapshot``) to its client's mailbox and wake the client's poll, if one waits; the
        answer arrives over HTTP and is published by :meth:`RemoteTransport.upload`."""
        client_id = task.client_id
        self._posted[client_id] = _Posted(task, snapshot.download_bytes)
        waker = self._wakers.pop(client_id, None)
        if waker is not None:
            waker.set()
        for waiter in self._ready_waiters.get(client_id, ()):
            if not waiter.done():
                waiter.set_result(None)

    def get(self, client_id: ClientId) -> _Posted | None:
        """Return the task in ``client_id``'s mailbox (None: none, or one the registry no longer has in flight,
        which is taken out)."""
        posted = self._posted.get(client_id)
        if posted is not None and not self.in_flight(posted.task):
            del self._posted[client_id]
            return None
        return posted

    def __len__(self) -> int:
        """Count the tasks posted and still in flight."""
        return sum(1 for posted in self._posted.values() if self.in_flight(posted.task))

    def statistics(self) -> dict[str, int]:
        """Return the polls waiting, the tasks posted (and in flight) and those handed to a connection."""
        return {"waiting": self.waiting, "posted": len(self), "handed": self.handed}

    async def next_task(self, client_id: ClientId, wait_s: float, session: str) -> Offer | Refusal | None:
        """Return ``client_id``'s task, waiting up to ``wait_s`` for one (None: none came), as
        :meth:`RemoteTransport.next_task` describes."""
        posted = self.get(client_id)
        if posted is not None:
            return self._hand(client_id, posted, session)
        devices = self._devices
        if self.waiting >= self.settings.max_waiting or devices.polls[client_id] >= _MAX_POLLS_PER_CLIENT:
            return self._refuse(
                client_id,
                Refusal(429, "busy", "too many clients are waiting for tasks", self.settings.retry_after_s),
            )
        self.waiting += 1
        devices.poll(client_id, 1)
        try:
            async with asyncio.timeout(max(0.0, min(wait_s, self.settings.poll_s))):
                while not self.closed:
                    posted = self.get(client_id)
                    if posted is not None:
                        return self._hand(client_id, posted, session)
                    waker = self._wakers.setdefault(client_id, asyncio.Event())
                    await waker.wait()
        except TimeoutError:
            return None
        finally:
            self.waiting -= 1
            devices.poll(client_id, -1)
            devices.heard(client_id)
        return self._ended()

    def _hand(self, client_id: ClientId, posted: _Posted, session: str) -> Offer | Refusal:
        """Hand ``posted`` to ``session`` if it is not another connection's; else refuse (409)."""
        if posted.session is None:
            posted.session = session
            self.handed += 1
        elif posted.session != session:
            detail = (
                f"client {client_id}'s task {posted.task.task_id} is held by another connection with this token;"
                " retry once it is answered or timed out"
            )
            return self._refuse(client_id, Refusal(409, "token_in_use", detail, self.settings.retry_after_s))
        self._devices.hand(client_id, posted.task.task_id)
        return self._offer(posted)

    async def ready(self, client_id: ClientId, session: str) -> Offer | None:
        """Hand ``client_id``'s task to ``session`` if one is in its mailbox within :data:`NEXT_TASK_TURNS` turns of
        the event loop (its intake takes a few to take an answered update and post the device's next task); never
        waits on a clock nor for a task coming later (None: none came, the client long-polls :meth:`next_task`).

        Nothing runs for the request meanwhile: it waits on a future that :meth:`post` resolves, or a callback
        counting the loop's turns once they have passed."""
        if self.closed or self.get(client_id) is not None:
            return self._ready(client_id, session)
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._ready_waiters.setdefault(client_id, []).append(waiter)
        # Resolved in the turn before the last, so that this request looks again in the last.
        loop.call_soon(_count_turns, loop, waiter, NEXT_TASK_TURNS - 2)
        try:
            await waiter
        finally:
            waiters = self._ready_waiters.get(client_id)
            if waiters is not None:
                waiters.remove(waiter)
                if not waiters:
                    del self._ready_waiters[client_id]
        return self._ready(client_id, session)

    def _ready(self, client_id: ClientId, session: str) -> Offer | None:
        """Hand ``client_id``'s task to ``session`` if it is in the mailbox and not another connection's."""
        posted = self.get(client_id)
        if self.closed or posted is None or posted.session not in (None, session):
            return None
        offer = self._hand(client_id, posted, session)
        return offer if isinstance(offer, Offer) else None

    def _offer(self, posted: _Posted) -> Offer:
        task = posted.task
        return Offer(
            task_id=task.task_id,
            base_version=int(task.base_version),
            participation=task.participation,
            download_bytes=posted.download_bytes,
            incarnation=self._incarnations.of(task.task_id),
        )

    def forget_task(self, client_id: ClientId, task_id: int) -> None:
        """Take client ``client_id``'s answered task out of its mailbox: never offered again, even before the server
        releases it."""
        posted = self._posted.get(client_id)
        if posted is not None and posted.task.task_id == task_id:
            del self._posted[client_id]

    def close(self) -> None:
        """Wake every waiting poll (each learns the run ended) and empty the mailboxes."""
        self.closed = True
        for waker in self._wakers.values():
            waker.set()
        self._wakers.clear()
        for waiters in self._ready_waiters.values():
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
        self._posted.clear()


def _count_turns(loop: asyncio.AbstractEventLoop, waiter: asyncio.Future[None], left: int) -> None:
    """Resolve ``waiter`` once ``left`` more turns of ``loop`` have passed (unless something resolved it first)."""
    if waiter.done():
        return
    if left <= 0:
        waiter.set_result(None)
    else:
        loop.call_soon(_count_turns, loop, waiter, left - 1)


# ---------------------------------------------------------------------------------------------- downloads
class _ModelDownloads:
    """The encoded models clients download: each version encoded once, off the event loop, while a task uses it,
    with its entity tag (a digest of the encoding, computed with it).

    Args:
        codec: How models are encoded for download.
    """

    def __init__(self, codec: Pipeline) -> None:
        """Start with no model encoded."""
        self.codec = codec
        self._models: dict[int, asyncio.Future[ModelDownload]] = {}

    async def payload(
        self, registry: TaskRegistry, version: int, snapshot: ModelSnapshot, if_none_match: str | None = None
    ) -> ModelDownload:
        """Return ``snapshot`` (the model of ``version``) encoded (without its bytes when ``if_none_match`` names
        its entity tag), and forget the versions no task uses."""
        future = self._models.get(version)
        if future is None:
            for held in [v for v in self._models if registry.base(Version(v)) is None]:
                del self._models[held]  # no task uses that version any more
            future = asyncio.ensure_future(asyncio.to_thread(self._encode, snapshot))
            self._models[version] = future
        download = future.result() if future.done() else await asyncio.shield(future)
        if if_none_match is not None and _names_etag(if_none_match, download.etag):
            return ModelDownload(version=download.version, payload=b"", etag=download.etag, modified=False)
        return download

    def _encode(self, snapshot: ModelSnapshot) -> ModelDownload:
        weights = snapshot.weights.detach().to("cpu")
        generator = torch.Generator().manual_seed(int(snapshot.version))
        payload = self.codec.encode(weights, generator=generator).payload
        etag = f'"{hashlib.blake2b(payload, digest_size=16).hexdigest()}"'
        return ModelDownload(version=int(snapshot.version), payload=payload, etag=etag)

    def clear(self) -> None:
        """Forget every encoded model."""
        self._models.clear()


# ---------------------------------------------------------------------------------------------- transport
class RemoteTransport:
    """Hand a run's tasks to remote clients and put their answers on the run's bus.

    It answers the requests against the attached run, counts its refusals and is the intake of uploads; which
    devices are connected, the clients' mailboxes and the encoded models are the jobs of the objects it holds.

    Args:
        tokens: Bearer tokens bound to client ids.
        settings: The ``remote`` config section.
        upload_codec: How clients encode their updates (its stages are told to them).
        download_codec: How models are encoded for download (once per version).
        setup: The JSON object every client receives when it says hello (what it needs to train).
        wall: Monotonic real seconds.
        incarnation: This server process's name for its tasks (default: random; see :class:`Incarnations`).
        metric_names: The metrics a client's evaluation report holds besides accuracy and loss (``eval.metrics``).
    """

    def __init__(
        self,
        tokens: Tokens,
        settings: RemoteConfig,
        *,
        upload_codec: Pipeline,
        download_codec: Pipeline,
        setup: Mapping[str, Any],
        wall: Callable[[], float] = time.perf_counter,
        incarnation: str | None = None,
        metric_names: Sequence[str] = (),
    ) -> None:
        """Start with no run attached: requests are answered 503 until :meth:`attach`."""
        self.metric_names = tuple(metric_names)
        self.tokens = tokens
        self.settings = settings
        self.upload_codec = upload_codec
        self.download_codec = download_codec
        self._setup = dict(setup)
        self._setup_json: bytes | None = None  # the setup's members as JSON, encoded once a run is attached
        self._wall = wall
        self._bus: EventBus | None = None
        self._registry: TaskRegistry | None = None
        self._clock: Timer | None = None
        self._log: Any = None
        self._upload_log = _UploadLog(lambda: self._log, lambda: self.num_params)
        self._devices = _DeviceRegistry(wall)
        self.incarnations = Incarnations(lambda: [t.task_id for t in self._registry or ()], incarnation)
        """Which process dispatched each task in flight (a checkpoint component)."""
        self._handout = _TaskHandout(settings, self._devices, self._refuse, self._ended, self.incarnations)
        self._downloads = _ModelDownloads(download_codec)
        self.num_params = 0
        self.max_upload_bytes = 0
        """The largest update body accepted (a dense encoding of the model, or the codec's largest, plus slack)."""
        self.finished = ""
        self.finished_error = ""
        """Why the run ended (empty while it has not)."""
        self._answered: set[int] = set()
        self._answer_order: deque[int] = deque()
        self.refusals: Counter[str] = Counter()
        """Requests refused before the intake, by reason."""
        self.uploads = 0
        """Updates put on the bus."""
        self.wire_upload_bytes = 0
        """Update bodies received (bytes)."""
        self.wire_download_bytes = 0
        """Model bodies sent (bytes)."""
        self.secure: RemoteGroups | None = None
        """The server's side of secure aggregation's groups (None: off), given with :meth:`attach`."""

    # ------------------------------------------------------------------------------------------ lifetime
    @property
    def attached(self) -> bool:
        """Tell whether a run is attached (and not finished)."""
        return self._registry is not None and not self.finished

    def attach(
        self,
        *,
        bus: EventBus,
        registry: TaskRegistry,
        clock: Timer,
        log: Any,
        num_params: int,
        feature_shape: tuple[int, ...],
        num_classes: int,
        secure: RemoteGroups | None = None,
    ) -> None:
        """Serve the run whose bus and registry these are (called by the runtime when the run starts).

        Args:
            bus: Where answers go.
            registry: The tasks in flight (who may answer what) and their base models.
            clock: The run's clock (it stamps answers).
            log: The run's logger (refusals and clients' figures become metrics through it).
            num_params: Length of the flat model.
            feature_shape: Shape of one input sample (told to clients, which build the model from it).
            num_classes: Number of classes (likewise).
            secure: Secure aggregation's groups (None: clients upload their updates).
        """
        self._bus, self._registry, self._clock, self._log = bus, registry, clock, log
        self.secure = secure
        self._devices.attach(bus, registry.num_clients)
        self._handout.in_flight = registry.holds
        self.num_params = num_params
        self._setup.update(num_params=num_params, feature_shape=list(feature_shape), num_classes=num_classes)
        members = json.dumps(self._setup, ensure_ascii=False, allow_nan=False, separators=(",", ":"))[1:-1]
        self._setup_json = members.encode()
        dense = HEADER.size + 4 * num_params
        probe = torch.randn(num_params, generator=torch.Generator().manual_seed(0))
        largest = len(self.upload_codec.encode(probe, generator=torch.Generator().manual_seed(0)).payload)
        self.max_upload_bytes = max(dense, largest) + 64

    def _ended(self) -> Refusal:
        """Refuse a request after the run ended: 410, or 503 with ``Retry-After`` when it stopped to be resumed.

        A run ending ``KILLED`` (a signal, ``request_stop``, a cancellation) can be resumed from its checkpoint
        (``flasync serve --resume``), and a run whose bus closed is still ending: clients are told to retry, so
        they reconnect to the resumed server. Any other end (``FINISHED``, ``FAILED``) is final.
        """
        if self.finished in ("", _RESUMABLE):
            retry = self.settings.retry_after_s
            return Refusal(503, "stopping", "the run has stopped or is stopping; retry (it may be resumed)", retry)
        error = f": {self.finished_error}" if self.finished_error else ""
        return Refusal(410, "finished", f"the run has ended ({self.finished}{error})")

    def finish(self, reason: str, error: str = "") -> None:
        """End the run for every client: waiting requests return, later ones learn the run is over.

        Args:
            reason: The tracking status the run ends with; after ``KILLED`` clients are told to retry (503).
            error: Why a ``FAILED`` run failed (one line), told to the clients with its end.
        """
        self._upload_log.flush()
        self.finished = reason or "finished"
        self.finished_error = " ".join(error.split())[:300]
        self._handout.close()
        self._downloads.clear()
        counts = self.refusals
        if self._log is not None and any(count & (count - 1) for count in counts.values()):
            total = sum(counts.values())  # the counts not logged at their last value: the whole of each, once
            self._log.debug("remote.refused", step=total, total=total, **counts)

    # --------------------------------------------------------------------------------------- registry seam
    def start_task(self, task: TaskAssigned, snapshot: ModelSnapshot) -> None:
        """Post ``task`` to its client's mailbox (it waits there for the client, see :class:`_TaskHandout`)."""
        self._handout.post(task, snapshot)

    # ------------------------------------------------------------------------------------------ availability
    def online(self, client_id: int, t: float) -> bool:
        """Tell whether device ``client_id`` is connected: asking for a task now, or heard from within
        :meth:`online_window_s` (the sampler gives tasks to connected devices only; ``t`` is not needed)."""
        return self._devices.online(client_id, t)

    def online_mask(self, t: float) -> np.ndarray:
        """Return a boolean array over the population: which devices are connected now."""
        return self._devices.online_mask(t)

    def next_online(self, t: float) -> float:
        """Return ``t`` if a device is connected, else when to look again (a quarter of a second later)."""
        return t if self.online_mask(t).any() else t + 0.25

    @property
    def online_window_s(self) -> float:
        """How long after its last request a device not waiting for a task counts as connected (a connected idle
        device is always waiting: it asks again as soon as a poll ends or its upload is answered)."""
        return self._devices.online_window_s

    # -------------------------------------------------------------------------------------------- requests
    def hello(self, client_id: ClientId) -> bytes | Refusal:
        """Return what ``client_id`` needs to train (its id, the model's size and shape, local settings) as a JSON
        object (the run's setup is encoded once, not for each device that says hello)."""
        self._devices.heard(client_id, asking=True)
        self._devices.asks(client_id)
        if self.finished:
            return self._ended()
        if self._registry is None or self._setup_json is None:
            return self._not_started()
        head = f'{{"client_id":{int(client_id)},"max_upload_bytes":{int(self.max_upload_bytes)}'
        return b"".join((head.encode(), b"," if self._setup_json else b"", self._setup_json, b"}"))

    async def next_task(self, client_id: ClientId, wait_s: float, session: str = "") -> Offer | Refusal | None:
        """Return ``client_id``'s task, waiting up to ``wait_s`` for one (None: none came; ask again).

        A task is handed to one connection: the ``session`` (a random string a client process picks for its
        lifetime) that first asks for it. That session asking again while the task is in flight gets it again (an
        answer lost on the way); another one with the same token gets 409 ``token_in_use`` with ``Retry-After``
        until the task is answered or timed out, so two devices sharing a token never train the same task (and a
        restarted device waits for its old task's timeout).
        """
        self._devices.heard(client_id, asking=True)
        # It asks again: alive, and (again) given its task if one is in flight.
        self._devices.asks(client_id)
        if self.finished:
            return self._ended()
        return await self._handout.next_task(client_id, wait_s, session)

    async def ready_task(self, client_id: ClientId, session: str = "") -> Offer | None:
        """Return ``client_id``'s next task if it is posted within a few turns of the event loop (the device just
        answered its last), handed to ``session`` as :meth:`next_task` hands it; None: it is not, ask
        :meth:`next_task` (nothing is waited for on a clock)."""
        return None if self.finished else await self._handout.ready(client_id, session)

    async def model(
        self, client_id: ClientId, version: int, if_none_match: str | None = None
    ) -> ModelDownload | Refusal:
        """Return the encoded model of ``version`` (encoded once per version, off the event loop); none of its bytes
        when ``if_none_match`` (a request's ``If-None-Match``) names its entity tag (``modified`` False: HTTP 304)."""
        if self.finished:
            return self._ended()
        registry = self._registry
        if registry is None:
            return self._not_started()
        snapshot = registry.base(Version(version))
        if snapshot is None:
            return self._refuse(client_id, Refusal(404, "no_model", f"version {version} is not served"))
        download = await self._downloads.payload(registry, version, snapshot, if_none_match)
        self.wire_download_bytes += len(download.payload)
        return download

    def check_upload(
        self,
        client_id: ClientId,
        task_id: int,
        content_length: int | None,
        session: str = "",
        incarnation: str | None = None,
    ) -> Refusal | None:
        """Refuse an answer before its body is read: a run not attached, a task of a server process that has died
        since (``incarnation``, the one its offer named; None: not checked), a replay, a task not the client's own
        or handed to another connection (``session``, see :meth:`next_task`), a declared body over
        :attr:`max_upload_bytes` (None: go on)."""
        if self.finished:
            return self._ended()
        registry = self._registry
        if registry is None:
            return self._not_started()
        if incarnation is not None and incarnation != self.incarnations.of(task_id):
            detail = f"task {task_id} is one of a server process that stopped: the run went on from a checkpoint"
            return self._refuse(client_id, Refusal(409, "stale_task", detail))
        if task_id in self._answered:
            return self._refuse(client_id, Refusal(409, "replay", f"task {task_id} was answered already"))
        task = registry.busy.get(client_id)
        if task is None or task.task_id != task_id:
            return self._refuse(client_id, Refusal(403, "not_your_task", f"client {client_id} has no task {task_id}"))
        posted = self._handout.get(client_id)
        if posted is not None and posted.task.task_id == task_id and posted.session not in (None, session):
            detail = f"task {task_id} was handed to another connection with this token"
            return self._refuse(client_id, Refusal(403, "other_connection", detail))
        if content_length is not None and content_length > self.max_upload_bytes:
            return self.oversize(client_id, content_length)
        return None

    def held(self, client_id: ClientId, task_id: int) -> TaskAssigned:
        """Take a checked answer that is an update held for secure aggregation; return its task (still in flight)."""
        assert self._registry is not None
        self._remember(client_id, task_id)
        return self._registry.busy[client_id]

    def oversize(self, client_id: ClientId, size: int) -> Refusal:
        """Refuse (and count) a body found larger than :attr:`max_upload_bytes` (``size``: bytes seen so far)."""
        detail = f"the update has more than {self.max_upload_bytes} bytes (got {size})"
        return self._refuse(client_id, Refusal(413, "too_large", detail))

    def slow_body(self, client_id: ClientId) -> Refusal:
        """Refuse (and count) a request whose body paused longer than the server waits for a chunk."""
        return self._refuse(client_id, Refusal(408, "slow_body", "the request's body stopped coming"))

    def rate_limited(self, retry_after_s: int) -> Refusal:
        """Refuse (and count) a request from an address that spent its budget of refused requests."""
        detail = "too many refused requests from this address"
        return self._refuse(None, Refusal(429, "rate_limited", detail, retry_after_s))

    def bad_request(self, client_id: ClientId, detail: str) -> Refusal:
        """Refuse (and count) a request with a malformed id, header or query parameter (``detail``: which)."""
        return self._refuse(client_id, Refusal(400, "bad_request", detail))

    def bad_report(self, client_id: ClientId, detail: str) -> Refusal:
        """Refuse (and count) an upload whose report is malformed."""
        return self._refuse(client_id, Refusal(400, "bad_report", detail))

    def upload(
        self,
        client_id: ClientId,
        task_id: int,
        payload: bytes,
        report: Report,
        session: str = "",
        incarnation: str | None = None,
    ) -> Refusal | None:
        """Put the update for ``task_id`` on the bus (the intake decides whether it is aggregated).

        Returns:
            None once the update is on its way to the intake, else why it was refused.
        """
        self._devices.heard(client_id)
        refusal = self.check_upload(client_id, task_id, len(payload), session, incarnation)
        if refusal is not None:
            return refusal
        assert self._registry is not None and self._bus is not None
        task = self._registry.busy[client_id]
        posted = self._handout.get(client_id)
        download_bytes = posted.download_bytes if posted is not None else 0
        message = UpdateUploaded(
            to=task.reply_to,
            task_id=task.task_id,
            client_id=client_id,
            base_version=task.base_version,
            num_samples=report.num_samples,
            payload=payload,
            train_loss=report.train_loss,
            simulated_s=self._registry_now(),
            sent_wall_s=self._wall(),
            compute_s=report.train_s,
            encode_s=report.encode_s,
            sim_download_s=report.download_s,
            sim_train_s=report.train_s,
            download_bytes=download_bytes,
            peak_mem_bytes=report.peak_mem_bytes,
        )
        refusal = self._publish(client_id, message)
        if refusal is not None:
            return refusal
        self._remember(client_id, task_id)
        self.uploads += 1
        self.wire_upload_bytes += len(payload)
        if report.evaluation is not None:
            with contextlib.suppress(BusFull, BusClosed):  # the update went through; its report is a figure
                self._bus.publish_nowait(report.evaluation.event(client_id, task, self._registry_now()))
        self._upload_log.add(client_id, task_id, report, download_bytes, len(payload))
        return None

    def failed(
        self, client_id: ClientId, task_id: int, error: str, session: str = "", incarnation: str | None = None
    ) -> Refusal | None:
        """Publish that the client's training failed (the task is released and counted as a failure)."""
        refusal = self.check_upload(client_id, task_id, None, session, incarnation)
        if refusal is not None:
            return refusal
        assert self._registry is not None and self._bus is not None
        task = self._registry.busy[client_id]
        failed = ClientFailed(
            to=task.reply_to,
            task_id=task_id,
            client_id=client_id,
            base_version=task.base_version,
            error=error[:200],
            simulated_s=self._registry_now(),
            kind="error",
        )
        refusal = self._publish(client_id, failed)
        if refusal is not None:
            return refusal
        self._remember(client_id, task_id)
        return None

    def _publish(self, client_id: ClientId, message: UpdateUploaded | ClientFailed) -> Refusal | None:
        """Put a client's answer on the run's bus; a full inbox is 503 (retry later), a finished run its end."""
        assert self._bus is not None
        try:
            self._bus.publish_nowait(message)
        except BusFull:
            retry = self.settings.retry_after_s
            return self._refuse(client_id, Refusal(503, "server_busy", "the server's inbox is full", retry))
        except BusClosed:
            return self._ended()
        return None

    def unauthorized(self) -> Refusal:
        """Refuse (and count) a request without a valid bearer token."""
        return self._refuse(None, Refusal(401, "unauthorized", "missing or unknown bearer token"))

    def statistics(self) -> dict[str, Any]:
        """Return the transport's counters (a JSON object)."""
        return {
            "finished": self.finished,
            **self._handout.statistics(),
            "uploads": self.uploads,
            "wire_upload_bytes": self.wire_upload_bytes,
            "wire_download_bytes": self.wire_download_bytes,
            "refused": dict(self.refusals),
        }

    # ------------------------------------------------------------------------------------------- helpers
    def _registry_now(self) -> float:
        clock = self._clock
        assert clock is not None
        return clock.now()

    def _remember(self, client_id: ClientId, task_id: int) -> None:
        self._handout.forget_task(client_id, task_id)
        self._devices.forget_task(client_id, task_id)
        self._answered.add(task_id)
        self._answer_order.append(task_id)
        if len(self._answer_order) > _REMEMBERED_ANSWERS:
            self._answered.discard(self._answer_order.popleft())

    def _not_started(self) -> Refusal:
        return Refusal(503, "not_started", "the run has not started yet", self.settings.retry_after_s)

    def _refuse(self, client_id: ClientId | None, refusal: Refusal) -> Refusal:
        """Count a refusal and log it (:func:`_count_refusal`); return it."""
        return _count_refusal(self.refusals, self._log, client_id, refusal)


def _count_refusal(refusals: Counter[str], log: Any, client_id: ClientId | None, refusal: Refusal) -> Refusal:
    """Count a refusal; log its line (and metrics) at the 1st, 2nd, 4th, 8th, ... of its reason, so that a flood of
    refused requests adds a few rows to the run's store, not rows per request (``statistics()`` holds every count)."""
    count = refusals[refusal.reason] = refusals[refusal.reason] + 1
    if log is not None and count & (count - 1) == 0:
        total = sum(refusals.values())
        log.debug(
            "remote.refused",
            step=total,
            total=total,
            **{refusal.reason: refusals[refusal.reason]},
            status=str(refusal.status),
            reason=refusal.reason,
            detail=refusal.detail,
            client_id=-1 if client_id is None else int(client_id),
        )
    return refusal


class _UploadLog:
    """The figures of each accepted upload, logged as a simulated client logs them (the same metric keys, through
    the same batch path of :func:`~flasync.core.instruments.debug_many`), measured on the device: the uploads
    accepted in one turn of the event loop are logged together at its end, one batch rather than one call each.

    Args:
        log: Returns the run's logger (None: no run attached, nothing is logged).
        num_params: Returns the length of the flat model (the dense size an upload's compression is against).
    """

    def __init__(self, log: Callable[[], Any], num_params: Callable[[], int]) -> None:
        """Start with nothing to log."""
        self._log = log
        self._num_params = num_params
        self._rows: list[dict[str, Any]] = []

    def add(self, client_id: ClientId, task_id: int, report: Report, download_bytes: int, upload_bytes: int) -> None:
        """Log an accepted upload's figures at the end of this turn of the event loop."""
        log = self._log()
        if log is None or not logs_debug(log):
            return
        if not self._rows:
            asyncio.get_running_loop().call_soon(self.flush)
        self._rows.append(
            {
                "step": task_id,
                "client_id": int(client_id),
                "train_s": report.train_s,
                "samples": report.num_samples,
                "loss": report.train_loss,
                "peak_mem_bytes": report.peak_mem_bytes,
                "encode_s": report.encode_s,
                "download_bytes": download_bytes,
                "upload_bytes": upload_bytes,
                "compression": (HEADER.size + 4 * self._num_params()) / max(upload_bytes, 1),
            }
        )

    def flush(self) -> None:
        """Log the figures not logged yet."""
        rows, self._rows = self._rows, []
        log = self._log()
        if rows and log is not None:
            debug_many(log, "client", rows)


def transport_for(config: RunConfig) -> RemoteTransport:
    """Build the transport ``config.remote`` describes (reads its tokens file).

    Raises:
        ConfigError: The tokens file is missing or malformed.
    """
    from flasync.codecs.build import pipeline

    remote = config.remote
    if remote.tokens_file is None:
        raise ConfigError("remote.tokens_file: must name the tokens file when remote.enabled = true")
    tokens = load_tokens(remote.tokens_file, num_clients=config.population.num_clients)
    # What a client needs to build the model and train like a simulated client: not where the server tracks,
    # checkpoints or trains, nor its tokens file.
    setup = config.model_dump(
        mode="json", exclude={"tracking", "remote", "checkpoint", "diagnostics", "executor", "clock"}
    )
    return RemoteTransport(
        tokens,
        remote,
        upload_codec=pipeline(config.codec.upload),
        download_codec=pipeline(config.codec.download),
        setup={"config": setup},
        metric_names=config.eval.metric_names[2:],  # after accuracy and loss
    )
