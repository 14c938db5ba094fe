"""The processes of a local Ray that a run started, so that the run ends only once they have.

``ray.shutdown()`` stops the GCS and the raylet that ``ray.init`` started, but the processes under the raylet
(workers, agents) notice and end on their own, a moment later, or seconds later on a loaded machine: a ``flasync
run`` could return while some of them still ran. :func:`started_since` names the processes ``ray.init`` started (this
process's new children that run Ray's own programs); :func:`reap`, after the shutdown, waits for them and everything
under them, and kills what is left after a bound.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Sequence

import psutil

__all__ = ["children", "reap", "started_since", "with_descendants"]


def children() -> set[int]:
    """Return the process ids of this process's children now."""
    return {child.pid for child in psutil.Process().children()}


def started_since(before: set[int], package_dir: str) -> list[psutil.Process]:
    """Return this process's children not in ``before`` whose program or script lies under ``package_dir`` (Ray's
    installed package: its GCS and raylet binaries, its monitor scripts); a child of another program started meanwhile
    (a tracking writer, say) is not one of them."""
    root = os.path.join(os.path.realpath(package_dir), "")
    found = []
    for child in psutil.Process().children():
        if child.pid in before:
            continue
        with contextlib.suppress(psutil.Error):
            if any(os.path.realpath(arg).startswith(root) for arg in child.cmdline()[:3] if os.sep in arg):
                found.append(child)
    return found


def with_descendants(roots: Iterable[psutil.Process]) -> list[psutil.Process]:
    """Return ``roots`` and every process under them now (those already gone left out)."""
    tree: dict[int, psutil.Process] = {}
    for root in roots:
        with contextlib.suppress(psutil.Error):
            if root.is_running():
                tree[root.pid] = root
                tree.update((child.pid, child) for child in root.children(recursive=True))
    return list(tree.values())


def reap(processes: Sequence[psutil.Process], grace_s: float, kill_wait_s: float = 5.0) -> list[psutil.Process]:
    """Wait up to ``grace_s`` seconds for ``processes`` to end, then kill those left and wait up to ``kill_wait_s``
    for them; return the ones killed."""
    if not processes:
        return []
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    if alive:
        psutil.wait_procs(alive, timeout=kill_wait_s)
    return list(alive)
