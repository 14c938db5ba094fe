"""``flasync sweep`` end to end into a temporary SQLite store: the parent run, its child runs, its table; an
interrupted sweep resumed without repeating or losing a run."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import mlflow
import pytest
from mlflow.entities import Run

from flasync.cli import main
from flasync.config import RunConfig
from flasync.core.errors import RunInterrupted
from flasync.runtime.federation import Federation, RunSummary
from flasync.runtime.sweep import PointTask, Sweep, SweepPlan, SweepPoint, SweepRow, parse_axis
from flasync.runtime.sweep_runs import PARENT_TAG, POINT_TAG, SWEEP_TAG
from flasync.tracking.compare import SWEEP_PARENT_TAG, fetch_runs

pytestmark = pytest.mark.slow

SMALL = [  # flasync.testing.small_config's settings, tracked
    "--set", "model.hidden=[32]",
    "--set", "population.num_clients=20",
    "--set", "client.epochs=2",
    "--set", "client.batch_size=16",
    "--set", "eval.every_versions=3",
    "--set", "tracking.log_model=false",
    "--no-system-metrics",
]  # fmt: skip
GRID = ["--grid", "server.kind=fedavg,fedbuff", "--grid", "seed=0..1"]
POINTS = [f"server.kind={kind},seed={seed}" for kind in ("fedavg", "fedbuff") for seed in (0, 1)]


def _runs(uri: str) -> tuple[Run, list[Run]]:
    """Return the store's one sweep parent run and its child runs (in the grid's order)."""
    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name("flasync")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if PARENT_TAG not in r.data.tags]
    assert len(parents) == 1, [r.info.run_name for r in runs]
    children = [r for r in runs if r.data.tags.get(PARENT_TAG) == parents[0].info.run_id]
    return parents[0], sorted(children, key=lambda r: POINTS.index(r.data.tags[POINT_TAG]))


def test_a_2x2_sweep_logs_a_parent_run_and_four_child_runs(store: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Four FINISHED children named after their points under one parent, whose table lists them and their figures."""
    status = main(["sweep", *GRID, *SMALL, "--set", "stop.max_versions=6", "--tracking-uri", store])
    out, err = capsys.readouterr()
    assert status == 0, out
    parent, children = _runs(store)
    assert parent.info.status == "FINISHED"
    assert [c.info.run_name for c in children] == POINTS
    # The parent run is named once on the console, as soon as it is open: before the second run at the latest.
    lines = err.splitlines()
    named = [i for i, line in enumerate(lines) if f"MLflow parent run {parent.info.run_id}" in line]
    second = [i for i, line in enumerate(lines) if f"run 2/4 {POINTS[1]} started" in line]
    assert len(named) == 1 and len(second) == 1 and named[0] < second[0], err
    assert {c.info.status for c in children} == {"FINISHED"}
    assert {c.data.tags[SWEEP_TAG] for c in children} == {parent.data.tags[SWEEP_TAG]}
    assert [(c.data.params["server.kind"], c.data.params["seed"]) for c in children] == [
        (k, s) for k in ("fedavg", "fedbuff") for s in ("0", "1")
    ]
    assert parent.data.params["sweep.grid"] == "server.kind=fedavg,fedbuff seed=0..1"
    client = mlflow.MlflowClient(store)
    table = client.download_artifacts(parent.info.run_id, "sweep/table.csv", str(Path(store[10:]).parent))
    rows = list(csv.DictReader(io.StringIO(Path(table).read_text())))
    assert [r["point"] for r in rows] == POINTS
    assert [r["run_id"] for r in rows] == [c.info.run_id for c in children]
    assert all(r["status"] == "FINISHED" and float(r["accuracy"]) > 0 for r in rows)
    best = max(rows, key=lambda r: float(r["accuracy"]))
    assert parent.data.tags["flasync.sweep.best_run_id"] == best["run_id"]
    assert {a.path for a in client.list_artifacts(parent.info.run_id, "sweep")} >= {
        "sweep/table.csv",
        "sweep/table.json",
        "sweep/accuracy.svg",
        "sweep/plan.json",
    }
    for child in children:  # the console's table
        assert re.search(rf"{re.escape(child.info.run_name)} +FINISHED .* {child.info.run_id}", out), out
    # Comparing the experiment compares the child runs, not the parent (it trains nothing), also for --last.
    compared = fetch_runs(client, experiment="flasync")
    assert [r.run_id for r in compared] == [c.info.run_id for c in children]
    assert [r.run_id for r in fetch_runs(client, experiment="flasync", last=2)] == [c.info.run_id for c in children[2:]]
    assert SWEEP_PARENT_TAG in parent.data.tags and not any(SWEEP_PARENT_TAG in c.data.tags for c in children)
    # A finished sweep has nothing to resume, by its parent's id or by its command.
    assert main(["sweep", "--resume", parent.info.run_id, "--tracking-uri", store]) == 2
    assert "the sweep already FINISHED" in capsys.readouterr().err
    assert main(["sweep", "--resume", children[0].info.run_id, "--tracking-uri", store]) == 2
    assert f"not its parent run: --resume {parent.info.run_id} resumes the sweep" in capsys.readouterr().err
    assert main(["sweep", *GRID, *SMALL, "--set", "stop.max_versions=6", "--tracking-uri", store, "--resume"]) == 2
    assert "no unfinished sweep of this config and grid" in capsys.readouterr().err


