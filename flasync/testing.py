"""Helpers for testing code that uses flasync: a small fast config, an in-memory tracker, an event recorder, and a
server harness (bus + virtual clock + scripted clients) that builds a :class:`~flasync.server.Server` without a
federation.

Example::

    from flasync.testing import EventRecorder, MemoryTracker, small_config

    async def test_my_service() -> None:
        tracker = MemoryTracker()
        federation = flasync.Federation(small_config(), tracker=tracker)
        events = EventRecorder(federation.bus)
        summary = await federation.run()
        assert events.count(flasync.core.events.ModelPublished) == summary.versions + 1
        assert tracker.status == "FINISHED"
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from flasync import codecs
from flasync.aggregation import (
    Aggregator,
    BufferedAggregator,
    ConstantStaleness,
    EqualExampleWeight,
    ServerOptimizer,
)
from flasync.clients.simulated.population import Population
from flasync.codecs.validation import UpdateValidator
from flasync.config import ConstantSpeed, RunConfig, apply_override, validate
from flasync.core.bus import EventBus, OverflowPolicy
from flasync.core.clock import VirtualClock
from flasync.core.errors import BusClosed
from flasync.core.events import BATCH_EVENTS, ClientFailed, TaskAssigned, UpdateUploaded
from flasync.core.snapshots import ModelSnapshot
from flasync.server import (
    Accounting,
    AsyncSlots,
    ClientSampler,
    Intake,
    Policy,
    Server,
    ServerStats,
    StopRules,
    TaskRegistry,
    one_each,
)
from flasync.tracking.metrics import MetricRow
from flasync.training.local import EvalResult
from flasync.training.plugins import ClientPlugin, Finished, ServerPlugin, TaskPart

__all__ = [
    "EventRecorder",
    "MeanOfDeltas",
    "MemoryTracker",
    "NullLog",
    "ScriptedClients",
    "ServerHarness",
    "TaskCounts",
    "UntrainableModel",
    "UpdateCounts",
    "small_config",
]

E = TypeVar("E")


class UntrainableModel(nn.Module):
    """A digits classifier (64 -> 10) that evaluates but raises in every training step: a broken model."""

    def __init__(self) -> None:
        """Build the one linear layer."""
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits when gradients are off; raise when training."""
        if torch.is_grad_enabled():
            raise RuntimeError("cannot train")
        out: torch.Tensor = self.linear(x)
        return out


_SMALL: dict[str, Any] = {
    "seed": 0,
    "data": {"kind": "digits"},
    "partition": {"kind": "iid"},
    "model": {"kind": "mlp", "hidden": [32]},
    "population": {"num_clients": 20, "speed": {"kind": "lognormal", "sigma": 0.5}},
    "client": {"epochs": 2, "batch_size": 16, "lr": 0.1},
    "server": {"kind": "fedbuff", "buffer_size": 4, "concurrency": 8},
    "eval": {"every_versions": 4},
    "stop": {"max_versions": 12},
    "tracking": {"enabled": False, "log_level": "warning", "log_model": False},
}


def small_config(*overrides: str, **sections: Any) -> RunConfig:
    """Return a config that runs in about a second: digits, 20 clients, FedBuff K=4 C=8, 12 versions, no MLflow.

    Args:
        *overrides: ``path.to.field=value`` strings, as for ``--set``.
        **sections: Whole sections to replace, e.g. ``server={"kind": "fedavg", "clients_per_round": 5}``.
    """
    data: dict[str, Any] = json.loads(json.dumps(_SMALL))
    data.update(sections)
    for override in overrides:
        apply_override(data, override)
    return validate(data)


