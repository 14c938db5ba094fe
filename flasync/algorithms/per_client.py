"""One dense vector per client, bounded in memory, with what each task in flight started from (for checkpoints)."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from flasync.core.events import TaskAssigned
from flasync.training.plugins import ClientPlugin
from flasync.training.residuals import ResidualStore

__all__ = ["PerClientPlugin", "PerClientState"]


class PerClientState:
    """Per-client vectors in a :class:`~flasync.training.residuals.ResidualStore`, safe across worker threads.

    A task in flight may have stored its new vector already when a checkpoint is taken; the state keeps the vector
    the task started from, so a resumed run trains it again from there.

    Args:
        store: Where the vectors live (in memory up to its bound, then spilled to disk).
    """

    def __init__(self, store: ResidualStore) -> None:
        """Bind the store."""
        self.store = store
        self.lock = threading.Lock()  # guards the store across worker threads and the event loop
        self._pre_task: dict[int, torch.Tensor | None] = {}

    def begin(self, task: TaskAssigned) -> torch.Tensor | None:
        """Return the task's client's vector (None: it has none yet), recorded as it was for checkpoints."""
        with self.lock:
            own = self.store.get(task.client_id)
            self._pre_task[task.task_id] = own
        return own

    def get(self, client_id: int) -> torch.Tensor | None:
        """Return ``client_id``'s vector (None: none yet)."""
        with self.lock:
            return self.store.get(client_id)

    def put(self, client_id: int, value: torch.Tensor) -> None:
        """Store ``client_id``'s new vector."""
        with self.lock:
            self.store.put(client_id, value)

    def released(self, task: TaskAssigned) -> None:
        """Forget what was recorded for a task that ended."""
        self._pre_task.pop(task.task_id, None)

    def state_dict(self, in_flight: Iterable[TaskAssigned]) -> dict[str, Any]:
        """Return ``{"ids": [...], "values": Tensor(len(ids), num_params)}``, tasks in flight as they started."""
        values: dict[int, torch.Tensor] = {}
        with self.lock:
            for client_id in self.store.client_ids():
                held = self.store.get(client_id)
                if held is not None:
                    values[client_id] = held
            for task in in_flight:
                if task.task_id in self._pre_task:
                    before = self._pre_task[task.task_id]
                    if before is None:
                        values.pop(int(task.client_id), None)
                    else:
                        values[int(task.client_id)] = before.clone()
        ids = sorted(values)
        stacked = torch.stack([values[i] for i in ids]) if ids else torch.zeros(0)
        return {"ids": ids, "values": stacked}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put the checkpoint's vectors back into the store."""
        for i, client_id in enumerate(state["ids"]):
            self.store.put(int(client_id), state["values"][i])


class PerClientPlugin(ClientPlugin):
    """A client plug-in whose state is one vector per client (:attr:`state`): checkpointed and released with it."""

    state: PerClientState

    def released(self, task: TaskAssigned) -> None:
        """Forget the task's record."""
        self.state.released(task)

    def state_dict(self, in_flight: Iterable[TaskAssigned]) -> dict[str, Any]:
        """Return the clients' vectors, tasks in flight as they started."""
        return self.state.state_dict(in_flight)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the clients' vectors."""
        self.state.load_state_dict(state)
