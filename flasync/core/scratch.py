"""Scratch folders that a killed run does not leave behind for good.

A run keeps some temporary files on disk (spilled error-feedback residuals, torch profiler traces). A normal end
removes them; SIGKILL, the OOM killer or a lost node does not. Each scratch folder therefore carries a marker naming
its owner (host, pid and the process's start time, as :mod:`flasync.core.owner` records for MLflow runs), and every run
removes, when it starts, the scratch folders of owners that are gone. Folders without a marker, or of a live owner
or one on another host, are never touched.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from flasync.core.owner import owner_alive, owner_tags

__all__ = ["OWNER_FILE", "make_scratch", "sweep_scratch"]

OWNER_FILE = ".flasync-owner"


def make_scratch(prefix: str, parent: str | Path | None = None) -> Path:
    """Create an empty scratch folder ``<parent>/<prefix>XXXXXXXX`` owned by this process and return it.

    Args:
        prefix: Start of the folder's name (what :func:`sweep_scratch` looks for).
        parent: Where to create it; the system's temporary folder when None.
    """
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    (folder / OWNER_FILE).write_text(json.dumps(owner_tags()))
    return folder


def sweep_scratch(prefix: str, parent: str | Path | None = None) -> list[Path]:
    """Remove the scratch folders ``<parent>/<prefix>*`` whose owner process is gone; return those removed.

    Never raises: a folder that cannot be read or removed is left as it is.

    Args:
        prefix: Start of the folders' names, as given to :func:`make_scratch`.
        parent: Where to look; the system's temporary folder when None.
    """
    root = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    removed: list[Path] = []
    try:
        candidates = list(root.glob(f"{prefix}*"))
    except OSError:
        return removed
    for folder in candidates:
        try:
            tags = json.loads((folder / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # not a flasync scratch folder, or not readable: not ours to judge
        if not isinstance(tags, dict) or owner_alive({str(k): str(v) for k, v in tags.items()}) is not False:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            removed.append(folder)
    return removed
