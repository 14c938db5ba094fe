"""What a task's release tells, as the run is built: only what keeps state per task."""

from __future__ import annotations

from typing import Any, cast

from flasync.clients.simulated.client import ClientWorld
from flasync.clients.simulated.secure import SecureRoom
from flasync.runtime.build import _released


class _World:
    """The part of a client world a release reaches: its plug-ins, each told of every task released."""

    def __init__(self, plugins: int) -> None:
        self.plugins = tuple(object() for _ in range(plugins))
        self.forgotten: list[Any] = []

    def forget(self, task: Any) -> None:
        self.forgotten.append(task)


class _Room:
    """A secure room that records the tasks released."""

    def __init__(self) -> None:
        self.released_tasks: list[Any] = []

    def released(self, task: Any) -> None:
        self.released_tasks.append(task)


def test_without_client_plug_ins_or_a_secure_room_a_release_calls_nothing() -> None:
    assert _released(cast(ClientWorld, _World(0)), None) is None


def test_client_plug_ins_and_a_secure_room_are_each_told_of_a_release() -> None:
    task = object()
    world, room = _World(1), _Room()
    callback = _released(cast(ClientWorld, world), None)
    assert callback is not None
    callback(task)  # type: ignore[arg-type]
    assert world.forgotten == [task]
    both = _released(cast(ClientWorld, world), cast(SecureRoom, room))
    assert both is not None
    both(task)  # type: ignore[arg-type]
    assert world.forgotten == [task, task] and room.released_tasks == [task]
    alone, lone_room = _World(0), _Room()
    only_room = _released(cast(ClientWorld, alone), cast(SecureRoom, lone_room))
    assert only_room is not None
    only_room(task)  # type: ignore[arg-type]
    assert not alone.forgotten and lone_room.released_tasks == [task]
