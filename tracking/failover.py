"""Online/offline failover of one tracked run: records go to the store, or to a spool while the store fails.

A :class:`Failover` sends each record (params, tags, metrics, artifacts, the final status) through a callable that
writes it to MLflow; when that fails, it writes the record to a JSON-lines spool (:mod:`flasync.tracking.spool`)
instead, and from then on tries the store again at most every ``retry_interval_s``. Once the store answers, the
spool is replayed into it in order and records go direct again. The run's lifecycle (start, resume, finish) is
:class:`flasync.tracking._lifecycle.RunLifecycle`'s and its metric writers are
:class:`flasync.tracking._writers.RunWriters`'; this module only routes.
"""

from __future__ import annotations

import contextlib
import shlex
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flasync.tracking._room import StatusRoom
from flasync.tracking.journal import RunJournal
from flasync.tracking.spool import Replayer, SpoolWriter, default_spool_path, iter_records, rejected, save_progress
from flasync.tracking.store import check_answers, prepare_sqlite_store, redact_uri, sqlite_path

if TYPE_CHECKING:
    import mlflow

__all__ = ["Failover", "RunIdentity"]


@dataclass
class RunIdentity:
    """Which run a tracker's records belong to: set by the run's lifecycle, completed by a replay.

    Attributes:
        tracking_uri: The store.
        experiment: The experiment's name.
        run_name: The run's display name.
        run_id: The MLflow run (None while the store never answered).
        experiment_id: The experiment's id once known.
        started_at: Start time in ms since the epoch (None before the run started).
        client: The client of the store, once made.
        probe_timeout_s: How long :meth:`connect` waits for an HTTP(S) server's answer before it imports MLflow.
    """

    tracking_uri: str
    experiment: str = ""
    run_name: str | None = None
    run_id: str | None = None
    experiment_id: str | None = None
    started_at: int | None = None
    client: mlflow.MlflowClient | None = None
    probe_timeout_s: float = 10.0

    def connect(self, log: Any = None) -> mlflow.MlflowClient:
        """Return the store's client, making it on first use (a SQLite store is prepared first, see
        :func:`flasync.tracking.store.prepare_sqlite_store`).

        Raises:
            ConnectionError: An HTTP(S) server does not answer (asked before MLflow is imported here, see
                :func:`flasync.tracking.store.check_answers`).
        """
        if self.client is None:
            check_answers(self.tracking_uri, self.probe_timeout_s)
            import mlflow

            prepare_sqlite_store(self.tracking_uri, log)
            self.client = mlflow.MlflowClient(tracking_uri=self.tracking_uri)
        return self.client


