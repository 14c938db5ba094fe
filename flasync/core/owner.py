"""Which process owns a tracked run: recorded as tags when it starts, checked before another process takes over.

A run whose process was killed (SIGKILL, the OOM killer, a node going away) stays ``RUNNING`` in MLflow for ever.
The tags ``flasync.owner.host``, ``flasync.owner.pid`` and ``flasync.owner.started`` (the process's start time,
which tells a reused pid apart) let a later command know whether the owner is still alive on this host.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

import psutil

__all__ = ["HOST_TAG", "PID_TAG", "STARTED_TAG", "owner_alive", "owner_tags"]

HOST_TAG = "flasync.owner.host"
PID_TAG = "flasync.owner.pid"
STARTED_TAG = "flasync.owner.started"


def owner_tags() -> dict[str, str]:
    """Return the tags that name this process as a run's owner."""
    me = psutil.Process()
    return {HOST_TAG: socket.gethostname(), PID_TAG: str(me.pid), STARTED_TAG: f"{me.create_time():.3f}"}


def owner_alive(tags: Mapping[str, str]) -> bool | None:
    """Tell whether the process a run's tags name is alive: True, False, or None when that cannot be known.

    None: the run has no owner tags, or its owner is on another host.
    """
    host, pid, started = tags.get(HOST_TAG), tags.get(PID_TAG), tags.get(STARTED_TAG)
    if host is None or pid is None or started is None or host != socket.gethostname():
        return None
    try:
        process = psutil.Process(int(pid))
        return abs(process.create_time() - float(started)) < 0.01 and process.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return False