def _env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


def test_an_interrupted_sweep_resumes_without_repeating_or_losing_a_run(store: str, tmp_path: Path) -> None:
    """Ctrl-C during the second run: exit 130, that run KILLED with a checkpoint; the same command with --resume
    skips the first run, resumes the second from its checkpoint and runs the others: four FINISHED children."""
    command = ["sweep", *GRID, *SMALL, "--set", "stop.max_versions=120", "--tracking-uri", store]
    process = subprocess.Popen(
        [sys.executable, "-m", "flasync", *command],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert process.stdout is not None
    lines: list[str] = []
    second = False
    for line in process.stdout:
        lines.append(line)
        second = second or f"run 2/4 {POINTS[1]} started" in line
        if second and "server.eval" in line and re.search(r"\bversion=([3-9]|\d\d+)/", line):
            os.killpg(process.pid, signal.SIGINT)  # as Ctrl-C in a terminal: the whole process group
            break
    rest, _ = process.communicate(timeout=120)
    output = "".join(lines) + rest
    assert process.returncode == 130, output
    parent, children = _runs(store)
    assert parent.info.status == "KILLED"
    assert f"resume with: python -m flasync sweep --resume {parent.info.run_id}" in output
    assert "flasync sweep stopped (1 of 4 runs finished, 1 stopped)" in output
    assert [(c.info.run_name, c.info.status) for c in children] == [(POINTS[0], "FINISHED"), (POINTS[1], "KILLED")]
    first, killed = children

    resumed = subprocess.run(
        [sys.executable, "-m", "flasync", *command, "--resume"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"run 2/4 {POINTS[1]} started (resuming child run {killed.info.run_id}" in resumed.stderr
    assert "run 1/4" not in resumed.stderr
    parent_again, children = _runs(store)
    assert parent_again.info.run_id == parent.info.run_id and parent_again.info.status == "FINISHED"
    assert [(c.info.run_name, c.info.status) for c in children] == [(p, "FINISHED") for p in POINTS]
    assert children[0].info.end_time == first.info.end_time  # not run again
    assert children[1].info.run_id == killed.info.run_id  # continued, not started again
    assert "flasync sweep finished (4 of 4 runs, 1 finished before)" in resumed.stdout
    # The parent's figures are the whole table's, not those its interrupted end logged from the points it had.
    client = mlflow.MlflowClient(store)
    table_file = client.download_artifacts(parent.info.run_id, "sweep/table.json", str(tmp_path))
    table = json.loads(Path(table_file).read_text())
    for key in ("accuracy", "objective"):
        latest = {}
        for point in sorted(client.get_metric_history(parent.info.run_id, key), key=lambda m: m.timestamp):
            latest[point.step] = point.value
        assert latest == {row["index"]: row[key] for row in table}
    best = max(table, key=lambda row: row["objective"])
    assert parent_again.data.metrics["best_objective"] == best["objective"]
    assert parent_again.data.metrics["best_accuracy"] == best["accuracy"]


def test_a_parallel_sweep_runs_its_points_in_worker_processes(store: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--parallel 2``: the same parent and children as one process gives, each child FINISHED."""
    status = main(["sweep", *GRID, *SMALL, "--set", "stop.max_versions=6", "--parallel", "2", "--tracking-uri", store])
    out = capsys.readouterr().out
    assert status == 0, out
    parent, children = _runs(store)
    assert parent.info.status == "FINISHED"
    assert [(c.info.run_name, c.info.status) for c in children] == [(p, "FINISHED") for p in POINTS]
    assert parent.data.params["sweep.parallel"] == "2"


def _stopped(build: Callable[[], Federation]) -> RunSummary:
    """A runner whose every run is stopped at once, as Ctrl-C stops one (picklable: a worker process runs it)."""
    raise RunInterrupted("SIGINT")


class _Parent:
    """A sweep's runs kept in memory: no child finished, each point a new child run."""

    def __init__(self) -> None:
        self.run_id = "parent"
        self.ended: tuple[list[SweepRow], str] | None = None

    def finished_rows(self, plan: SweepPlan) -> dict[int, SweepRow]:
        return {}

    def unfinished_points(self, plan: SweepPlan) -> list[SweepPoint]:
        return []

    def task(self, plan: SweepPlan, point: SweepPoint, config: RunConfig) -> PointTask:
        return PointTask(point, config, {PARENT_TAG: self.run_id})

    def finish(self, plan: SweepPlan, rows: Sequence[SweepRow], status: str) -> None:
        self.ended = (list(rows), status)


def test_a_stopped_run_ends_a_parallel_sweep() -> None:
    """With ``parallel = 2`` the two runs a stop request ends are KILLED rows, no further run starts and the parent
    ends KILLED."""
    plan = SweepPlan({}, [parse_axis("seed=0..3")])
    started: list[str] = []
    parent = _Parent()
    outcome = Sweep(plan, parallel=2, runner=_stopped, on_start=lambda t, i, n: started.append(t.point.name)).run(
        parent
    )
    assert outcome.stopped == "SIGINT"
    assert started == ["seed=0", "seed=1"]
    assert [(row.point, row.status) for row in outcome.rows] == [("seed=0", "KILLED"), ("seed=1", "KILLED")]
    assert parent.ended is not None and parent.ended[1] == "KILLED"