class Failover:
    """Route records to the store or, while it fails, to a spool; replay the spool when the store answers.

    Tracking never takes the run down: when the store cannot be reached or errors - at the run's start or later -
    every record (params, tags, metrics, artifacts, the final status) goes to a JSON-lines spool (see
    :mod:`flasync.tracking.spool`), whose path is logged (``tracking.spooling``) and printed on stderr once. While
    spooling, the store is tried again at most every ``retry_interval_s`` (when there is something to write);
    once it answers, the spool is replayed in order and records go direct again. What is left at the run's end
    stays in the spool, and the ``flasync tracking replay PATH`` command that sends it is logged and printed.
    Calls to an HTTP(S) server are bounded by ``http`` (a tracker's ``http_timeout_s`` per request and
    ``http_retries`` retries; the metric child process gets the same bounds in its environment).

    Args:
        run: The run the records belong to.
        log: Where warnings go (the spool's path, recovery, records the store refused).
        http: Bounds one block of calls to a server (see :func:`flasync.tracking.store.bounded_http`).
        experiment_id: Looks up or creates an experiment by name (for a run first created by a replay).
        retry_interval_s: Least time between two tries to reach a failed store, in seconds.
        spool_path: The spool file; a new file under ``spool_root`` when None.
        spool_root: Folder of default spool files.
    """

    def __init__(
        self,
        run: RunIdentity,
        *,
        log: Any,
        http: Callable[[], contextlib.AbstractContextManager[None]],
        experiment_id: Callable[[mlflow.MlflowClient, str], str],
        retry_interval_s: float = 5.0,
        spool_path: Path | None = None,
        spool_root: Path = Path("mlruns/spool"),
    ) -> None:
        """Start online, with no spool."""
        self.run = run
        self._log = log
        self._http = http
        self._experiment_id = experiment_id
        self._retry_interval = retry_interval_s
        self._spool_path = spool_path
        self._spool_root = spool_root
        # Serialises every write (direct or spooled) and the replay, so records keep their order.
        self.lock = threading.RLock()
        self.spool: SpoolWriter | None = None
        self.offline = False
        self._next_try = 0.0
        self._replay_offset = 0
        self._replayed = 0
        self._replayer: Replayer | None = None
        self.spilled = 0
        """Metric rows the writer's backlog could not hold, kept in the spool while the store answered."""
        self._unreplayed = False  # spilled rows not yet replayed into the run
        self.journal: RunJournal | None = None
        """The run's journal while its MLflow run is being opened (see :mod:`flasync.tracking.journal`)."""
        db = sqlite_path(run.tracking_uri)
        self.room = StatusRoom(None if db is None else db.absolute().parent)
        """Room on a local store's disk for the run's end status (see :mod:`flasync.tracking._room`): held once the run
        is open, given back just before the status is written."""

    def open_journal(self, tags: Mapping[str, str], params: Mapping[str, str]) -> RunJournal:
        """Start the run's journal with its ``tags`` (after MLflow's user and source tags) and ``params``."""
        run = self.run
        assert run.started_at is not None
        self.journal = RunJournal(
            self._spool_root,
            tracking_uri=run.tracking_uri,
            experiment=run.experiment,
            run_name=run.run_name,
            start_time=run.started_at,
            tags={**_basic_context_tags(), **tags},
            params=params,
            on_failure=self._journal_failed,
            path=self._spool_path,
        )
        return self.journal

    def _journal_failed(self, path: Path, reason: str) -> None:
        if self.journal is not None and self.journal.adopted:
            self._spool_failed(path, reason)  # the journal is the spool: what fails to go in is lost
            return
        self._log.warning(
            "tracking.journal_failed",
            message=f"cannot write the run's journal {path} ({reason}): until its MLflow run opens, what the run logs "
            "is kept in memory only",
            path=str(path),
            error=reason,
            metrics=False,
        )

    def journal_opened(self) -> None:
        """Make the MLflow run just opened the journal's replay target."""
        journal, run_id = self.journal, self.run.run_id
        if journal is not None and run_id:
            journal.opened(run_id, self.run.tracking_uri)

    def retire_journal(self) -> None:
        """Remove the journal once the store holds all of it (a no-op once it became the spool)."""
        if self.journal is not None:
            self.journal.retire()

    def replay_command(self) -> str | None:
        """Return the command that sends what is left in the spool, or None when nothing is left."""
        if self.spool is None or not (self.offline or self._unreplayed) or self.spool.records <= self._replayed:
            return None  # nothing left in the spool to send
        return f"flasync tracking replay {shlex.quote(str(self.spool.path))}"

    def deliver(self, send: Callable[[str, mlflow.MlflowClient], None], spool: Callable[[SpoolWriter], None]) -> None:
        """Send one record to the store, or to the spool while (or when) the store fails; order is kept."""
        with self.lock:
            if not self.offline or self.try_recover():
                run_id = self.run.run_id
                assert run_id is not None
                try:
                    with self._http():
                        # Connected on first use: a run the writer process created has no client here yet.
                        send(run_id, self.run.connect(self._log))
                    return
                except Exception as exc:
                    self.go_offline(exc)
            assert self.spool is not None
            spool(self.spool)

    def deliver_status(self, send: Callable[[str, mlflow.MlflowClient], None], status: str, end_time: int) -> None:
        """Deliver the run's final status with ``send``, as :meth:`deliver` does a record, but sent to the store first
        even while offline: a store too full to take the spool's rows (a full disk) may still take that one. A status
        the store took is not counted lost by a spool that could not keep it too."""
        with self.lock:
            direct = False
            if self.offline:
                direct = self._try_direct(send)
                self.try_recover(force=True)
            if direct and self.offline and self.spool is not None and self.spool.failure is not None:
                return  # in the store; the failed spool would only count it lost
            self.deliver(send, lambda spool: spool.status(status, end_time))

    def _try_direct(self, send: Callable[[str, mlflow.MlflowClient], None]) -> bool:
        """Send one record to the store even while offline; False when it fails."""
        run_id = self.run.run_id
        if run_id is None:
            return False
        try:
            with self._http():
                send(run_id, self.run.connect(self._log))
        except Exception:
            return False
        return True

    def spill(self, metrics: list[Any]) -> bool:
        """Keep metric rows the writer's backlog cannot hold in the spool (the run's journal), from which
        :meth:`replay_spilled` sends them to the run when it ends; False when they cannot be kept (no run yet, or
        the spool failed)."""
        with self.lock:
            if self.spool is None:
                if self.run.started_at is None:
                    return False
                self.spool = self._new_spool()
                self._log.warning(
                    "tracking.spilling",
                    message=f"the store at {redact_uri(self.run.tracking_uri)} takes metrics more slowly than the run "
                    f"makes them: the overflow goes to {self.spool.path}, and to the run when it ends",
                    path=str(self.spool.path),
                    metrics=False,
                )
            self.spool.metrics(metrics)
            if self.spool.failure is not None:
                return False
            self.spilled += len(metrics)
            self._unreplayed = self._unreplayed or not self.offline
            return True

    @property
    def records_lost(self) -> bool:
        """Whether records went neither to the store nor to the spool (the spool could not be written)."""
        return self.spool is not None and bool(self.spool.lost)

    def replay_spilled(self) -> None:
        """Send the spilled rows to the run now, if the store answers (else they stay for ``replay``)."""
        with self.lock:
            if self._unreplayed and not self.offline and self.try_recover(force=True):
                self._unreplayed = False

    def _new_spool(self) -> SpoolWriter:
        run = self.run
        assert run.started_at is not None
        journal = self.journal
        if journal is not None and journal.live and journal.spool.failure is None:
            # The journal holds the run's opening and what was logged before it opened: replayed from its start.
            self._replay_offset = journal.first
            return journal.adopt()
        path = self._spool_path
        if path is None or (journal is not None and path == journal.path):  # a journal that failed is there
            path = default_spool_path(run.experiment or "experiment", self._spool_root)
        spool = SpoolWriter(
            path,
            tracking_uri=run.tracking_uri,
            experiment=run.experiment,
            run_name=run.run_name,
            run_id=run.run_id,
            start_time=run.started_at,
            on_failure=self._spool_failed,
        )
        self._replay_offset = spool.size
        return spool

    def go_offline(self, error: BaseException) -> SpoolWriter:
        """Send records to the spool from now on (creating it, and saying where, the first time)."""
        self.offline = True
        self._next_try = time.monotonic() + self._retry_interval
        reason = redact_uri(f"{type(error).__name__}: {error}".splitlines()[0])[:300]
        if self.spool is not None:
            self._log.warning("tracking.spooling_again", path=str(self.spool.path), error=reason, metrics=False)
            return self.spool
        run = self.run
        self.spool = self._new_spool()
        if self.spool.failure is None:  # else its own warning said it cannot be written
            self._log.warning(
                "tracking.spooling",
                message=f"MLflow at {redact_uri(run.tracking_uri)} failed ({reason}); tracking records go to "
                f"{self.spool.path}",
                path=str(self.spool.path),
                tracking_uri=redact_uri(run.tracking_uri),
                error=reason,
                metrics=False,
            )
        return self.spool

    def spool_opening(self, error: BaseException, tags: Mapping[str, str], params: Mapping[str, str]) -> None:
        """Send the opening of a run the store did not take to the spool: its ``tags`` (after MLflow's user and
        source tags, while the store has no run) and ``params``."""
        spool = self.go_offline(error)
        if self.journal is not None and spool is self.journal.spool:
            return  # the journal began with them
        if self.run.run_id is None:
            spool.tags({**_basic_context_tags(), **tags})
        spool.params(params)

    def _spool_failed(self, path: Path, reason: str) -> None:
        self._log.warning(
            "tracking.spool_failed",
            message=f"cannot write the tracking spool {path} ({reason}): this run's tracking records are lost from "
            "now on; training goes on",
            path=str(path),
            error=reason,
            metrics=False,
        )

    def try_recover(self, *, force: bool = False) -> bool:
        """Replay the spool into the store if it answers (at most every ``retry_interval_s``); True when done."""
        if not force and time.monotonic() < self._next_try:
            return False
        self._next_try = time.monotonic() + self._retry_interval
        spool, run = self.spool, self.run
        assert spool is not None
        replayed = 0
        try:
            with self._http():
                client = run.connect(self._log)
                if self._replayer is None:
                    self._replayer = Replayer(client, spool.header, spool.path.parent, self._remember, run.run_id)
                replayer = self._replayer
                for record, end in iter_records(spool.path, self._replay_offset):
                    try:
                        replayer.apply(record)
                    except Exception as exc:
                        if not rejected(exc):
                            raise
                        self._log.warning(
                            "tracking.record_rejected", type=record["type"], error=redact_uri(str(exc)), metrics=False
                        )
                    run.run_id = replayer.run_id
                    self._replay_offset = end
                    self._replayed += 1
                    replayed += 1
                    save_progress(
                        spool.path, run.tracking_uri, run_id=replayer.ensure_run(), records=self._replayed, offset=end
                    )
                if run.run_id is None:  # nothing was spooled yet
                    run.run_id = replayer.ensure_run()
        except Exception as exc:
            if replayed:
                self._log.info(
                    "tracking.replay_partial", replayed=replayed, error=redact_uri(str(exc))[:300], metrics=False
                )
            return False
        self.offline = False
        if replayed or spool.failure is None:  # a spool that failed held nothing to send: nothing recovered
            self._log.warning("tracking.recovered", replayed=replayed, path=str(spool.path), metrics=False)
        return True

    def _remember(self, name: str) -> str:
        client = self.run.client
        assert client is not None
        self.run.experiment_id = self._experiment_id(client, name)
        return self.run.experiment_id

    def send_metrics(self, metrics: list[Any], direct: Callable[[list[Any]], None]) -> None:
        """Write one metric batch with ``direct``, or to the spool while the store fails; never raises."""
        with self.lock:
            if not self.offline or self.try_recover():
                try:
                    direct(metrics)
                    return
                except Exception as exc:
                    self.go_offline(exc)
            assert self.spool is not None
            self.spool.metrics(metrics)

    def close(self) -> str | None:
        """Close the spool (if any); return the replay command of what is left in it, after saying so."""
        if self.spool is None:
            return None
        self.spool.close()
        if self.spool.lost:
            lost = ", ".join(f"{count} {kind}" for kind, count in sorted(self.spool.lost.items()))
            kept = f"; the spool kept {self.spool.records} records" if self.spool.records else ""
            ended = "; a run that finished is marked FAILED"
            if self.spool.lost["status"] and self.run.run_id is not None:
                ended = (
                    "; the run's end status could not be written either: the store shows it RUNNING (once it has "
                    f"room: flasync tracking mark-failed {self.run.run_id} --tracking-uri "
                    f"{shlex.quote(redact_uri(self.run.tracking_uri))})"
                )
            elif self.spool.lost["status"]:
                ended = "; the store holds no run of it"
            self._log.warning(
                "tracking.records_lost",
                message=f"tracking records lost: the store failed and the spool {self.spool.path} could not be "
                f"written ({self.spool.failure}): {lost} lost; the store kept what it took before{kept}{ended}",
                path=str(self.spool.path),
                metrics=False,
                **{f"lost_{kind}": count for kind, count in self.spool.lost.items()},
            )
        command = self.replay_command()
        if command is not None:
            self._log.warning(
                "tracking.spool_left",
                message=f"MLflow at {redact_uri(self.run.tracking_uri)} did not answer; the run's tracking records "
                f"are in {self.spool.path}; send them with: {command}",
                path=str(self.spool.path),
                records=self.spool.records - self._replayed,
                replay=command,
                metrics=False,
            )
        return command


def _basic_context_tags() -> dict[str, str]:
    """MLflow's user and source tags, found without importing MLflow (for a run spooled before MLflow was loaded:
    MLflow's own context tags, when it was, replace these)."""
    import getpass

    try:
        user = getpass.getuser()
    except Exception:  # no user name in this environment
        user = "unknown"
    source = sys.argv[0] if sys.argv and sys.argv[0] else "<console>"
    return {"mlflow.user": user, "mlflow.source.name": source, "mlflow.source.type": "LOCAL"}
