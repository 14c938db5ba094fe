"""What installing flasync puts into an environment: one top-level package, ``flasync``."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_wheel_installs_flasync_alone_with_its_tracking_package(tmp_path: Path) -> None:
    """The built wheel holds ``flasync/`` only: the ``tracking/`` folder goes in as ``flasync.tracking`` (with its
    MLflow schema seeds), and nothing named ``tracking`` lands at the top of site-packages."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("flasync-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/", 1)[0] for name in names if not name.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"flasync"}
    assert "flasync/tracking/mlflow_run.py" in names
    assert any(name.startswith("flasync/tracking/schemas/") and name.endswith(".sql") for name in names)
    assert "flasync/algorithms/scaffold.py" in names and "flasync/training/plugins.py" in names
