"""The local journal of a run whose MLflow run is not open yet: durable from the run's first record.

Opening an MLflow run takes seconds (the writer process imports MLflow and creates the run while training starts),
and what a run logs meanwhile would live only in memory: a ``kill -9`` (or an out-of-memory kill) then left a
``RUNNING`` run with no metric and no checkpoint, or no run at all. A :class:`RunJournal` is a spool file
(:mod:`flasync.tracking.spool`'s format) written from the run's start: its tags and params at once, the metrics
logged before the run opens as they are logged, and the checkpoints taken meanwhile; each record reaches the
operating system as it is written, so a killed process loses none of them.

Its id (:attr:`RunJournal.id`, 32 hex digits, the file's stem under the spool folder) names the run before MLflow has:
it is printed in the run's first lines and tagged on the MLflow run (:data:`JOURNAL_TAG`), and
``python -m flasync run --resume ID`` takes it. Its life:

* the run opens: the MLflow run's id is saved as the journal's replay target (its progress file), so a replay
  continues that run rather than creating another;
* a first checkpoint reaches the store after the run opened (everything the journal holds is in the run by then:
  metrics are flushed before a checkpoint is written): the journal is *retired*, its files removed;
* the store fails while the journal is live: the run's failover takes the journal as its spool (see
  :meth:`flasync.tracking.failover.Failover.go_offline`), and it is kept, as every spool is, until it is replayed;
* the process is killed before retiring it: ``--resume ID`` (or ``flasync tracking replay PATH``) replays it,
  creating the MLflow run if it never opened, and the run continues from the newest checkpoint it holds.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import shutil
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flasync.core.owner import owner_alive
from flasync.tracking.metrics import MetricRow
from flasync.tracking.spool import (
    ReplayResult,
    SpoolError,
    SpoolWriter,
    iter_records,
    load_progress,
    read_header,
    replay,
    save_progress,
)
from flasync.tracking.store import bounded_http, sqlite_path

__all__ = [
    "JOURNAL_ID",
    "JOURNAL_TAG",
    "SPOOL_ROOT",
    "Recovered",
    "RunJournal",
    "find_journal",
    "journal_path",
    "left_behind",
    "recover",
    "remove_journal",
    "run_of_journal",
]

JOURNAL_TAG = "flasync.journal"
"""The MLflow tag holding a run's journal id (how ``--resume JOURNAL_ID`` finds a run whose journal was retired)."""

JOURNAL_ID = re.compile(r"[0-9a-f]{32}")
"""What a journal id looks like (and an MLflow run id too)."""

SPOOL_ROOT = Path("mlruns/spool")
"""Where a tracker keeps its journals and spools, relative to the current directory (``MlflowTracker``'s
``spool_root`` by default)."""


def journal_path(root: Path, journal_id: str) -> Path:
    """Return the journal file of ``journal_id`` under the spool folder ``root``."""
    return root / f"{journal_id}.jsonl"


def find_journal(root: Path, journal_id: str) -> Path | None:
    """Return the journal file of ``journal_id`` under ``root`` if there is one (None for an id of another form)."""
    if not JOURNAL_ID.fullmatch(journal_id):
        return None
    path = journal_path(root, journal_id)
    return path if path.is_file() else None


def left_behind(root: Path | None = None) -> list[Path]:
    """Return the journals under ``root`` (:data:`SPOOL_ROOT` when None) that a killed process left with records not
    replayed anywhere yet, newest first: each names a run ``--resume`` can continue (or ``replay`` can keep)."""
    folder = (root or SPOOL_ROOT).absolute()
    try:
        files = [p for p in folder.iterdir() if p.suffix == ".jsonl" and JOURNAL_ID.fullmatch(p.stem)]
    except OSError:
        return []
    left = []
    for path in files:
        with contextlib.suppress(OSError, SpoolError):
            size = path.stat().st_size
            if any(isinstance(t.get("offset"), int) and t["offset"] >= size for t in load_progress(path).values()):
                continue  # replayed whole already
            _, first = read_header(path)
            opening = next(itertools.islice(iter_records(path, first), 1), None)
            tags = opening[0].get("tags") if opening is not None else None
            if isinstance(tags, dict) and owner_alive(tags) is False:
                left.append(path)
    return sorted(left, key=lambda p: p.stat().st_mtime, reverse=True)


def remove_journal(path: Path) -> None:
    """Remove a journal's file, its artifacts folder and its replay progress; what is already gone is skipped."""
    for file in (path, path.with_name(path.name + ".progress.json")):
        with contextlib.suppress(FileNotFoundError):
            file.unlink()
    shutil.rmtree(path.with_suffix(".artifacts"), ignore_errors=True)


