"""The journal of a run being opened: what it keeps, when it goes, and how ``--resume`` finds a killed run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest
from mlflow.entities import Metric

from flasync.cli import main
from flasync.core.owner import owner_tags
from flasync.tracking import MlflowTracker
from flasync.tracking._child import close_idle_writer
from flasync.tracking.journal import JOURNAL_TAG, RunJournal, left_behind, recover
from flasync.tracking.spool import iter_records, read_header
from flasync.tracking.store import ensure_experiment, prepare_sqlite_store


@pytest.fixture(autouse=True, scope="module")
def _idle_writer_stopped_after_the_module() -> Iterator[None]:
    yield
    close_idle_writer()


def _journal(root: Path, uri: str, tags: dict[str, str] | None = None) -> RunJournal:
    return RunJournal(
        root,
        tracking_uri=uri,
        experiment="journaled",
        run_name="j1",
        start_time=1_700_000_000_000,
        tags=tags if tags is not None else {"mode": "async"},
        params={"lr": "0.1"},
    )


def _records(journal: RunJournal) -> list[dict[str, object]]:
    _, first = read_header(journal.path)
    return [record for record, _ in iter_records(journal.path, first)]


def _dead_owner() -> dict[str, str]:
    """Owner tags of a process that has ended."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return {**owner_tags(), "flasync.owner.pid": gone.stdout.strip()}


def test_a_journal_keeps_the_opening_the_metrics_and_one_file_per_checkpoint(tmp_path: Path) -> None:
    """Tags (with the journal's id) and params at once; metric rows as logged; a checkpoint written twice is one
    file holding the newer bytes and one record; retiring removes it all, keep() leaves it."""
    journal = _journal(tmp_path, "sqlite:///x.db")
    journal.metrics([Metric("loss", 0.5, 1, 0)])
    assert journal.artifact(b"first", "checkpoints/a.pt") and journal.artifact(b"second", "checkpoints/a.pt")
    records = _records(journal)
    assert [r["type"] for r in records] == ["tags", "params", "metrics", "artifact"]
    assert records[0]["tags"] == {"mode": "async", JOURNAL_TAG: journal.id}
    assert journal.kept()["checkpoints/a.pt"].read_bytes() == b"second"
    journal.retire()
    assert not journal.path.exists() and not journal.path.with_suffix(".artifacts").exists()
    assert not journal.artifact(b"third", "checkpoints/a.pt")

    kept = _journal(tmp_path, "sqlite:///x.db")
    kept.keep()
    kept.retire()
    assert kept.path.exists() and not kept.live


@pytest.mark.slow
def test_a_background_opening_journals_what_comes_before_it_and_removes_the_journal_at_the_end(
    tmp_path: Path, tracking_uri: str
) -> None:
    """start(wait=False) names the run by its journal at once; the MLflow run carries the journal's id as a tag
    and gets every row; the journal and its emptied folder are gone once the run ended."""
    tracker = MlflowTracker(tracking_uri, flush_interval_s=0.05, spool_root=tmp_path / "spool")
    tracker.start(experiment="journal", params={"lr": 0.1}, wait=False)
    journal_id = tracker.journal.id
    assert journal_id is not None and (tmp_path / "spool" / f"{journal_id}.jsonl").is_file()
    tracker.log_metrics([Metric("m", float(i), 0, i) for i in range(50)])
    run_id = tracker.opened(timeout=120)
    tracker.finish("FINISHED")
    client = mlflow.MlflowClient(tracking_uri)
    assert client.get_run(run_id).data.tags[JOURNAL_TAG] == journal_id
    assert sorted(m.step for m in client.get_metric_history(run_id, "m")) == list(range(50))
    assert not (tmp_path / "spool").exists()  # nor its folder, left empty


def test_resume_replays_a_killed_runs_journal_into_a_new_run_then_finds_it_by_the_journal_id(
    tmp_path: Path, tracking_uri: str
) -> None:
    """A journal whose MLflow run never opened is replayed into a new run (with its metrics and checkpoint) and
    removed; the same id then finds that run through its tag; an MLflow run id is returned as it is."""
    journal = _journal(tmp_path, tracking_uri)
    journal.metrics([Metric("loss", 0.5, 1_700_000_000_001, 3)])
    journal.artifact(b"state", "checkpoints/b.pt")
    found = recover(journal.id, tracking_uri, tmp_path)
    assert found.journal == journal.path and found.replayed is not None and found.replayed.metrics == 1
    client = mlflow.MlflowClient(tracking_uri)
    run = client.get_run(found.run_id)
    assert run.data.params == {"lr": "0.1"} and run.data.tags[JOURNAL_TAG] == journal.id
    assert [a.path for a in client.list_artifacts(found.run_id, "checkpoints")] == ["checkpoints/b.pt"]
    assert not journal.path.exists()
    assert recover(journal.id, tracking_uri, tmp_path).run_id == found.run_id
    assert recover(found.run_id, tracking_uri, tmp_path).run_id == found.run_id


