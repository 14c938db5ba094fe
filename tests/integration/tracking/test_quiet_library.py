"""The Python API prints no library debug line into an application that never configured structlog."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = """
import sys
import flasync
config = {
    "population": {"num_clients": 20},
    "stop": {"max_versions": 2},
    "tracking": {"enabled": True, "uri": sys.argv[1], "log_model": True, "log_level": "warning"},
}
flasync.run(config)
flasync.run(config)  # its model's export comes from the cache the first run filled
"""


@pytest.mark.slow
def test_two_tracked_runs_from_python_print_no_debug_line(tmp_path: Path) -> None:
    """Two runs of the same model (the second saves it from the export cache) print no debug line of flasync's."""
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, uri], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    output = done.stdout + done.stderr
    assert "[debug" not in output and "model_from_cache" not in output
    assert list((tmp_path / "cache" / "flasync" / "model-exports").iterdir())  # the second run had a kept export
