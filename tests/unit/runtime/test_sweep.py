"""A sweep's grid: its axes as the command line gives them, its points, and each point's validated config."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import pytest

from flasync.config import RunConfig
from flasync.core.errors import ConfigError
from flasync.runtime.sweep import (
    MAX_POINTS,
    PARENT_TAG,
    PointTask,
    Sweep,
    SweepPlan,
    SweepPoint,
    SweepRow,
    parse_axis,
)

if TYPE_CHECKING:
    from flasync.runtime.federation import Federation, RunSummary


def test_a_range_is_inclusive() -> None:
    """``seed=0..4`` is the five seeds 0 to 4."""
    assert parse_axis("seed=0..4").values == ("0", "1", "2", "3", "4")


def test_a_comma_list_keeps_list_values_whole() -> None:
    """Commas inside brackets belong to a list value: ``[64, 64],[32]`` is two values."""
    assert parse_axis("model.hidden=[64, 64],[32]").values == ("[64, 64]", "[32]")
    assert parse_axis("server.kind=fedavg, fedbuff").values == ("fedavg", "fedbuff")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("seed", "expected PATH=VALUES"),
        ("seed=", "expected PATH=VALUES"),
        ("=1,2", "expected PATH=VALUES"),
        ("server..kind=a", "is not a dotted field path"),
        ("seed=4..0", "the range 4..0 is empty"),
        ("seed=0..x", "a range is two integers"),
        ("seed=1,,2", "an empty value"),
        (f"seed=0..{MAX_POINTS}", f"at most {MAX_POINTS} points"),
    ],
)
def test_bad_axes_are_refused(spec: str, message: str) -> None:
    """A malformed option, path, range or value list is a ConfigError naming the option."""
    with pytest.raises(ConfigError, match=r"^--grid ") as error:
        parse_axis(spec)
    assert message in str(error.value)


def test_points_are_the_cartesian_product_in_order() -> None:
    """The last axis varies fastest; each point's name is its overrides joined by commas."""
    plan = SweepPlan({}, [parse_axis("server.kind=fedavg,fedbuff"), parse_axis("seed=0..1")])
    assert [p.name for p in plan.points] == [
        "server.kind=fedavg,seed=0",
        "server.kind=fedavg,seed=1",
        "server.kind=fedbuff,seed=0",
        "server.kind=fedbuff,seed=1",
    ]
    assert [(c.server.kind, c.seed) for c in plan.configs] == [(k, s) for k in ("fedavg", "fedbuff") for s in (0, 1)]
    assert plan.configs[3].tracking.run_name == "server.kind=fedbuff,seed=1"


def test_an_unknown_key_names_the_point() -> None:
    """A grid key the config does not have is refused before anything runs, naming the point and the field."""
    with pytest.raises(ConfigError, match=r"^--grid point server\.bogus=1: server\.bogus: unknown field"):
        SweepPlan({}, [parse_axis("server.bogus=1,2")])


@pytest.mark.parametrize(
    ("axes", "message"),
    [
        ([], "a sweep needs a grid"),
        (["seed=0,1", "seed=2"], "--grid seed is given twice"),
        (["seed=0..99", "stop.max_versions=1..101"], "the grid has 10100 points"),
    ],
)
def test_bad_grids_are_refused(axes: list[str], message: str) -> None:
    """No axis, one field twice, or too many points."""
    with pytest.raises(ConfigError, match=message):
        SweepPlan({}, [parse_axis(a) for a in axes])


def test_a_sweep_must_be_tracked() -> None:
    """Its runs are MLflow child runs: tracking off is refused."""
    with pytest.raises(ConfigError, match=r"tracking\.enabled = false"):
        SweepPlan({"tracking": {"enabled": False}}, [parse_axis("seed=0,1")])


def test_the_plan_round_trips_and_its_key_is_stable() -> None:
    """The plan rebuilt from its JSON has the same points and key; the URI stays out of the JSON."""
    plan = SweepPlan({"stop": {"max_versions": 3}}, [parse_axis("seed=0..2")], "sqlite:///x/mlflow.db")
    again = SweepPlan.from_json(plan.to_json(), "sqlite:///y/mlflow.db")
    assert again.key == plan.key
    assert [p.name for p in again.points] == [p.name for p in plan.points]
    assert "sqlite" not in str(plan.to_json())
    assert again.configs[0].tracking.uri == "sqlite:///y/mlflow.db"


def test_a_row_is_json_ready() -> None:
    """NaN figures of a run that stopped early become None."""
    row = SweepRow(0, "seed=0", {"seed": "0"}, "KILLED", None, error="SIGINT")
    assert row.to_dict()["accuracy"] is None


class _OpeningParent:
    """A sweep's parent run that is still being opened: it counts the reads of its id (each would wait for it)."""

    def __init__(self) -> None:
        self.reads = 0
        self.ended: str | None = None

    @property
    def run_id(self) -> str:
        self.reads += 1
        return "parent"

    def finished_rows(self, plan: SweepPlan) -> dict[int, SweepRow]:
        return {}

    def unfinished_points(self, plan: SweepPlan) -> list[SweepPoint]:
        return []

    def task(self, plan: SweepPlan, point: SweepPoint, config: RunConfig) -> PointTask:
        return PointTask(point, config, {"flasync.sweep.point": point.name})

    def finish(self, plan: SweepPlan, rows: Sequence[SweepRow], status: str) -> None:
        self.ended = status


def test_the_first_run_starts_before_the_parent_run_is_waited_for() -> None:
    """Run by run in this process, a run starts without the parent run's id (its tracker asks for it as the child
    run opens), and the id is read after each run, so a parent that could not be opened ends the sweep."""
    plan = SweepPlan({}, [parse_axis("seed=0..2")])
    parent = _OpeningParent()
    seen: list[tuple[int, bool]] = []

    def runner(build: Callable[[], Federation]) -> RunSummary:
        seen.append((parent.reads, any(PARENT_TAG in tags for tags in started)))
        raise RuntimeError("not run")

    started: list[dict[str, str]] = []
    outcome = Sweep(plan, runner=runner, on_start=lambda task, i, n: started.append(task.tags)).run(parent)
    assert seen == [(0, False), (1, False), (2, False)]
    assert outcome.parent_run_id == "parent" and parent.ended == "FAILED"
    assert [row.status for row in outcome.rows] == ["FAILED"] * 3


def test_a_run_stopped_before_its_federation_knew_its_id_keeps_the_id_in_its_row(
    store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second Ctrl-C can stop a run whose MLflow run exists while its federation has not learnt the id yet: the row
    (the stopped sweep's table, ``--resume``'s hint) takes it from the run's tracker, not ``-``."""
    from flasync.runtime import sweep, tracked
    from flasync.testing import small_config

    made: list[object] = []
    real = tracked.mlflow_tracker

    def tracker(*args: object, **kwargs: object) -> object:
        made.append(real(*args, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    monkeypatch.setattr(tracked, "mlflow_tracker", tracker)
    opened: list[str] = []

    def runner(build: Callable[[], Federation]) -> RunSummary:
        federation = build()
        opened.append(made[-1].start(experiment="sweep-stop"))  # type: ignore[attr-defined]
        assert federation.run_id is None
        raise KeyboardInterrupt

    config = small_config("tracking.enabled=true", f"tracking.uri={store}", "tracking.log_model=false")
    task = PointTask(SweepPoint(0, (("seed", "0"),)), config, {})
    try:
        row = sweep.run_point(task, runner)
    finally:
        made[-1].finish("KILLED")  # type: ignore[attr-defined]
    assert row.status == "KILLED" and opened[0]
    assert row.run_id == opened[0]
