"""Per-client vectors of the algorithm plug-ins (flasync.algorithms.per_client): what a checkpoint keeps."""

from __future__ import annotations

import torch

from flasync.algorithms.per_client import PerClientState
from flasync.core.events import ClientId, TaskAssigned, Version
from flasync.training.residuals import ResidualStore


def _task(task_id: int, client_id: int) -> TaskAssigned:
    return TaskAssigned(
        task_id=task_id, client_id=ClientId(client_id), participation=0, base_version=Version(0), simulated_s=0.0
    )


def test_a_checkpoint_keeps_what_a_task_in_flight_started_from() -> None:
    """A task that stored its new vector already is checkpointed with the one it started from; one never trained
    is left out, and a released task's record is forgotten."""
    state = PerClientState(ResidualStore(3))
    state.put(1, torch.ones(3))
    first, second = _task(10, 1), _task(11, 2)
    assert torch.equal(state.begin(first), torch.ones(3))  # type: ignore[arg-type]
    assert state.begin(second) is None
    state.put(1, torch.full((3,), 2.0))
    state.put(2, torch.full((3,), 5.0))
    saved = state.state_dict([first, second])
    assert saved["ids"] == [1] and torch.equal(saved["values"][0], torch.ones(3))
    state.released(first)
    state.released(second)
    saved = state.state_dict([first, second])
    assert saved["ids"] == [1, 2] and torch.equal(saved["values"][0], torch.full((3,), 2.0))
    restored = PerClientState(ResidualStore(3))
    restored.load_state_dict(saved)
    assert torch.equal(restored.get(2), torch.full((3,), 5.0))  # type: ignore[arg-type]
