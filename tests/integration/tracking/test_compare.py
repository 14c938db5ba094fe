"""``flasync compare`` and ``flasync report`` on real runs in a temporary MLflow store, and their pure parts."""

from __future__ import annotations

import asyncio
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import flasync
from flasync import tracking
from flasync.cli import main
from flasync.testing import small_config
from flasync.tracking.compare import EvalPoint, RunRecord, comparison_table, config_differences, time_to_target
from flasync.tracking.report import format_report


@pytest.fixture(scope="module")
def three_runs(tracking_uri: str) -> list[str]:
    """Run three small federations (buffer sizes 2, 3, 4) into the module's store; return their run ids."""
    ids = []
    for size in (2, 3, 4):
        config = small_config(
            f"server.buffer_size={size}",
            "stop.max_versions=4",
            "eval.every_versions=2",
            "tracking.enabled=true",
            f"tracking.uri={tracking_uri}",
            "tracking.experiment=compare-test",
            f"tracking.run_name=buffer-{size}",
            "diagnostics.plots=false",
        )
        tracker = tracking.MlflowTracker(tracking_uri, writer_process=False)
        summary = asyncio.run(flasync.Federation(config, tracker=tracker).run())
        assert summary.run_id is not None
        ids.append(summary.run_id)
    return ids


