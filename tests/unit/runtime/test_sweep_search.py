"""A search's trials: drawn by Optuna's samplers from the seed and the results before, the same when resumed from
the rows of the trials that ran, each trial's config checked."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest

from flasync.config.sweep import SearchConfig
from flasync.core.errors import ConfigError
from flasync.runtime.sweep import VALUES_TAG, SweepPoint, SweepRow
from flasync.runtime.sweep_search import SearchPlan

SPACE: dict[str, Any] = {
    "client.lr": {"kind": "float", "low": 1e-3, "high": 0.5, "log": True},
    "client.epochs": {"kind": "int", "low": 1, "high": 4},
    "server.kind": {"kind": "categorical", "choices": ["fedavg", "fedbuff"]},
}


def _plan(sampler: str = "tpe", trials: int = 14, seed: int = 0, objective: str = "accuracy:max") -> SearchPlan:
    search = SearchConfig.model_validate({"sampler": sampler, "trials": trials, "seed": seed, "space": SPACE})
    return SearchPlan({}, search, "sqlite:///unused/mlflow.db", objective)


def _result(point: SweepPoint) -> SweepRow:
    """A made-up run: its objective peaks at lr = 0.05 with fedbuff; trial 3 fails."""
    values = dict(point.values)
    if point.index == 3:
        return SweepRow(point.index, point.name, values, "FAILED", "run", error="RuntimeError")
    score = -((math.log(float(values["client.lr"])) - math.log(0.05)) ** 2) + (values["server.kind"] == "fedbuff")
    return SweepRow(point.index, point.name, values, "FINISHED", "run", objective=score)


def _drive(
    plan: SearchPlan,
    parallel: int,
    rows: dict[int, SweepRow] | None = None,
    unfinished: Sequence[SweepPoint] = (),
    stop_after: int | None = None,
) -> tuple[list[SweepPoint], dict[int, SweepRow]]:
    """Run the plan's batches with :func:`_result`; return the points in the order drawn and the rows."""
    rows = {} if rows is None else rows
    drawn: list[SweepPoint] = []
    for batch in plan.batches(rows, unfinished, parallel):
        for point, config in batch:
            assert config.tracking.run_name == point.name
            drawn.append(point)
            if stop_after is not None and len(rows) >= stop_after:
                return drawn, rows
            rows[point.index] = _result(point)
    return drawn, rows


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_the_same_seed_draws_the_same_trials(sampler: str) -> None:
    """Two searches of one seed draw equal trials, a third of another seed different ones; every trial is drawn
    once, in its number's order."""
    first, rows = _drive(_plan(sampler), 1)
    second, _ = _drive(_plan(sampler), 1)
    other, _ = _drive(_plan(sampler, seed=1), 1)
    assert [p.index for p in first] == list(range(14)) and sorted(rows) == list(range(14))
    assert first == second
    assert [p.values for p in other] != [p.values for p in first]
    assert all(p.trial and p.name.startswith(f"trial {p.index}: ") for p in first)


def test_tpe_learns_from_the_finished_trials() -> None:
    """Past its random start-up trials, TPE draws near the best region more often than random sampling does."""

    def near(points: list[SweepPoint]) -> int:
        return sum(abs(math.log(float(dict(p.values)["client.lr"]) / 0.05)) < 1 for p in points[10:])

    tpe, _ = _drive(_plan("tpe", trials=30), 1)
    uniform, _ = _drive(_plan("random", trials=30), 1)
    assert near(tpe) > near(uniform)


@pytest.mark.parametrize(("parallel", "stopped_at"), [(1, 6), (2, 7), (3, 4)])
def test_a_resumed_search_draws_the_trials_of_an_uninterrupted_one(parallel: int, stopped_at: int) -> None:
    """Stopped after some trials had rows, with the next one begun: resumed from those rows and that trial, the
    search draws the uninterrupted search's trials, none twice."""
    whole, whole_rows = _drive(_plan(), parallel)
    begun, rows = _drive(_plan(), parallel, stop_after=stopped_at)
    unfinished = [p for p in begun if p.index not in rows]
    assert unfinished  # a trial had begun
    rest, rows = _drive(_plan(), parallel, rows=rows, unfinished=unfinished)
    assert sorted(rows) == list(range(14))
    assert {p.index: p for p in begun + rest} == {p.index: p for p in whole}
    assert [p.index for p in rest[: len(unfinished)]] == [p.index for p in unfinished]
    assert len(rest) == 14 - (len(begun) - len(unfinished))
    assert {i: (r.values, r.objective) for i, r in rows.items() if r.status == "FINISHED"} == {
        i: (r.values, r.objective) for i, r in whole_rows.items() if r.status == "FINISHED"
    }


def test_a_batch_is_drawn_once_the_one_before_has_its_rows() -> None:
    """With ``parallel = 3`` trials come three at a time, the last batch the remainder."""
    sizes = []
    rows: dict[int, SweepRow] = {}
    for batch in _plan(trials=8).batches(rows, [], 3):
        sizes.append(len(batch))
        rows |= {point.index: _result(point) for point, _ in batch}
    assert sizes == [3, 3, 2]


def test_a_trial_is_found_again_by_its_tags() -> None:
    """A child run's tags give its trial back; a run of another space or a damaged tag gives none."""
    plan = _plan()
    (point, _), *_ = next(plan.batches({}, [], 1))
    tags = {VALUES_TAG: f'{{"index": 0, "values": {[list(v) for v in point.values]}}}'.replace("'", '"')}
    assert plan.point_named(point.name, tags) == point
    assert plan.point_named("trial 1: x", tags) is None
    assert plan.point_named(point.name, {VALUES_TAG: "{"}) is None
    assert plan.point_named(point.name, {}) is None


def test_the_plan_round_trips_and_its_key_is_stable() -> None:
    """Rebuilt from its JSON the plan has the same key and draws the same trials; the URI stays out."""
    plan = _plan()
    again = SearchPlan.from_json(plan.to_json(), "sqlite:///other/mlflow.db")
    assert again.key == plan.key and "sqlite" not in str(plan.to_json())
    assert _drive(again, 1)[0] == _drive(plan, 1)[0]
    assert plan.key != _plan(seed=5).key


@pytest.mark.parametrize(
    ("space", "message"),
    [
        ({"server.kind": {"kind": "categorical", "choices": ["fedavg", "fedbux"]}}, "server: unknown kind 'fedbux'"),
        ({"client.lr": {"kind": "float", "low": -1.0, "high": 0.1}}, "client.lr"),
        ({"client.bogus": {"kind": "int", "low": 1, "high": 2}}, "client.bogus: unknown field"),
    ],
)
def test_a_space_the_config_refuses_is_refused_before_any_run(space: dict[str, Any], message: str) -> None:
    """An end of a range or a choice the config does not take is a ConfigError naming the trial's field."""
    search = SearchConfig.model_validate({"trials": 3, "space": space})
    with pytest.raises(ConfigError, match=r"^trial 0: ") as error:
        SearchPlan({}, search)
    assert message in str(error.value)


def test_a_wrong_objective_is_refused() -> None:
    """An objective no run reports is a ConfigError."""
    with pytest.raises(ConfigError, match="is not a figure a run reports"):
        _plan(objective="server/eval/f1:max")


def test_a_search_without_optuna_is_refused_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where Optuna is not installed, a search is a ConfigError before any run, naming the ``sweep`` extra."""
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "optuna" else found(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'flasync\[sweep\]'"):
        _plan()
