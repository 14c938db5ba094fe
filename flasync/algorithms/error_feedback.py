"""Error feedback: each client keeps what compression has not sent yet, and adds it to its next update.

Stich, Cordonnier and Jaggi 2018, "Sparsified SGD with memory"; Lin et al. 2018, "Deep Gradient Compression":
``e_{t+1} = x_t + e_t - C(x_t + e_t)``, one dense vector per client, bounded in memory and spilled to disk
(:class:`~flasync.training.residuals.ResidualStore`). The upload codec adds the residual and returns the new one.
"""

from __future__ import annotations

from typing import Any

import torch

from flasync.algorithms.per_client import PerClientPlugin, PerClientState
from flasync.codecs import Encoded, Pipeline
from flasync.core.events import ClientId, TaskAssigned
from flasync.core.snapshots import ModelSnapshot
from flasync.training.local import LocalResult
from flasync.training.plugins import Finished, TaskPart
from flasync.training.residuals import ResidualStore

__all__ = ["ErrorFeedback"]


class ErrorFeedback(PerClientPlugin):
    """The clients' error-feedback residuals (checkpoint component ``residuals``).

    Args:
        store: Where the residuals live.
    """

    name = "residuals"

    def __init__(self, store: ResidualStore) -> None:
        """Bind the residuals' store."""
        self.state = PerClientState(store)

    def task(self, task: TaskAssigned, model: ModelSnapshot) -> TaskPart:
        """Record the residual the task starts from; the worker reads the newest one when it encodes."""
        self.state.begin(task)
        return _ResidualPart(self.state, task.client_id)

    def close(self, log: Any) -> dict[str, int]:
        """Close the store (its spill folder goes); return its memory figures for the profile."""
        store = self.state.store
        memory = {"residual_memory_bytes": store.memory_bytes, "residual_disk_bytes": store.disk_bytes}
        store.close()
        log.debug(
            "codec.residuals",
            clients=len(store),
            memory_bytes=memory["residual_memory_bytes"],
            disk_bytes=memory["residual_disk_bytes"],
            spills=store.spills,
            loads=store.loads,
        )
        return memory


class _ResidualPart(TaskPart):
    """A task's residual: read when the delta is encoded, the new one kept when the training ends."""

    __slots__ = ("client_id", "state")

    def __init__(self, state: PerClientState, client_id: ClientId) -> None:
        self.state = state
        self.client_id = client_id

    def residual(self) -> torch.Tensor | None:
        """Return the client's newest residual."""
        return self.state.get(self.client_id)

    def finish(self, delta: torch.Tensor, result: LocalResult, encoded: Encoded, codec: Pipeline) -> Finished:
        """Keep the codec's new residual, and its norm as a figure."""
        if encoded.residual is None:
            return Finished()
        norm = float(torch.linalg.vector_norm(encoded.residual))
        return Finished(kept=encoded.residual, figures={"residual_norm": norm})

    def keep(self, finished: Finished) -> None:
        """Store the new residual."""
        if finished.kept is not None:
            self.state.put(self.client_id, finished.kept)
