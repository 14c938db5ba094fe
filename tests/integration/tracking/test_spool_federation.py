"""Tracking never takes a run down: a federation tracked to an unreachable server completes with the same weights,
its records wait in a spool, and the spool replayed into a real store has every metric, param, tag and artifact."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import mlflow
import pytest
import yaml

import flasync.runtime.federation
from flasync import cli
from flasync.config import flatten
from flasync.testing import MemoryTracker, small_config
from flasync.tracking import MlflowTracker
from flasync.tracking.spool import iter_records, read_header
from tests.conftest import free_port


def _dead_server() -> str:
    """Return the URL of a local port where nothing listens."""
    return f"http://127.0.0.1:{free_port()}"


def _spooled_metrics(spool: Path) -> Counter[tuple[str, int, float, int]]:
    _, first = read_header(spool)
    rows = [row for record, _ in iter_records(spool, first) if record["type"] == "metrics" for row in record["metrics"]]
    return Counter((key, step, value, timestamp) for key, value, timestamp, step in rows)


@pytest.mark.slow
def test_run_against_an_unreachable_server_completes_and_its_spool_replays_completely(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same weights as untracked and in-memory-tracked runs; every spooled metric (and step) lands in the store."""
    config = small_config("tracking.enabled=true", "tracking.log_model=true")
    untracked = flasync.runtime.federation.run(small_config())
    memory = MemoryTracker()
    tracked = flasync.runtime.federation.run(config, tracker=memory)

    spool = tmp_path / "spool" / "run.jsonl"
    tracker = MlflowTracker(_dead_server(), spool_path=spool)
    summary = flasync.runtime.federation.run(config, tracker=tracker)

    assert summary.weights_sha256 == untracked.weights_sha256 == tracked.weights_sha256
    assert summary.run_id is None
    assert spool.exists()
    said = capsys.readouterr()
    assert f"flasync tracking replay {spool}" in said.out + said.err  # the tracker's warning names the command
    spooled = _spooled_metrics(spool)
    # Nothing was lost on the way to the spool: the same metrics (keys and steps) as the in-memory tracker got.
    assert Counter((k, s) for k, s, _, _ in spooled.elements()) == Counter((m.key, m.step) for m in memory.metrics)

    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    assert cli.main(["tracking", "replay", str(spool), "--tracking-uri", uri]) == 0
    assert "status FINISHED" in capsys.readouterr().out

    client = mlflow.MlflowClient(uri)
    (experiment,) = [e for e in client.search_experiments() if e.name == config.tracking.experiment]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    stored: Counter[tuple[str, int, float, int]] = Counter()
    for key in {k for k, _, _, _ in spooled}:
        stored.update((key, m.step, m.value, m.timestamp) for m in client.get_metric_history(run.info.run_id, key))
    assert stored == spooled
    assert run.data.params == {k: str(v) for k, v in flatten(config).items()}
    assert run.data.tags["aggregator"] == "fedbuff"
    assert run.data.tags["mode"] == "async"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"summary.json", "config.yaml", "weights.pt", "model"} <= artifacts
    local = Path(client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path)))
    assert yaml.safe_load(local.read_text())["weights_sha256"] == summary.weights_sha256


@pytest.mark.slow
def test_cli_run_against_an_unreachable_server_prints_the_spool_and_the_replay_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`flasync run` exits 0, prints where the records went and how to send them; the spool is under mlruns/."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = small_config().model_dump(mode="json")
    config["tracking"].update(enabled=True, log_model=False)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["run", "run.yaml", "--tracking-uri", _dead_server(), "--no-system-metrics"]) == 0
    out, err = capsys.readouterr()
    (spool,) = (tmp_path / "mlruns" / "spool").glob("*.jsonl")
    assert f"tracking records go to {spool}" in err
    assert f"flasync tracking replay {spool}" in out
    assert "flasync run finished" in out
