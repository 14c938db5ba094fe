"""Which server process dispatched each task: a resumed process takes over its checkpoint's tasks, no others."""

from __future__ import annotations

import io

import torch

from flasync.clients.remote.transport import Incarnations


def test_a_task_is_of_this_process_unless_taken_over_from_a_checkpoint() -> None:
    """A resumed process names the dead one for the tasks its checkpoint held, and itself for every other id."""
    dead = Incarnations(lambda: [3, 5], name="dead")
    state = dead.state_dict()
    assert state == {"tasks": [[3, "dead"], [5, "dead"]]}
    resumed = Incarnations(lambda: [5, 9], name="resumed")
    resumed.load_state_dict(state)
    assert (resumed.of(3), resumed.of(5), resumed.of(7)) == ("dead", "dead", "resumed")
    # Resumed twice: the tasks still in flight keep the process that dispatched them.
    assert resumed.state_dict() == {"tasks": [[5, "dead"], [9, "resumed"]]}


def test_the_state_loads_with_weights_only() -> None:
    """The state is plain values: a checkpoint read with weights_only=True holds it."""
    buffer = io.BytesIO()
    torch.save(Incarnations(lambda: [1], name="a").state_dict(), buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == {"tasks": [[1, "a"]]}


def test_a_checkpoint_without_it_takes_over_nothing() -> None:
    """A checkpoint written before this component: every answer must name the resumed process."""
    resumed = Incarnations(lambda: [], name="new")
    resumed.load_state_dict({})
    assert resumed.of(4) == "new"
    assert len(Incarnations(lambda: []).name) == 16
