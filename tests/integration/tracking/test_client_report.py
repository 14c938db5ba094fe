"""``flasync report --clients`` on a real run in a temporary SQLite MLflow store: the table MLflow logged, read back."""

from __future__ import annotations

import asyncio
import json

import mlflow
import pytest

import flasync
from flasync import tracking
from flasync.cli import main
from flasync.core.client_table import HISTOGRAMS_ARTIFACT, TABLE_ARTIFACT
from flasync.runtime.artifacts import HISTOGRAMS_PLOT
from flasync.testing import small_config
from flasync.tracking.report import format_client_table, load_client_views, open_store

FAULTY = ("faults.crash=0.2", "resilience.task_timeout_s=3", "server.max_staleness=1")


def _run(tracking_uri: str, *overrides: str) -> flasync.RunSummary:
    config = small_config(
        "stop.max_versions=6",
        "tracking.enabled=true",
        f"tracking.uri={tracking_uri}",
        "tracking.experiment=clients-test",
        "tracking.log_model=false",
        "diagnostics.plots=false",
        *FAULTY,
        *overrides,
    )
    tracker = tracking.MlflowTracker(tracking_uri, writer_process=False)
    summary = asyncio.run(flasync.Federation(config, tracker=tracker).run())
    assert summary.run_id is not None
    return summary


@pytest.fixture(scope="module")
def runs(tracking_uri: str) -> tuple[flasync.RunSummary, flasync.RunSummary]:
    """Run one federation with the per-client table (3 rows at each end of 20 clients) and one without."""
    with_table = _run(
        tracking_uri, "tracking.client_table=true", "tracking.client_table_top=3", "tracking.client_table_rank=refused"
    )
    return with_table, _run(tracking_uri)


@pytest.mark.slow
def test_the_table_is_an_mlflow_table_artifact(
    runs: tuple[flasync.RunSummary, flasync.RunSummary], tracking_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's table is in MLflow's table format and tagged for the UI's artifact view (``mlflow.load_table``
    reads it back); the histograms beside it."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)  # load_table searches runs through the fluent API
    summary, _ = runs
    client = mlflow.MlflowClient(tracking_uri)
    run_id = summary.run_id
    assert run_id is not None
    run = client.get_run(run_id)
    logged = json.loads(run.data.tags["mlflow.loggedArtifacts"])
    assert {"path": TABLE_ARTIFACT, "type": "table"} in logged
    frame = mlflow.MlflowClient(tracking_uri).load_table(run.info.experiment_id, TABLE_ARTIFACT, run_ids=[run_id])
    assert len(frame) == 6 and list(frame["group"]) == ["top"] * 3 + ["bottom"] * 3
    refused = list(frame["refused"])
    assert refused == sorted(refused, reverse=True) and refused[0] > 0
    views = load_client_views(open_store(tracking_uri), run_id)
    assert views is not None
    table, histograms = views
    assert table["columns"][:3] == ["group", "client_id", "tasks"]
    assert sum(histograms["refusals"].values()) == summary.updates_dropped
    assert histograms["clients_seen"] == histograms["rows"] > 6 and not histograms["sampled"]
    assert histograms["rank"] == "refused"
    listed = [a.path for a in client.list_artifacts(run_id, "clients")]
    assert listed == [HISTOGRAMS_ARTIFACT, HISTOGRAMS_PLOT, TABLE_ARTIFACT]


@pytest.mark.slow
def test_report_clients_prints_the_table(
    runs: tuple[flasync.RunSummary, flasync.RunSummary], tracking_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``flasync report --clients RUN`` prints the highest and lowest rows, the spreads and the refusals."""
    summary, _ = runs
    assert summary.run_id is not None
    assert main(["report", "--clients", summary.run_id, "--tracking-uri", tracking_uri]) == 0
    out = capsys.readouterr().out
    views = load_client_views(open_store(tracking_uri), summary.run_id)
    assert views is not None
    table, histograms = views
    kept = histograms["rows"]
    assert f"{kept} rows kept of {kept} clients seen; ranked by refused" in out
    lines = out.splitlines()
    top = lines.index("highest:")
    header = lines[top + 1].split()
    assert header[:4] == ["client_id", "tasks", "accepted", "refused"]
    first = lines[top + 2].split()
    assert int(first[0]) == table["data"][0][1] and int(first[3]) == table["data"][0][4]
    assert "lowest:" in lines and f"stale x{summary.updates_dropped}" in out
    assert "staleness_mean" in out and "per client (over the rows kept)" in out


@pytest.mark.slow
def test_report_clients_of_a_run_without_the_table_exits_2(
    runs: tuple[flasync.RunSummary, flasync.RunSummary], tracking_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run made without ``tracking.client_table`` is a one-line error, exit 2."""
    _, plain = runs
    assert plain.run_id is not None
    assert main(["report", "--clients", plain.run_id, "--tracking-uri", tracking_uri]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no per-client table" in err and len(err.splitlines()) == 1


def test_format_client_table_without_histograms() -> None:
    """A table whose histograms are missing still prints its rows."""
    table = {"columns": ["group", "client_id", "tasks", "upload_bytes"], "data": [["all", 7, 3, 2048]]}
    text = format_client_table("abc", "run-x", table, {})
    assert "every row, highest first:" in text and "2.0 kB" in text
