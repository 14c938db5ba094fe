"""A sweep killed outright (SIGKILL: no handler runs, its runs stay ``RUNNING``) and resumed with ``--resume``: no child
run lost or repeated, the killed one continued from its checkpoint to the weights of an uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

import flasync
from flasync.config import load_config
from flasync.runtime.sweep_runs import PARENT_TAG, POINT_TAG
from flasync.tracking.store import prepare_sqlite_store

pytestmark = pytest.mark.slow

ROOT = Path(flasync.__file__).resolve().parents[1]

# A run long enough that two checkpoints reach the store before it ends; the [sweep] section is the whole sweep.
CONFIG = """
seed = 3
model = {kind = "mlp", hidden = [32]}
partition = {kind = "iid"}
population = {num_clients = 20}
client = {epochs = 2, batch_size = 16, lr = 0.1}
server = {kind = "fedbuff", buffer_size = 4, concurrency = 8}
eval = {every_versions = 10}
stop = {max_versions = 200}
checkpoint = {every_versions = 10}
tracking = {log_model = false}

[sweep]
grid = {seed = "0..2"}
"""
POINTS = ["seed=0", "seed=1", "seed=2"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def _children(client: mlflow.MlflowClient, parent_id: str) -> dict[str, list[mlflow.entities.Run]]:
    """Return the parent's child runs by point (each point's list should hold one run)."""
    experiment = client.get_run(parent_id).info.experiment_id
    runs = client.search_runs([experiment], filter_string=f"tags.`{PARENT_TAG}` = '{parent_id}'")
    found: dict[str, list[mlflow.entities.Run]] = {}
    for run in runs:
        found.setdefault(run.data.tags[POINT_TAG], []).append(run)
    return found


def _kill_during_the_second_run(folder: Path, store: str) -> str:
    """Start the sweep; SIGKILL it once its second run has both checkpoint slots in the store; return the parent id."""
    process = subprocess.Popen(
        [sys.executable, "-m", "flasync", "sweep", "sweep.toml", "--tracking-uri", store, "--no-system-metrics"],
        cwd=folder,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    client = mlflow.MlflowClient(store)
    parent_id, second, lines = None, False, []
    for line in process.stdout:
        lines.append(line)
        named = re.search(r"MLflow parent run (\w{32})", line)
        parent_id = parent_id or (named.group(1) if named else None)
        second = second or f"run 2/3 {POINTS[1]} started" in line
        if parent_id and second and "server.eval" in line:
            child = _children(client, parent_id).get(POINTS[1])
            # Both slots: the second write began after the first ended, so one is whole even if the kill lands
            # in the middle of an upload.
            if child and len(client.list_artifacts(child[0].info.run_id, "checkpoints")) == 2:
                process.kill()
                break
    rest, _ = process.communicate(timeout=60)
    output = "".join(lines) + rest
    assert parent_id is not None, output[-3000:]
    assert process.returncode == -signal.SIGKILL, f"exit {process.returncode} before the kill: {output[-3000:]}"
    return parent_id


def test_a_killed_sweep_resumes_without_losing_or_repeating_a_run(tmp_path: Path) -> None:
    """SIGKILL during the second run leaves it and the parent RUNNING; ``--resume`` skips the finished first run,
    continues the second in its own child run from its checkpoint to the uninterrupted run's weights, runs the third:
    one FINISHED child run per point."""
    (tmp_path / "sweep.toml").write_text(CONFIG)
    store = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    prepare_sqlite_store(store)
    parent_id = _kill_during_the_second_run(tmp_path, store)
    client = mlflow.MlflowClient(store)
    assert client.get_run(parent_id).info.status == "RUNNING"  # nothing ended it
    killed = _children(client, parent_id)
    assert sorted(killed) == POINTS[:2]
    assert [r.info.status for r in killed[POINTS[0]]] == ["FINISHED"]
    assert [r.info.status for r in killed[POINTS[1]]] == ["RUNNING"]

    resumed = subprocess.run(
        [sys.executable, "-m", "flasync", "sweep", "--resume", parent_id, "--tracking-uri", store],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    second_id = killed[POINTS[1]][0].info.run_id
    assert f"run 2/3 {POINTS[1]} started (resuming child run {second_id} from its checkpoint)" in resumed.stderr
    assert "run 1/3" not in resumed.stderr
    assert "flasync sweep finished (3 of 3 runs, 1 finished before)" in resumed.stdout
    assert client.get_run(parent_id).info.status == "FINISHED"
    children = _children(client, parent_id)
    assert {point: [(r.info.run_id, r.info.status) for r in runs] for point, runs in children.items()} == {
        POINTS[0]: [(killed[POINTS[0]][0].info.run_id, "FINISHED")],
        POINTS[1]: [(second_id, "FINISHED")],
        POINTS[2]: [(children[POINTS[2]][0].info.run_id, "FINISHED")],
    }
    assert children[POINTS[0]][0].info.end_time == killed[POINTS[0]][0].info.end_time  # not run again
    summary = json.loads(Path(client.download_artifacts(second_id, "summary.json", str(tmp_path))).read_text())
    uninterrupted = flasync.run(load_config(tmp_path / "sweep.toml", ["seed=1", "tracking.enabled=false"]))
    assert summary["weights_sha256"] == uninterrupted.weights_sha256
    steps = [m.step for m in client.get_metric_history(second_id, "server/eval/accuracy")]
    assert sorted(steps) == list(range(0, 201, 10))  # every evaluation once, none lost or logged twice
