"""``flasync sweep CONFIG`` from the config's ``[sweep]`` section alone, into a temporary SQLite store: a grid whose
flags override the section, and an Optuna search whose trials are child runs, drawn again the same when resumed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import mlflow
import pytest
from mlflow.entities import Run

from flasync.cli import main
from flasync.config import config_data
from flasync.config.sweep import sweep_section
from flasync.core.errors import RunInterrupted
from flasync.runtime.federation import Federation, RunSummary
from flasync.runtime.sweep import Sweep, run_federation
from flasync.runtime.sweep_runs import PARENT_TAG, VALUES_TAG, SweepParent
from flasync.runtime.sweep_search import SearchPlan

pytestmark = pytest.mark.slow

BASE = """
model = {kind = "mlp", hidden = [32]}
population = {num_clients = 20}
client = {epochs = 1, batch_size = 16}
eval = {every_versions = 3}
stop = {max_versions = 6}
tracking = {log_model = false, system_metrics = false}
"""
GRID = (
    BASE
    + """
[sweep]
grid = {"server.kind" = ["fedavg", "fedbuff"], seed = "0..1"}
set = {"stop.max_versions" = 4}
objective = "server/eval/loss:min"
"""
)
SEARCH = (
    BASE
    + """
[sweep]
objective = "server/eval/loss:min"

[sweep.search]
sampler = "tpe"
trials = 4
seed = 11
space."client.lr" = {kind = "float", low = 0.001, high = 0.5, log = true}
space."server.kind" = {kind = "categorical", choices = ["fedavg", "fedbuff"]}
"""
)


def _family(uri: str, experiment: str = "flasync") -> tuple[Run, list[Run]]:
    """Return the experiment's one parent run and its child runs by start time."""
    client = mlflow.MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None
    runs = client.search_runs([found.experiment_id], order_by=["attributes.start_time ASC"])
    parents = [r for r in runs if PARENT_TAG not in r.data.tags]
    assert len(parents) == 1, [r.info.run_name for r in runs]
    return parents[0], [r for r in runs if r.data.tags.get(PARENT_TAG) == parents[0].info.run_id]


def test_a_grid_from_the_config_alone_with_flags_over_it(store: str, tmp_path: Path) -> None:
    """The section's grid, fixed settings and objective make the sweep; ``--grid seed=5`` replaces its seed axis and
    ``--set`` wins over its ``set``."""
    (tmp_path / "grid.toml").write_text(GRID)
    argv = ["sweep", "grid.toml", "--grid", "seed=5", "--set", "stop.max_versions=3", "--tracking-uri", store]
    assert main(argv) == 0
    parent, children = _family(store)
    assert sorted(c.info.run_name for c in children) == ["server.kind=fedavg,seed=5", "server.kind=fedbuff,seed=5"]
    assert {c.data.params["stop.max_versions"] for c in children} == {"3"}
    assert {c.data.params["eval.every_versions"] for c in children} == {"3"}
    assert parent.data.params["sweep.objective"] == "server/eval/loss:min"
    assert parent.data.params["sweep.grid"] == "server.kind=fedavg,fedbuff seed=5"
    best = min(children, key=lambda c: c.data.metrics["server/eval/loss"])
    assert parent.data.tags["flasync.sweep.best_run_id"] == best.info.run_id
    assert parent.data.metrics["best_objective"] == pytest.approx(best.data.metrics["server/eval/loss"])


def test_a_search_logs_each_trial_as_a_child_run_and_draws_the_same_trials_again(store: str, tmp_path: Path) -> None:
    """Four trials, each a FINISHED child run tagged with its values; a second search of the same seed into
    another experiment draws the same values."""
    (tmp_path / "search.toml").write_text(SEARCH)
    assert main(["sweep", "search.toml", "--tracking-uri", store]) == 0
    assert main(["sweep", "search.toml", "--tracking-uri", store, "--experiment", "again"]) == 0
    parent, children = _family(store)
    _, again = _family(store, "again")
    assert [c.info.status for c in children] == ["FINISHED"] * 4
    assert [c.info.run_name for c in children] == [c.info.run_name for c in again]
    assert [c.info.run_name.split(":")[0] for c in children] == [f"trial {i}" for i in range(4)]
    for child in children:
        recorded = dict(json.loads(child.data.tags[VALUES_TAG])["values"])
        assert float(child.data.params["client.lr"]) == float(recorded["client.lr"])
        assert child.data.params["server.kind"] == recorded["server.kind"]
    assert parent.data.params["sweep.search.sampler"] == "tpe"
    assert parent.data.params["sweep.space.client.lr"] == "float[0.001, 0.5] log"
    assert parent.data.params["sweep.points"] == "4"


def _stopping_at(trial: int) -> Callable[[Callable[[], Federation]], RunSummary]:
    """A runner that runs every trial until ``trial``, which a stop request ends before its run opens."""
    seen: list[str] = []

    def runner(build: Callable[[], Federation]) -> RunSummary:
        seen.append("run")
        if len(seen) == trial + 1:
            raise RunInterrupted("SIGINT")
        return run_federation(build)

    return runner


def test_an_interrupted_search_resumes_with_the_trials_it_had(store: str, tmp_path: Path) -> None:
    """Stopped at its third trial, the search's parent run reopened from the store rebuilds the study from the
    finished child runs: the first two are not run again, and the trials drawn are an uninterrupted search's."""
    (tmp_path / "search.toml").write_text(SEARCH)
    data = config_data(tmp_path / "search.toml")
    section = sweep_section(data)
    assert section is not None and section.search is not None
    plan = SearchPlan(data, section.search, store, section.objective)

    whole = Sweep(plan).run(SweepParent.create(store, "whole", plan, parallel=1))
    stopped = Sweep(plan, runner=_stopping_at(2)).run(SweepParent.create(store, "flasync", plan, parallel=1))
    assert stopped.stopped == "SIGINT" and [r.status for r in stopped.rows] == ["FINISHED", "FINISHED", "KILLED"]
    parent, reopened = SweepParent.reopen(store, stopped.parent_run_id)
    started: list[int] = []
    resumed = Sweep(reopened, on_start=lambda task, i, n: started.append(task.point.index)).run(parent)
    assert started == [2, 3] and resumed.skipped == 2
    assert [(r.point, r.status) for r in resumed.rows] == [(r.point, "FINISHED") for r in whole.rows]
    assert [r.objective for r in resumed.rows] == [r.objective for r in whole.rows]
    _, children = _family(store)
    assert len(children) == 4 and {c.info.status for c in children} == {"FINISHED"}
