"""Room held on a local store's disk for a run's end status: a full disk still lets the run end ``FAILED``.

A run whose store and spool fill one disk loses records; its end status is then one more row the store must write.
SQLite grows its write-ahead log by a page or more for it, which a disk with no byte left refuses, and the run stays
``RUNNING`` in the store. A :class:`StatusRoom` holds :data:`ROOM_BYTES` on the store's disk from the moment the run
opens (a file beside the database, its blocks allocated) and gives them back just before the status is written, so
the file is gone once the run has ended, whatever its end. A process killed before that leaves its file: the next
run that holds room in that folder removes the files of processes no longer running (a process this one cannot
see, in another container sharing the folder, counts as gone: its run only loses its room).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path

__all__ = ["ROOM_BYTES", "StatusRoom"]

ROOM_BYTES = 512 * 1024
"""Bytes held: a status row's pages in the write-ahead log, and what MLflow's session writes beside it, many times
over."""

_PREFIX = ".flasync-status-room-"
_NAME = re.compile(re.escape(_PREFIX) + r"(\d+)-")


class StatusRoom:
    """Room for a run's end status on the disk of a folder (a local store's), held from :meth:`hold` to
    :meth:`give_back`.

    Args:
        folder: The folder of the store's database (None: nothing is held, every call does nothing).
        nbytes: Bytes to hold.
    """

    def __init__(self, folder: Path | None, nbytes: int = ROOM_BYTES) -> None:
        """Hold nothing yet."""
        self.folder = folder
        self.nbytes = nbytes
        self.path: Path | None = None
        """The file holding the room, while it does."""

    def hold(self) -> bool:
        """Allocate the room (once; removing the files of dead processes first); False where the disk has no room
        for it, or the folder is not there."""
        if self.path is not None:
            return True
        if self.folder is None or not self.folder.is_dir():
            return False
        _remove_abandoned(self.folder)
        path = self.folder / f"{_PREFIX}{os.getpid()}-{id(self):x}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return False
        try:
            _allocate(fd, self.nbytes)
        except OSError:  # a disk full already: no room to hold
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            return False
        os.close(fd)
        self.path = path
        return True

    def give_back(self) -> bool:
        """Free the room now (before the status is written); False where none was held."""
        path, self.path = self.path, None
        if path is None:
            return False
        with contextlib.suppress(OSError):
            path.unlink()
        return True


def _allocate(fd: int, nbytes: int) -> None:
    """Give the file ``nbytes`` of real blocks (a sparse file would hold none)."""
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, nbytes)
            return
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without it: written below
                raise
    block = b"\0" * 65536
    left = nbytes
    while left > 0:
        left -= os.write(fd, block[: min(left, len(block))])
    os.fsync(fd)


def _remove_abandoned(folder: Path) -> None:
    """Remove the room files of processes that are no longer running (killed before their run ended)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            found = _NAME.match(entry.name)
            if found is None or _running(int(found.group(1))):
                continue
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def _running(pid: int) -> bool:
    """Tell whether process ``pid`` exists (one owned by another user counts)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