class RunJournal:
    """The journal of one run being opened (see the module's docstring); thread-safe.

    Args:
        root: The spool folder the journal goes in.
        tracking_uri: The store the run is meant for.
        experiment: The experiment's name.
        run_name: The run's name, if any.
        start_time: The run's start, in ms since the epoch.
        tags: The run's tags (written at once).
        params: The run's params (written at once).
        on_failure: Told once, with the path and the reason, when the journal cannot be written (a full disk);
            it takes no record after that and counts them as lost (see :attr:`SpoolWriter.lost`).
        journal_id: The id; a new random one when None.
        path: The journal's file; ``<root>/<id>.jsonl`` when None (a tracker given its own spool file journals there).
    """

    def __init__(
        self,
        root: Path,
        *,
        tracking_uri: str,
        experiment: str,
        run_name: str | None,
        start_time: int,
        tags: Mapping[str, str],
        params: Mapping[str, str],
        on_failure: Callable[[Path, str], None] | None = None,
        journal_id: str | None = None,
        path: Path | None = None,
    ) -> None:
        self.id = journal_id or uuid.uuid4().hex
        self.path = path or journal_path(root, self.id)
        self._lock = threading.Lock()
        self.spool = SpoolWriter(
            self.path,
            tracking_uri=tracking_uri,
            experiment=experiment,
            run_name=run_name,
            run_id=None,
            start_time=start_time,
            on_failure=on_failure,
        )
        self.first = self.spool.size
        """Where the records start (just past the header)."""
        self.spool.tags({**tags, JOURNAL_TAG: self.id})
        self.spool.params(params)
        self._live = True
        self._kept = False
        self.adopted = False
        """The run's failover took the journal as its spool: it is kept (and replayed) as a spool."""

    @property
    def live(self) -> bool:
        """Whether the journal still takes records (it was neither retired nor taken as the spool)."""
        return self._live

    def metrics(self, rows: list[MetricRow]) -> bool:
        """Append metric rows logged before the run opened; False when the journal no longer takes records."""
        with self._lock:
            if not self._live:
                return False
            self.spool.metrics(rows)
            return True

    def artifact(self, data: bytes, artifact_file: str) -> bool:
        """Append an artifact (a checkpoint); False when the journal no longer takes records or could not keep it."""
        with self._lock:
            if not self._live:
                return False
            # One file per artifact, replaced by each newer checkpoint: the journal grows by none.
            return self.spool.artifact_latest(data, artifact_file)

    def kept(self) -> dict[str, Path]:
        """Return the artifacts kept (the newest version of each) by their path inside the run."""
        with self._lock:
            names = sorted(self.spool.latest) if self._live else []
        return {name: self.spool.artifacts_dir / "latest" / name for name in names}

    def opened(self, run_id: str, tracking_uri: str) -> None:
        """Make the run now open in ``tracking_uri`` the journal's replay target (nothing of it known written)."""
        with self._lock:
            if self._live:
                with contextlib.suppress(OSError):  # then a replay creates a run of its own: nothing is lost
                    save_progress(self.path, tracking_uri, run_id=run_id, records=0, offset=self.first)

    def retire(self) -> None:
        """Stop taking records and remove the journal, and its folder when nothing else is left in it: the run in the
        store holds all of it; idempotent (and a no-op after :meth:`keep`)."""
        with self._lock:
            if not self._live:
                return
            self._live = False
            self.spool.close()
            if self._kept:
                return
        remove_journal(self.path)
        with contextlib.suppress(OSError):  # the spool folder, once no journal nor spool is left in it
            self.path.parent.rmdir()

    def keep(self) -> None:
        """Keep the journal when the run ends (what it holds did not all reach the store): a replay sends it."""
        with self._lock:
            self._kept = True

    def adopt(self) -> SpoolWriter:
        """Hand the journal over as the run's spool (its records go on being appended by the failover)."""
        with self._lock:
            self._live = False
            self.adopted = True
            return self.spool

    def summary(self) -> dict[str, Any]:
        """Return the journal's id and path, for a log line."""
        return {"journal": self.id, "journal_path": str(self.path)}


@dataclass(frozen=True, slots=True)
class Recovered:
    """The MLflow run a ``--resume ID`` names, and the replay of its journal when one was left."""

    run_id: str
    journal: Path | None = None
    """The journal replayed (and then removed), if any."""
    replayed: ReplayResult | None = None


def recover(resume_id: str, tracking_uri: str, root: Path | None = None) -> Recovered:
    """Return the MLflow run ``resume_id`` names, after replaying the run's journal into ``tracking_uri`` if a killed
    process left one (creating the MLflow run when it never opened); the replayed journal is removed.

    ``resume_id`` is a journal id (printed in a run's first lines) or an MLflow run id. The journal is found by its
    id under ``root`` (:data:`SPOOL_ROOT` when None), or by the :data:`JOURNAL_TAG` of the MLflow run; a journal
    already retired is found through the run that carries its id as that tag. An id that names nothing is returned
    as it is (the caller's lookup of the MLflow run then says so).

    Raises:
        SpoolError: The journal cannot be read.
        mlflow.exceptions.MlflowException: The store failed during the replay (its progress is kept).
    """
    folder = (root or SPOOL_ROOT).absolute()
    path = find_journal(folder, resume_id)
    run_id = resume_id
    db = sqlite_path(tracking_uri)
    if path is None and (db is None or db.is_file()) and JOURNAL_ID.fullmatch(resume_id):
        import mlflow

        with bounded_http(tracking_uri):
            client = mlflow.MlflowClient(tracking_uri=tracking_uri)
            tags = _run_tags(client, resume_id)
            if tags is not None:
                path = find_journal(folder, tags.get(JOURNAL_TAG, ""))
            else:
                run_id = run_of_journal(client, resume_id) or resume_id
    if path is None:
        return Recovered(run_id)
    result = replay(path, tracking_uri)
    assert result.run_id is not None
    remove_journal(path)
    return Recovered(result.run_id, path, result)


def _run_tags(client: Any, run_id: str) -> dict[str, str] | None:
    """Return the tags of MLflow run ``run_id``, or None when the store has no such run."""
    from mlflow.exceptions import MlflowException

    try:
        return dict(client.get_run(run_id).data.tags)
    except MlflowException:
        return None


def run_of_journal(client: Any, journal_id: str) -> str | None:
    """Return the id of the MLflow run tagged with journal ``journal_id`` (:data:`JOURNAL_TAG`), or None."""
    experiments = [e.experiment_id for e in client.search_experiments()]
    if not experiments:
        return None
    runs = client.search_runs(experiments, filter_string=f"tags.`{JOURNAL_TAG}` = '{journal_id}'", max_results=1)
    return str(runs[0].info.run_id) if runs else None