class MemoryTracker:
    """A :class:`tracking.Tracker` that keeps everything in memory (for assertions in tests)."""

    def __init__(self) -> None:
        """Start empty."""
        self.run_id: str | None = None
        self.experiment: str | None = None
        self.run_name: str | None = None
        self.params: dict[str, Any] = {}
        self.tags: dict[str, str] = {}
        self.metrics: list[MetricRow] = []
        self.artifacts: dict[str, bytes] = {}
        self.datasets: list[dict[str, Any]] = []
        self.status: str | None = None
        self.flushes = 0
        self.prepared = False

    def prepare(self) -> None:
        """Record the call."""
        self.prepared = True

    def start(
        self,
        *,
        experiment: str,
        run_name: str | None = None,
        params: Mapping[str, Any] | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> str:
        """Record the run's params and tags; return a fixed run id."""
        self.run_id = "memory-run"
        self.experiment, self.run_name = experiment, run_name
        self.params.update(params or {})
        self.tags.update(tags or {})
        return self.run_id

    def resume(self, run_id: str) -> str:
        """Reopen the run ``run_id``: later metrics and artifacts add to what is kept."""
        self.run_id = run_id
        self.status = None
        return run_id

    def log_metrics(self, metrics: list[MetricRow]) -> None:
        """Keep the metrics."""
        self.metrics.extend(metrics)

    def log_dict(self, data: Mapping[str, Any], artifact_file: str) -> None:
        """Keep ``data`` as JSON bytes."""
        self.artifacts[artifact_file] = json.dumps(data, default=str).encode()

    def log_file(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Keep the file's bytes."""
        name = Path(path).name if artifact_path is None else f"{artifact_path}/{Path(path).name}"
        self.artifacts[name] = Path(path).read_bytes()

    def log_bytes(self, data: bytes, artifact_file: str) -> None:
        """Keep the bytes."""
        self.artifacts[artifact_file] = bytes(data)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Record tags."""
        self.tags.update(tags)

    def log_dataset(
        self, name: str, digest: str, source: str, profile: Mapping[str, Any], context: str = "training"
    ) -> None:
        """Record the dataset input."""
        self.datasets.append(
            {"name": name, "digest": digest, "source": source, "profile": dict(profile), "context": context}
        )

    def flush(self) -> bool:
        """Count the call; everything recorded is written, so True."""
        self.flushes += 1
        return True

    def finish(self, status: str) -> None:
        """Record the final status (of a started run: finishing a tracker that never started records nothing)."""
        if self.run_id is not None:
            self.status = status

    def ui_command(self) -> str | None:
        """Return None: there is no store to open."""
        return None

    def metric_keys(self) -> set[str]:
        """Return the distinct metric keys logged."""
        return {m.key for m in self.metrics}

    def history(self, key: str) -> list[tuple[int, float]]:
        """Return ``(step, value)`` pairs of one metric in logging order."""
        return [(m.step, m.value) for m in self.metrics if m.key == key]


class EventRecorder:
    """Record every event published on a bus, without a task: a large drop-oldest subscription read afterwards.

    Create it before the run starts; read it after (or during) the run. A batch event
    (:class:`~flasync.core.events.TasksAssigned`, :class:`~flasync.core.events.UpdatesUploaded`,
    :class:`~flasync.core.events.UpdatesReceived`) is recorded as the events it carries, in order, so the record reads
    the
    same whether they travelled together or apart.

    Args:
        bus: The bus to watch, e.g. ``Federation(...).bus``.
        capacity: Events kept; older ones are dropped (and counted in ``dropped``).
    """

    def __init__(self, bus: EventBus, *, capacity: int = 1_000_000) -> None:
        """Subscribe to every event."""
        self._subscription = bus.subscribe(capacity=capacity, policy=OverflowPolicy.DROP_OLDEST, name="recorder")
        self._events: list[Any] = []

    def _drain(self) -> None:
        sub = self._subscription
        while True:
            try:
                event = sub.receive_nowait()
            except (asyncio.QueueEmpty, BusClosed):
                return
            if isinstance(event, BATCH_EVENTS):
                self._events.extend(event.members)
            else:
                self._events.append(event)

    @property
    def events(self) -> list[Any]:
        """Return every event received so far, in publish order."""
        self._drain()
        return list(self._events)

    def of(self, kind: type[E]) -> list[E]:
        """Return the events of one type."""
        return [e for e in self.events if isinstance(e, kind)]

    def count(self, kind: type[Any]) -> int:
        """Count the events of one type."""
        return len(self.of(kind))

    @property
    def dropped(self) -> int:
        """Return events dropped because the recorder was full."""
        return self._subscription.statistics().dropped


class NullLog:
    """A logger that keeps the events it is given (``records``) and prints nothing."""

    def __init__(self) -> None:
        """Start with no records."""
        self.records: list[tuple[str, str, dict[str, Any]]] = []

    def _log(self, level: str, event: str, **fields: Any) -> None:
        self.records.append((level, event, fields))

    def debug(self, event: str, **fields: Any) -> None:
        """Keep a debug event."""
        self._log("debug", event, **fields)

    def info(self, event: str, **fields: Any) -> None:
        """Keep an info event."""
        self._log("info", event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        """Keep a warning."""
        self._log("warning", event, **fields)

    def events(self, name: str) -> list[dict[str, Any]]:
        """Return the fields of every kept event called ``name``."""
        return [fields for _, event, fields in self.records if event == name]


@dataclass
class ScriptedClients:
    """Clients whose answers a test decides: a task answers ``delay_s(task)`` virtual seconds after its dispatch.

    ``delta(task)`` is the flat delta uploaded (encoded with ``codec``); ``fail(task)`` returning a kind
    (``"error"``, ``"crash"``, ...) makes the task fail instead, and returning ``"hang"`` makes it never answer.
    Use an instance as a :data:`~flasync.server.registry.StartTask` (a registry's ``start=one_each(clients)``).
    """

    bus: EventBus
    clock: VirtualClock
    num_params: int
    codec: codecs.Pipeline = field(default_factory=codecs.Pipeline)
    delta: Callable[[TaskAssigned], torch.Tensor] | None = None
    delay_s: Callable[[TaskAssigned], float] = lambda task: 1.0 + 0.1 * (int(task.client_id) % 7)
    fail: Callable[[TaskAssigned], str | None] = lambda task: None
    num_samples: int = 10
    started: list[TaskAssigned] = field(default_factory=list)

    async def __call__(self, task: TaskAssigned, snapshot: ModelSnapshot) -> None:
        """Answer ``task`` as scripted."""
        self.started.append(task)
        await self.clock.sleep_until(task.simulated_s + self.delay_s(task))
        kind = self.fail(task)
        if kind == "hang":
            await asyncio.get_running_loop().create_future()
        if kind is not None:
            await self.bus.publish(
                ClientFailed(
                    to=task.reply_to,
                    task_id=task.task_id,
                    client_id=task.client_id,
                    base_version=task.base_version,
                    error=f"scripted {kind}",
                    simulated_s=self.clock.now(),
                    kind=kind,  # type: ignore[arg-type]
                )
            )
            return
        delta = self.delta(task) if self.delta is not None else torch.full((self.num_params,), 0.01)
        await self.bus.publish(
            UpdateUploaded(
                to=task.reply_to,
                task_id=task.task_id,
                client_id=task.client_id,
                base_version=task.base_version,
                num_samples=self.num_samples,
                payload=self.codec.encode(delta).payload,
                train_loss=0.0,
                simulated_s=self.clock.now(),
                sent_wall_s=0.0,
            )
        )


class ServerHarness:
    """A :class:`~flasync.server.Server` on a bus and a virtual clock with scripted clients: no data, no model.

    Args:
        num_params: Length of the flat model.
        num_clients: Size of the population.
        max_versions: Versions before the run stops.
        concurrency: Tasks in flight (the default policy is :class:`~flasync.server.AsyncSlots`).
        buffer_size: ``K`` of the default FedBuff aggregator (server SGD, lr 1, equal weights, no staleness weight).
        timeout_s: A task's time limit (None: none).
        max_update_norm: The intake's norm bound (None: none).
        failure_limit: Consecutive genuine errors that fail the run.
        policy: Builds another policy from the harness (called after the registry and sampler exist).
        aggregator: Builds another aggregator over the weights.
        clients: Builds the scripted clients from the bus and clock (default: :class:`ScriptedClients`).
        evaluate: Returns the accuracy of a model (default: none is evaluated).
    """

    def __init__(
        self,
        *,
        num_params: int = 4,
        num_clients: int = 10,
        max_versions: int = 3,
        concurrency: int = 2,
        buffer_size: int = 2,
        timeout_s: float | None = None,
        max_update_norm: float | None = None,
        failure_limit: int = 30,
        policy: Callable[[ServerHarness], Policy] | None = None,
        aggregator: Callable[[torch.Tensor], Aggregator] | None = None,
        clients: Callable[[EventBus, VirtualClock], ScriptedClients] | None = None,
        evaluate: Callable[[torch.Tensor], float] | None = None,
    ) -> None:
        """Build every component (nothing runs yet)."""
        self.clock = VirtualClock()
        self.bus = EventBus(on_activity=self.clock.poke)
        self.log = NullLog()
        self.weights = torch.zeros(num_params)
        self.clients = (clients or (lambda bus, clock: ScriptedClients(bus, clock, num_params)))(self.bus, self.clock)
        self.accounting = Accounting(failure_limit=failure_limit)
        self.registry = TaskRegistry(
            bus=self.bus,
            clock=self.clock,
            accounting=self.accounting,
            num_clients=num_clients,
            start=one_each(self.clients),
            timeout_s=timeout_s,
        )
        self.population = Population(np.full(num_clients, 10), ConstantSpeed(), seed=0)
        self.sampler = ClientSampler(self.population, "uniform", np.random.default_rng(0))
        self.intake = Intake(
            registry=self.registry,
            codec=self.clients.codec,
            num_params=num_params,
            device=self.weights.device,
            validator=UpdateValidator(num_params, max_norm=max_update_norm),
            max_staleness=None,
            clip_norm=None,
            wall=lambda: 0.0,
        )
        self.aggregator = aggregator(self.weights) if aggregator is not None else self._fedbuff(buffer_size)
        self.policy = policy(self) if policy is not None else self._async_slots(concurrency)
        self.server = self._server(max_versions, num_clients, evaluate)

    def _fedbuff(self, buffer_size: int) -> Aggregator:
        """Return the default aggregator: FedBuff with server SGD (lr 1), equal weights and no staleness weight."""
        return BufferedAggregator(
            self.weights,
            size=buffer_size,
            optimizer=ServerOptimizer.sgd(self.weights, lr=1.0),
            staleness=ConstantStaleness(),
            example_weight=EqualExampleWeight(),
        )

    def _async_slots(self, concurrency: int) -> Policy:
        """Return the default policy: ``concurrency`` tasks in flight, each slot refilled as it frees."""
        return AsyncSlots(
            concurrency=concurrency,
            registry=self.registry,
            sampler=self.sampler,
            clock=self.clock,
            ready=self.aggregator.ready,
            accounting=self.accounting,
        )

    def _server(self, max_versions: int, num_clients: int, evaluate: Callable[[torch.Tensor], float] | None) -> Server:
        """Return the server over the harness's components (``evaluate``: scores a model, None: none is scored)."""
        scorer = evaluate

        async def evaluate_weights(weights: torch.Tensor) -> EvalResult | None:
            if scorer is None:
                return None
            return EvalResult(accuracy=scorer(weights), loss=0.0, num_samples=1)

        return Server(
            self.weights,
            bus=self.bus,
            clock=self.clock,
            wall=lambda: 0.0,
            log=self.log,
            aggregator=self.aggregator,
            policy=self.policy,
            registry=self.registry,
            intake=self.intake,
            accounting=self.accounting,
            sampler=self.sampler,
            download_codec=codecs.Pipeline(),
            edge_codec=codecs.Pipeline(),
            evaluate=evaluate_weights,
            rules=StopRules(max_versions=max_versions),
            inbox_capacity=2 * num_clients + 8,
            components={"clock": self.clock},
        )

    async def run(self) -> ServerStats:
        """Drive the virtual clock and run the server to its stop condition; return its counters."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.clock.drive())
            try:
                return await self.server.run()
            finally:
                self.clock.stop()


class MeanOfDeltas:
    """A user aggregation rule (:class:`flasync.Aggregator`) for tests: the plain mean of ``size`` deltas, held until
    then, recording every call it gets (``adds``: staleness, samples and whether the shapes fit; ``steps``: updates
    folded into each step).

    Args:
        weights: The global weights, stepped in place.
        size: Updates per step (``ready`` once this many are in).
    """

    def __init__(self, weights: torch.Tensor, size: int) -> None:
        """Hold nothing yet."""
        self.weights = weights
        self.initial = weights.clone()
        self.size = size
        self.deltas: list[torch.Tensor] = []
        self.adds: list[tuple[int, int, bool]] = []  # staleness, samples, delta and base shaped like the weights
        self.base_is_current: list[bool] = []
        self.steps: list[int] = []  # updates folded into each step

    def add(self, delta: torch.Tensor, *, staleness: int, num_samples: int, base: torch.Tensor) -> float:
        """Keep the delta and record the call; the staleness weight is 1."""
        self.deltas.append(delta.clone())
        self.adds.append((staleness, num_samples, delta.shape == base.shape == self.weights.shape))
        self.base_is_current.append(torch.equal(base, self.weights))
        return 1.0

    def add_partial(self, weighted_sum: torch.Tensor, *, example_weight: float, staleness: int) -> float:
        """Refuse edge partials: this rule takes client updates only."""
        raise ValueError("client updates only")

    def ready(self) -> bool:
        """Tell whether ``size`` deltas are in."""
        return len(self.deltas) >= self.size

    def step(self) -> None:
        """Subtract the mean delta from the weights and start afresh."""
        self.weights.sub_(torch.stack(self.deltas).mean(dim=0))
        self.steps.append(len(self.deltas))
        self.deltas.clear()

    def count(self) -> int:
        """Count the deltas held."""
        return len(self.deltas)

    @property
    def nbytes(self) -> int:
        """Bytes of the deltas held."""
        return sum(d.numel() * 4 for d in self.deltas)

    def state_dict(self) -> dict[str, Any]:
        """Return the deltas held."""
        return {"deltas": [d.clone() for d in self.deltas]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.deltas = [d.clone() for d in state["deltas"]]


class UpdateCounts(ServerPlugin):
    """A server-side plug-in for tests and an example of one: each client's updates admitted, as a per-client table.

    It is written only against the algorithm-state seam (:mod:`flasync.training.plugins`) and is a checkpoint
    component under its name, so a resumed run goes on counting. Pass it as ``Federation(config,
    plugins=[UpdateCounts()])``.
    """

    name = "update_counts"

    def __init__(self) -> None:
        """Count nothing yet."""
        self.counts: Counter[int] = Counter()
        self.versions = 0

    def admitted(self, message: UpdateUploaded, version: int) -> None:
        """Count the upload's client."""
        self.counts[int(message.client_id)] += 1

    def version_made(self, version: int, log: Any) -> None:
        """Remember the newest version."""
        self.versions = version

    def table(self) -> list[tuple[int, int]]:
        """Return ``(client id, updates admitted)`` rows, by client id."""
        return sorted(self.counts.items())

    def state_dict(self) -> dict[str, Any]:
        """Return the table."""
        rows = self.table()
        return {"clients": [c for c, _ in rows], "counts": [n for _, n in rows], "versions": self.versions}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.counts = Counter(dict(zip(state["clients"], state["counts"], strict=True)))
        self.versions = int(state["versions"])


class TaskCounts(ClientPlugin):
    """A client-side plug-in for tests and an example of one: each client's trained tasks, kept when training ends.

    Written only against the algorithm-state seam (:mod:`flasync.training.plugins`): a task's part is made on the
    event loop when the task is placed, finishes in the worker thread, and is kept once the training ended in
    (virtual) time, so a task abandoned before then counts nothing.
    """

    name = "task_counts"

    def __init__(self) -> None:
        """Count nothing yet."""
        self.counts: Counter[int] = Counter()
        self.started = 0

    def task(self, task: TaskAssigned, model: ModelSnapshot) -> TaskPart:
        """Return the task's part."""
        self.started += 1
        return _CountedTask(self, int(task.client_id))

    def state_dict(self, in_flight: Iterable[TaskAssigned]) -> dict[str, Any]:
        """Return the table."""
        rows = sorted(self.counts.items())
        return {"clients": [c for c, _ in rows], "counts": [n for _, n in rows]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.counts = Counter(dict(zip(state["clients"], state["counts"], strict=True)))


class _CountedTask(TaskPart):
    """One task of :class:`TaskCounts`: its finish sends nothing; its keep counts the client."""

    def __init__(self, owner: TaskCounts, client_id: int) -> None:
        self.owner = owner
        self.client_id = client_id

    def finish(self, delta: torch.Tensor, result: Any, encoded: Any, codec: Any) -> Finished:
        """Report the delta's norm as a figure of the task's debug line."""
        return Finished(figures={"counted_norm": float(torch.linalg.vector_norm(delta))})

    def keep(self, finished: Finished) -> None:
        """Count the client's trained task."""
        self.owner.counts[self.client_id] += 1
