"""Scratch folders: marked with their owner, removed by a later run once the owner is gone, never otherwise."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import flasync
from flasync.core.scratch import OWNER_FILE, make_scratch, sweep_scratch
from flasync.testing import small_config
from tests.conftest import ROOT


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.mark.slow
def test_only_folders_of_dead_owners_are_swept(tmp_path: Path) -> None:
    """A folder of a killed process goes; this process's, an unmarked one and another host's stay."""
    code = (
        "import os, signal, sys; from flasync.core.scratch import make_scratch; "
        "folder = make_scratch('run-', sys.argv[1]); (folder / 'spill.bin').write_bytes(b'x' * 1024); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    killed = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=_env(), check=False)
    assert killed.returncode == -signal.SIGKILL
    (dead,) = tmp_path.glob("run-*")
    mine = make_scratch("run-", tmp_path)
    unmarked = tmp_path / "run-unmarked"
    unmarked.mkdir()
    elsewhere = tmp_path / "run-elsewhere"
    elsewhere.mkdir()
    tags = json.loads((mine / OWNER_FILE).read_text())
    (elsewhere / OWNER_FILE).write_text(
        json.dumps({**tags, "flasync.owner.host": "another-host", "flasync.owner.pid": "1"})
    )
    assert sweep_scratch("run-", tmp_path) == [dead]
    assert not dead.exists()
    assert mine.is_dir() and unmarked.is_dir() and elsewhere.is_dir()
    assert sweep_scratch("run-", tmp_path / "missing") == []


@pytest.mark.slow
def test_a_sigkilled_runs_spilled_residuals_are_removed_by_the_next_run(tmp_path: Path) -> None:
    """Error-feedback residuals spilled to codec.residual_dir by a run killed with SIGKILL are removed when the next
    run starts (and a finished run leaves none)."""
    spill = tmp_path / "residuals"
    overrides = [
        "codec.upload=[{kind: topk, ratio: 0.05, error_feedback: true}]",
        "codec.max_residuals_in_memory=1",
        f"codec.residual_dir={spill}",
    ]
    process = subprocess.Popen(
        [sys.executable, "-m", "flasync", "run", "--no-tracking", "--set", "stop.max_versions=100000"]
        + [arg for item in overrides for arg in ("--set", item)],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 90
    while not any(spill.glob("residuals-*/*.f32")) and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.2)
    process.kill()
    process.wait(timeout=30)
    assert any(spill.glob("residuals-*")), "the killed run never spilled a residual"
    flasync.run(small_config("stop.max_versions=2", *overrides, "tracking.enabled=false"))
    assert not any(spill.glob("residuals-*"))
