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
