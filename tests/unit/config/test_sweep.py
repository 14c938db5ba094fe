"""The ``[sweep]`` section: what it accepts, its one-line errors, and values written back as ``--set`` texts."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flasync.config import config_data, safe_yaml, validate
from flasync.config.sweep import SweepConfig, parse_objective, sweep_section, value_text
from flasync.core.errors import ConfigError

SPACE = {"client.lr": {"kind": "float", "low": 1e-3, "high": 0.3, "log": True}}


def test_a_full_section_is_read() -> None:
    """Grid, fixed settings, parallelism and objective come back typed; the section leaves the run's tables."""
    data: dict[str, Any] = {
        "seed": 1,
        "sweep": {
            "grid": {"server.kind": ["fedavg", "fedbuff"], "seed": "0..2"},
            "set": {"stop.max_versions": 5},
            "parallel": 2,
            "objective": "server/eval/loss:min",
        },
    }
    section = sweep_section(data)
    assert section == SweepConfig(
        grid={"server.kind": ["fedavg", "fedbuff"], "seed": "0..2"},
        set={"stop.max_versions": 5},
        parallel=2,
        objective="server/eval/loss:min",
    )
    assert data == {"seed": 1}
    assert sweep_section(data) is None


def test_a_search_section_is_read() -> None:
    """A search's sampler, trials, seed and each kind of space."""
    space = SPACE | {
        "client.epochs": {"kind": "int", "low": 1, "high": 4},
        "model.hidden": {"kind": "categorical", "choices": [[32], [64, 64]]},
    }
    section = sweep_section({"sweep": {"search": {"sampler": "random", "trials": 7, "seed": 3, "space": space}}})
    assert section is not None and section.search is not None
    assert (section.search.sampler, section.search.trials, section.search.seed) == ("random", 7, 3)
    assert [p.kind for p in section.search.space.values()] == ["float", "int", "categorical"]


@pytest.mark.parametrize(
    ("sweep", "message"),
    [
        ({"grids": {}}, "sweep.grids: unknown field (did you mean grid?)"),
        ({"parallel": 0}, "sweep.parallel: "),
        ({"objective": "server/eval/acc:max"}, "sweep.objective: 'server/eval/acc' is not a figure a run reports"),
        ({"objective": "accuracy:up"}, "sweep.objective: the direction must be ':max' or ':min'"),
        ({"grid": {"seed": []}}, "sweep.grid.seed: no values"),
        ({"grid": {"a..b": [1]}}, "sweep.grid.a..b: not a dotted field path"),
        ({"set": {"seed ": 1}}, "sweep.set.seed : not a dotted field path"),
        ({"grid": {"seed": [0]}, "search": {"trials": 2, "space": SPACE}}, "sweep.search: a sweep is a grid or a"),
        ({"search": {"trials": 0, "space": SPACE}}, "sweep.search.trials: "),
        ({"search": {"trials": 2, "space": {}}}, "sweep.search.space: "),
        ({"search": {"trials": 2, "sampler": "cmaes", "space": SPACE}}, "sweep.search.sampler: "),
        ({"search": {"trials": 2, "space": {"x": {"kind": "float", "low": 2, "high": 1}}}}, "high 1.0 is below low"),
        (
            {"search": {"trials": 2, "space": {"x": {"kind": "float", "low": 0, "high": 1, "log": True}}}},
            "log = true needs low > 0",
        ),
        (
            {"search": {"trials": 2, "space": {"x": {"kind": "int", "low": 1}}}},
            "space.x.high: required field is missing",
        ),
        (
            {"search": {"trials": 2, "space": {"x": {"kind": "categorical", "choices": ["a", "a"]}}}},
            "'a' is listed twice",
        ),
        ({"search": {"trials": 2, "space": {"x": {"kind": "uniform"}}}}, "sweep.search.space.x: "),
        ("fast", "sweep: must be a table"),
    ],
)
def test_bad_entries_are_one_line_errors_naming_them(sweep: Any, message: str) -> None:
    """Each wrong entry is a ConfigError of one line that names it."""
    with pytest.raises(ConfigError) as error:
        sweep_section({"sweep": sweep})
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_a_run_of_the_same_file_ignores_the_section(tmp_path: Any) -> None:
    """``flasync run`` validates a file with a ``[sweep]`` section as its base config."""
    path = tmp_path / "sweep.toml"
    path.write_text('seed = 3\n[sweep]\ngrid = {seed = "0..1"}\n')
    assert validate(config_data(path)).seed == 3


def test_objectives_name_a_summary_field() -> None:
    """A metric key of the evaluation maps to the summary's field of its final value."""
    assert parse_objective("server/eval/accuracy:max") == ("accuracy", "max")
    assert parse_objective("wall_s:min") == ("wall_s", "min")


@given(
    st.one_of(
        st.booleans(),
        st.integers(-(10**12), 10**12),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=12),
        st.lists(st.integers(0, 512), max_size=3),
    )
)
def test_a_value_text_parses_back_to_the_value(value: Any) -> None:
    """The text a grid or a trial value is written as reads back, as ``--set`` reads it, to the same value."""
    text = value_text(value)
    parsed = safe_yaml(text) if text.strip() else ""
    assert parsed == value and type(parsed) is type(value)
