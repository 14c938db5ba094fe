"""Room held on a local store's disk for a run's end status: allocated, given back, abandoned files removed."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flasync.tracking import _room
from flasync.tracking._room import ROOM_BYTES, StatusRoom


def _held(folder: Path) -> list[Path]:
    return sorted(folder.glob(".flasync-status-room-*"))


def test_room_is_real_blocks_held_until_given_back(tmp_path: Path) -> None:
    """The room is a file of allocated blocks (a sparse file holds no room) beside the store, there once however
    often it is held, and gone once given back; giving back twice, or room never held, is harmless."""
    room = StatusRoom(tmp_path, nbytes=256 * 1024)
    assert room.hold() and room.hold()
    (path,) = _held(tmp_path)
    assert path == room.path and path.stat().st_size == 256 * 1024
    assert path.stat().st_blocks * 512 >= 256 * 1024
    assert room.give_back() and not _held(tmp_path)
    assert not room.give_back()
    assert not StatusRoom(None).hold() and not StatusRoom(tmp_path / "missing").hold()
    assert ROOM_BYTES >= 64 * 1024


def test_a_disk_without_room_holds_none_and_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the disk is full already, holding fails quietly and leaves nothing behind."""

    def full(fd: int, nbytes: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_room, "_allocate", full)
    room = StatusRoom(tmp_path)
    assert not room.hold()
    assert room.path is None and not _held(tmp_path)


def test_the_room_of_a_killed_process_is_removed_by_the_next_holder(tmp_path: Path) -> None:
    """A process killed before its run ended leaves its room file; the next run that holds room there removes it,
    and leaves the rooms of processes still running."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    abandoned = tmp_path / f".flasync-status-room-{dead}-abc"
    abandoned.write_bytes(b"\0" * 10)
    alive = tmp_path / f".flasync-status-room-{os.getppid()}-abc"
    alive.write_bytes(b"\0" * 10)
    other = tmp_path / "mlflow.db"
    other.write_bytes(b"")
    room = StatusRoom(tmp_path, nbytes=4096)
    assert room.hold()
    assert not abandoned.exists() and alive.exists() and other.exists()
    room.give_back()
