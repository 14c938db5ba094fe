"""Helpers for testing code that uses flasync: a small fast config, an in-memory tracker, an event recorder.

Example::

    from flasync.testing import EventRecorder, MemoryTracker, small_config

    async def test_my_service() -> None:
        tracker = MemoryTracker()
        federation = flasync.Federation(small_config(), tracker=tracker)
        events = EventRecorder(federation.bus)
        summary = await federation.run()
        assert events.count(flasync.events.ModelPublished) == summary.versions + 1
        assert tracker.status == "FINISHED"
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from flasync.bus import EventBus, OverflowPolicy
from flasync.config import RunConfig, apply_override, validate
from flasync.errors import BusClosed
from tracking.metrics import MetricRow

__all__ = ["EventRecorder", "MemoryTracker", "UntrainableModel", "small_config"]

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

    def flush(self) -> None:
        """Count the call."""
        self.flushes += 1

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

    Create it before the run starts; read it after (or during) the run.

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
                self._events.append(sub.receive_nowait())
            except (asyncio.QueueEmpty, BusClosed):
                return

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
