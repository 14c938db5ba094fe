"""Artifact files an importable function writes, made in a one-shot process rather than the tracker's.

When the store fails, a tracker spools its run's model (see :meth:`tracking.MlflowTracker.log_model_from`):
``torch.export`` and MLflow's pytorch flavour, imported and exporting in the training process, would bring tens of
thousands of long-lived Python objects into it, and such a burst sets off a full collection of Python's garbage
collector, which stops every thread of the process, the event loop's too, for a time that grows with the whole heap
(0.2 s with torch loaded, on a 2-core machine). So :func:`write_elsewhere` has ``python -m tracking._files`` save it.
Nothing crosses the boundary but the function's name, its JSON keyword arguments and the files it writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flasync.tracking._model import call

__all__ = ["write", "write_elsewhere"]

_TIMEOUT_S = 300.0


def write(target: str, folder: str, kwargs: Mapping[str, Any]) -> list[str]:
    """Call ``target(folder=folder, **kwargs)``; return the names of the files in ``folder`` afterwards.

    Args:
        target: ``package.module:name`` of a function writing files into the folder it is given.
        folder: An existing, empty folder.
        kwargs: Its other keyword arguments (JSON values).
    """
    call(target, {**kwargs, "folder": folder})
    return sorted(path.name for path in Path(folder).iterdir() if path.is_file())


def write_elsewhere(target: str, folder: str, kwargs: Mapping[str, Any], *, timeout_s: float = _TIMEOUT_S) -> None:
    """Run :func:`write` in a fresh Python process and wait for it.

    Args:
        target: As for :func:`write` (importable by a fresh interpreter: no ``__main__`` names).
        folder: As for :func:`write`.
        kwargs: As for :func:`write`.
        timeout_s: Longest wait, in seconds; the process is killed after it.

    Raises:
        RuntimeError: The process failed (the last line of its error output) or did not end in time.
    """
    env = dict(os.environ)
    # The process imports this package from wherever this one did, installed or not.
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    request = json.dumps({"target": target, "folder": folder, "kwargs": dict(kwargs)})
    try:
        done = subprocess.run(
            [sys.executable, "-m", "flasync.tracking._files"],
            input=request,
            capture_output=True,
            text=True,
            encoding="utf-8",
            env=env,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{target} did not finish within {timeout_s:.0f} s") from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise RuntimeError(f"{target} failed: {lines[-1] if lines else f'exit status {done.returncode}'}")


if __name__ == "__main__":
    job = json.loads(sys.stdin.read())
    write(job["target"], job["folder"], job["kwargs"])
    sys.stdout.flush()
    os._exit(0)  # the files are written: no teardown of what the target imported
