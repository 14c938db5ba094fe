"""``flasync sweep``'s bad input: one line on stderr, exit status 2, and no store touched."""

from __future__ import annotations

from pathlib import Path

import pytest

from flasync.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "a sweep needs a grid: --grid PATH=VALUES"),
        (["--grid", "server.bogus=1,2"], "--grid point server.bogus=1: server.bogus: unknown field"),
        (["--grid", "seed=4..0"], "--grid 'seed=4..0': the range 4..0 is empty"),
        (["--grid", "seed=0..x"], "a range is two integers"),
        (["--grid", "seed"], "expected PATH=VALUES"),
        (["--grid", "seed=0,1", "--grid", "seed=2"], "--grid seed is given twice"),
        (["--grid", "seed=0,1", "--set", "tracking.enabled=false"], "tracking.enabled = false"),
        (["--grid", "seed=0,1", "--parallel", "0"], "--parallel 0: must be at least 1"),
        (["--grid", "server.kind=fedavg,fedbux"], "--grid point server.kind=fedbux: server: unknown kind 'fedbux'"),
        # A mistake of --set is the config's, not a grid point's.
        (["--grid", "seed=0,1", "--set", "stop.max_version=4"], "error: stop.max_version: unknown field (did you"),
        (["--resume", "abc", "--grid", "seed=0,1"], "--resume abc takes the sweep from its parent run"),
        (["--resume", "abc"], "--resume abc: no MLflow run 'abc'"),
    ],
)
def test_bad_sweeps_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], store: str, argv: list[str], message: str
) -> None:
    """A wrong grid, an empty one, a bad range, a bad --parallel or --resume: one line, exit 2."""
    status = main(["sweep", *argv, "--tracking-uri", store])
    err = capsys.readouterr().err
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("flasync: error: ")
    assert message in lines[0]
    if not argv or argv[0] != "--resume":
        assert not Path(store.removeprefix("sqlite:///")).parent.exists()  # refused before the store is made


SEARCH = """
[sweep.search]
trials = 3
space."client.lr" = {kind = "float", low = 0.001, high = 0.3, log = true}
"""


@pytest.mark.parametrize(
    ("text", "argv", "message"),
    [
        ("[sweep]\nparallel = 0\n", [], "sweep.parallel: "),
        ("[sweep]\ngrid = {seed = []}\n", [], "sweep.grid.seed: no values"),
        ("[sweep]\ngrid = {seed = '4..0'}\n", [], "the range 4..0 is empty"),
        ("[sweep]\ngrid = {'server.bogus' = [1]}\n", [], "--grid point server.bogus=1: server.bogus: unknown field"),
        ("[sweep]\nobjective = 'f1:max'\n", ["--grid", "seed=0,1"], "sweep.objective: 'f1' is not a figure"),
        ("[sweep]\nset = {'stop.max_versions' = 0}\n", ["--grid", "seed=0,1"], "stop.max_versions: "),
        ("[sweep]\ngrid = {seed = [0]}\n", ["--trials", "2"], "--trials: the sweep is not a search"),
        (SEARCH, ["--grid", "seed=0,1"], "--grid: the config's [sweep] is a search"),
        (SEARCH, ["--objective", "loss:up"], "objective 'loss:up': the direction must be"),
        (SEARCH, ["--set", "sweep.search.trials=0"], "sweep.search.trials: "),
        (SEARCH, ["--trials", "0"], "--trials 0: must be at least 1"),
        (SEARCH, ["--trials", "10001"], "--trials 10001: a search has at most 10000 trials"),
        (SEARCH.replace("0.001", "-1.0"), [], "sweep.search.space.client.lr.float: log = true needs low > 0"),
        (SEARCH.replace("0.001", "-1.0").replace(", log = true", ""), [], "trial 0: client.lr=-1.0: client.lr: "),
    ],
)
def test_bad_sweep_sections_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], store: str, tmp_path: Path, text: str, argv: list[str], message: str
) -> None:
    """A wrong [sweep] entry, or a flag that does not fit the section: one line, exit 2, no store made."""
    config = tmp_path / "sweep.toml"
    config.write_text(text)
    status = main(["sweep", str(config), *argv, "--tracking-uri", store])
    err = capsys.readouterr().err
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flasync: error: "), err
    assert message in lines[0]
    assert not Path(store.removeprefix("sqlite:///")).parent.exists()
