"""A run whose store and spool sit on a full disk: one line says what was lost and where, the run is FAILED."""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest
from mlflow.entities import Metric

from flasync.cli import main
from flasync.tracking.spool import iter_records, read_header

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2.4 MB tmpfs: room for the store's schema and the run's start, not for its metrics and artifacts."""
    folder = tmp_path / "full"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2400k", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip() or mounted.returncode}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_full_disk_loses_records_in_one_line_and_fails_the_run(
    full_disk: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store and then the spool fill their disk mid-run (before: the run stayed FINISHED, the replay hint pointed
    at a spool of a header alone): the training ends, one warning names the spool's path and what was lost and
    kept, a replay hint only for a spool holding records, no traceback is printed, and the run is FAILED: its status
    takes the room held for it."""
    monkeypatch.chdir(full_disk)
    uri = f"sqlite:///{full_disk}/mlruns/mlflow.db"
    assert main(["run", "--set", "stop.max_versions=300", "--tracking-uri", uri]) == 0
    captured = capsys.readouterr()
    said = captured.out + captured.err
    lost = [line for line in said.splitlines() if "tracking.records_lost" in line]
    assert len(lost) == 1 and str(full_disk / "mlruns" / "spool") in lost[0] and "lost" in lost[0], lost
    assert "Traceback" not in said
    # The replay hint names the run's journal (its records from before the store failed), never a spool of a header.
    hints = re.findall(r"flasync tracking replay (\S+\.jsonl)", said)
    for hint in hints:
        _, first = read_header(hint)
        assert next(iter_records(hint, first), None) is not None, hint
    assert "tracking.recovered" not in said  # a spool that could not be written recovers nothing
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs(["1"])
    # The end status is one row more in a store whose disk is full: it takes the room held for it since the run
    # opened (without it, the run stayed RUNNING in some runs).
    assert run.info.status == "FAILED" and "a run that finished is marked FAILED" in lost[0], lost
    assert "lost_status" not in lost[0], lost
    assert not list((full_disk / "mlruns").glob(".flasync-status-room-*"))


def _fill(folder: Path) -> None:
    """Take every byte the disk of ``folder`` has left."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):
            while os.write(fd, b"\0" * 4096):
                pass
        with contextlib.suppress(OSError):
            while os.write(fd, b"\0"):
                pass
    finally:
        os.close(fd)


@pytest.mark.parametrize("room", [True, False], ids=["room held", "no room"])
def test_a_disk_filled_just_before_the_end_status_still_takes_it_from_the_room_held(
    full_disk: Path, room: bool, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that has not one byte left when the run ends: the room held since the run opened takes the end
    status, and the run is FINISHED (nothing was lost). Without it the status is lost, the run stays RUNNING, and
    the warning says so with the command that ends it."""
    from flasync.tracking import MlflowTracker
    from flasync.tracking._room import StatusRoom

    monkeypatch.chdir(full_disk)  # the spool's folder too
    uri = f"sqlite:///{full_disk}/mlruns/mlflow.db"
    give_back = StatusRoom.give_back

    def filled_first(self: StatusRoom) -> bool:
        # The store's write-ahead log emptied (as a checkpoint leaves it), then not one byte left: the status needs
        # the log to grow.
        with contextlib.closing(sqlite3.connect(full_disk / "mlruns" / "mlflow.db")) as db:
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        _fill(full_disk)
        return give_back(self)

    monkeypatch.setattr(StatusRoom, "give_back", filled_first)
    if not room:
        monkeypatch.setattr(StatusRoom, "hold", lambda self: False)
    tracker = MlflowTracker(uri, flush_interval_s=0.05)
    run_id = tracker.start(experiment="full")
    tracker.log_metrics([Metric("loss", 1.0 / step, 0, step) for step in range(1, 50)])
    tracker.finish("FINISHED")
    said = capsys.readouterr()
    (full_disk / "filler").unlink()
    status = mlflow.MlflowClient(uri).get_run(run_id).info.status
    assert not list((full_disk / "mlruns").glob(".flasync-status-room-*"))  # given back, whatever the end
    if room:
        assert status == "FINISHED", said
    else:
        assert status == "RUNNING"
        assert f"flasync tracking mark-failed {run_id}" in said.out + said.err