@pytest.mark.slow
def test_compare_names_all_three_runs(
    three_runs: list[str], tracking_uri: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """By ids: one column per run (an id given twice is one), the buffer size as the config difference, and a
    comparison plot."""
    plot = tmp_path / "compare.svg"
    code = main(["compare", *three_runs, three_runs[0], "--tracking-uri", tracking_uri, "--plot", str(plot)])
    out = capsys.readouterr().out
    assert code == 0
    for run_id, name in zip(three_runs, ("buffer-2", "buffer-3", "buffer-4"), strict=True):
        assert run_id in out and name in out
    row = next(line for line in out.splitlines() if "server.buffer_size" in line)
    assert row.split()[1:] == ["2", "3", "4"]
    assert any(line.startswith("final accuracy") for line in out.splitlines())
    chart = ET.fromstring(plot.read_bytes())
    texts = {t.text for t in chart.iter("{http://www.w3.org/2000/svg}text")}
    assert {"flasync runs compared", "client updates", "simulated seconds", "wall seconds"} <= texts
    assert sum(1 for text in texts if text and text.startswith("buffer-")) == 3  # one legend entry a run


@pytest.mark.slow
def test_compare_by_experiment(three_runs: list[str], tracking_uri: str, capsys: pytest.CaptureFixture[str]) -> None:
    """By experiment: the experiment's runs, oldest first, with time to the given target accuracy."""
    code = main(
        ["compare", "--experiment", "compare-test", "--tracking-uri", tracking_uri, "--target-accuracy", "0.05"]
    )
    out = capsys.readouterr().out
    assert code == 0
    header = out.splitlines()[1]
    assert header.split()[2:] == three_runs
    reached = next(line for line in out.splitlines() if line.startswith("version at acc 0.05"))
    assert reached.split()[-3:] == ["0", "0", "0"]  # the initial model beats a 5% target


@pytest.mark.slow
def test_compare_picks_the_latest_runs_and_those_a_filter_matches(
    three_runs: list[str], tracking_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--last N compares the N latest runs of the experiment (oldest first), --filter those matching an MLflow search
    filter, and both together the latest matching ones."""

    def compared(*flags: str) -> list[str]:
        assert main(["compare", "--experiment", "compare-test", "--tracking-uri", tracking_uri, *flags]) == 0
        return capsys.readouterr().out.splitlines()[1].split()[2:]

    assert compared("--last", "2") == three_runs[1:]
    assert compared("--filter", "params.`server.buffer_size` != '3'") == [three_runs[0], three_runs[2]]
    assert compared("--filter", "params.`server.buffer_size` != '4'", "--last", "1") == [three_runs[1]]


def test_report_prints_the_profile(
    three_runs: list[str], tracking_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """flasync report prints the profile's sections for a run."""
    assert main(["report", three_runs[0], "--tracking-uri", tracking_uri]) == 0
    out = capsys.readouterr().out
    for text in ("run buffer-2", "idle_s", "stragglers", "tier client", "peak RSS", "diagnostics (level basic)"):
        assert text in out, text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["report", "0123456789abcdef"], "no run '0123456789abcdef'"),
        (["compare", "nope-run"], "no run 'nope-run'"),
        (["compare", "--experiment", "no-such-experiment"], "no experiment 'no-such-experiment'"),
        (["compare", "--target-accuracy", "2"], "--target-accuracy must be in (0, 1]"),
        (["compare", "--experiment", "compare-test", "--filter", "params.x =="], "--filter 'params.x ==': "),
        (
            ["compare", "--experiment", "compare-test", "--filter", "tags.aggregator = 'fedprox'"],
            "experiment 'compare-test' has no runs matching \"tags.aggregator = 'fedprox'\"",
        ),
    ],
)
def test_bad_lookups_exit_2_with_one_line(
    three_runs: list[str], tracking_uri: str, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    """Unknown runs and experiments, and bad flags, are one-line errors with exit status 2."""
    assert main([*argv, "--tracking-uri", tracking_uri]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_missing_store_is_not_created(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A store that does not exist is an error, and no database file is made."""
    db = tmp_path / "absent" / "mlflow.db"
    assert main(["report", "abc", "--tracking-uri", f"sqlite:///{db}"]) == 2
    assert "no MLflow store" in capsys.readouterr().err
    assert not db.exists()


def _record(name: str, accuracies: list[float], params: dict[str, str]) -> RunRecord:
    history = [EvalPoint(i, a, 10.0 * i, 1.0 * i) for i, a in enumerate(accuracies)]
    return RunRecord(
        run_id=f"id-{name}",
        name=name,
        status="FINISHED",
        params=params,
        metrics={"run/finished/accuracy": accuracies[-1], "run/finished/upload_bytes": 2000.0},
        history=history,
    )


def test_time_to_target_and_differences() -> None:
    """Time to target is the first evaluation at or above it; only differing params are listed."""
    a = _record("a", [0.1, 0.5, 0.9], {"seed": "0", "server.buffer_size": "2"})
    b = _record("b", [0.1, 0.3, 0.6], {"seed": "0", "server.buffer_size": "4"})
    assert time_to_target(a.history, 0.5) == EvalPoint(1, 0.5, 10.0, 1.0)
    assert time_to_target(b.history, 0.9) is None
    assert config_differences([a, b]) == {"server.buffer_size": ["2", "4"]}
    table = comparison_table([a, b])  # default target: the lowest final accuracy, 0.6
    lines = {line.split("  ")[0].strip(): line for line in table.splitlines()}
    assert lines["sim s to acc 0.6"].split()[-2:] == ["20", "20"]
    assert "2.0 kB" in lines["bytes up"]


def test_format_report_without_profile() -> None:
    """A run without profile.json still reports its headline and says why the rest is missing."""
    text = format_report("abc", "run-x", {"run/finished/accuracy": 0.5}, None)
    assert "run run-x (abc)" in text and "0.5" in text and "or ran with diagnostics.profile off" in text


def test_histories_carry_client_updates_for_a_fair_axis(three_runs: list[str], tracking_uri: str) -> None:
    """Each evaluation knows how many client updates it came after: a buffer of 4 makes a version from twice the
    updates of a buffer of 2, so runs compare on updates (and simulated time), not on versions."""
    from flasync.tracking.compare import fetch_runs
    from flasync.tracking.report import open_store

    records = fetch_runs(open_store(tracking_uri), three_runs)
    for record, size in zip(records, (2, 3, 4), strict=True):
        assert [p.version for p in record.history] == [0, 2, 4]
        assert [p.updates for p in record.history] == [0.0, 2.0 * size, 4.0 * size]


@pytest.mark.slow
def test_a_reader_that_goes_away_ends_the_command_quietly(three_runs: list[str], tracking_uri: str) -> None:
    """`flasync compare ... | head` whose reader closed the pipe: exit 141 (as SIGPIPE would), no traceback."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "flasync", "compare", *three_runs, "--tracking-uri", tracking_uri]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # before the command writes anything
    _, err = process.communicate(timeout=120)
    assert process.returncode == 141, err.decode()
    assert b"Traceback" not in err and b"BrokenPipeError" not in err


def test_final_figures_come_from_tags_or_older_runs_metrics() -> None:
    """A run's final figures read from its finished.* tags; a run that logged run/finished/* metrics keeps them."""
    from flasync.tracking.report import final_figures

    tagged = final_figures({"server/eval/accuracy": 0.5}, {"finished.accuracy": "0.875", "finished.versions": "30"})
    assert tagged == {"server/eval/accuracy": 0.5, "run/finished/accuracy": 0.875, "run/finished/versions": 30.0}
    older = {"run/finished/accuracy": 0.75}
    assert final_figures(older, {"mode": "async", "finished.note": "not a number"}) == older