def test_resume_by_an_mlflow_run_id_replays_the_journal_its_process_left(tmp_path: Path, tracking_uri: str) -> None:
    """A process killed after its MLflow run opened, before a checkpoint reached it: the run's id leads to the
    journal (its tag), whose checkpoint is replayed into that same run."""
    journal = _journal(tmp_path, tracking_uri)
    client = mlflow.MlflowClient(tracking_uri)
    experiment = ensure_experiment(client, "journaled", (tmp_path / "artifacts").as_uri())  # not ./mlruns
    run_id = client.create_run(experiment, tags={JOURNAL_TAG: journal.id}).info.run_id
    journal.opened(run_id, tracking_uri)
    journal.artifact(b"state", "checkpoints/a.pt")
    found = recover(run_id, tracking_uri, tmp_path)
    assert found.run_id == run_id and found.journal == journal.path
    assert [a.path for a in client.list_artifacts(run_id, "checkpoints")] == ["checkpoints/a.pt"]


def test_journals_of_dead_processes_are_named_at_the_next_start(tmp_path: Path) -> None:
    """left_behind() lists a journal whose owner process is gone, not one of a live process."""
    dead = _journal(tmp_path, "sqlite:///x.db", tags=_dead_owner())
    _journal(tmp_path, "sqlite:///x.db", tags=owner_tags())
    assert left_behind(tmp_path) == [dead.path]


def test_resuming_a_run_killed_before_its_first_checkpoint_keeps_its_metrics_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """exit 2 and one line: nothing to resume from, what it logged is in an MLflow run now KILLED."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    prepare_sqlite_store(uri)
    journal = _journal(tmp_path / "mlruns" / "spool", uri, tags=_dead_owner())
    journal.metrics([Metric("server/eval/accuracy", 0.5, 1_700_000_000_001, 0)])
    journal.spool.close()
    assert main(["run", "--resume", journal.id, "--tracking-uri", uri]) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("flasync: error")]
    assert len(said) == 1 and f"run {journal.id} was killed before its first checkpoint" in said[0], said
    run_id = said[0].split("is in MLflow run ")[1].split(",")[0]
    client = mlflow.MlflowClient(uri)
    assert client.get_run(run_id).info.status == "KILLED"
    assert [m.value for m in client.get_metric_history(run_id, "server/eval/accuracy")] == [0.5]


def test_the_journal_file_is_private(tmp_path: Path) -> None:
    """Readable by its owner only, as every spool (it holds the run's params and checkpoints)."""
    journal = _journal(tmp_path, "sqlite:///x.db")
    assert os.stat(journal.path).st_mode & 0o077 == 0
    assert json.loads(journal.path.read_text().splitlines()[0])["run_id"] is None


def test_a_runs_journal_id_names_it_for_report_and_compare(tmp_path: Path, tracking_uri: str) -> None:
    """The id a run prints first (``run.started run=ID``, its journal's) finds its MLflow run wherever a run id is
    asked for (``flasync report``, ``flasync compare``) through the run's journal tag; an id that is neither is one
    lookup error."""
    from flasync.tracking.report import RunLookupError, get_run

    client = mlflow.MlflowClient(tracking_uri)
    experiment = ensure_experiment(client, "journaled", (tmp_path / "artifacts").as_uri())  # not ./mlruns
    journal_id = "0123456789abcdef0123456789abcdef"
    run_id = client.create_run(experiment, tags={JOURNAL_TAG: journal_id}).info.run_id
    assert get_run(client, run_id).info.run_id == run_id
    assert get_run(client, journal_id).info.run_id == run_id
    for unknown in ("fedcba9876543210fedcba9876543210", "not-a-run-id"):
        with pytest.raises(RunLookupError, match=f"no run '{unknown}'"):
            get_run(client, unknown)
