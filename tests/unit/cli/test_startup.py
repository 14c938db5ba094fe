"""The command line's start: what it imports before MLflow's writer process starts, which then imports MLflow and
opens the store while this process imports torch and loads the data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "numpy", "mlflow", "sqlalchemy", "pandas")
"""Modules each taking from a tenth of a second to over a second to import."""


def _heavy_loaded(code: str, cwd: Path) -> list[str]:
    """Run ``code`` in a fresh interpreter (in ``cwd``); return the :data:`HEAVY` modules it printed as loaded."""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True, timeout=120
    )
    loaded: list[str] = json.loads(result.stdout.strip().splitlines()[-1])
    return loaded


@pytest.mark.slow
def test_the_program_imports_nothing_heavy(tmp_path: Path) -> None:
    """Importing the command line (``python -m flasync`` imports it whole) loads neither torch, NumPy nor MLflow."""
    code = f"import json, sys, flasync.__main__\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    assert _heavy_loaded(code, tmp_path) == []


@pytest.mark.slow
def test_a_tracked_run_starts_its_writer_process_before_torch(tmp_path: Path) -> None:
    """``flasync run`` starts MLflow's writer process (``tracker.prepare()``) before it imports torch, NumPy or
    MLflow: the writer's start-up overlaps with this process's."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code = (
        "import json, os, sys\n"
        "from flasync.tracking.mlflow_run import MlflowTracker\n"
        "def prepare(self):\n"
        f"    print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]), flush=True)\n"
        "    os._exit(0)  # nothing started yet: no writer process is left behind\n"
        "MlflowTracker.prepare = prepare\n"
        "from flasync.cli import main\n"
        f"main(['run', '--tracking-uri', {uri!r}])\n"
        "print('prepare() was never called')\n"
    )
    assert _heavy_loaded(code, tmp_path) == []
