"""The run journal as a tracker shows it: :class:`EarlyRecords` (:attr:`flasync.tracking.MlflowTracker.journal`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from flasync.tracking._lifecycle import RunLifecycle
from flasync.tracking._writers import RunWriters
from flasync.tracking.failover import Failover
from flasync.tracking.store import redact_uri

__all__ = ["EarlyRecords"]


class EarlyRecords:
    """What a tracker's run journal does for the run (:attr:`flasync.tracking.MlflowTracker.journal`): its id, the
    checkpoints it keeps while the MLflow run is being opened, its removal once the store holds all of it.

    Args:
        failover: The run's router, which holds the journal.
        writers: The run's metric side (whether the run is being opened).
        lifecycle: The run's lifecycle (whether it started).
        log_artifacts: Stores artifacts in the run (the tracker's).
        log: Where warnings go.
    """

    def __init__(
        self,
        failover: Failover,
        writers: RunWriters,
        lifecycle: RunLifecycle,
        log_artifacts: Callable[[Mapping[str, bytes]], None],
        log: Any,
    ) -> None:
        self._failover = failover
        self._writers = writers
        self._lifecycle = lifecycle
        self._log_artifacts = log_artifacts
        self._log = log

    @property
    def id(self) -> str | None:
        """The journal's id: set by ``start(wait=False)``, it names the run before MLflow has, and ``python -m
        flasync run --resume`` takes it; None otherwise."""
        journal = self._failover.journal
        return journal.id if journal is not None else None

    def keep(self, data: bytes, artifact_file: str) -> bool:
        """Keep an artifact (a checkpoint) in the journal while the MLflow run is being opened, after every metric
        logged so far; False when the run is open (or has no journal, or the journal cannot take it): then log it
        as usual."""
        journal = self._failover.journal
        return journal is not None and self._writers.opening and journal.artifact(data, artifact_file)

    def retire(self) -> None:
        """Remove the journal: the store holds everything it kept (a checkpoint was written after the run opened,
        its metrics flushed first); a journal that became the spool is kept."""
        if not self._writers.opening:
            self._failover.retire_journal()

    def send_kept(self) -> None:
        """Log the checkpoints the journal kept while the run was being opened whose successors did not reach the
        store (a run stopped early), before the run ends and the journal is removed."""
        journal = self._failover.journal
        if journal is None or not journal.live:
            return
        kept = journal.kept()
        if not kept:
            return
        self._lifecycle.await_open()
        if not self._lifecycle.started or not journal.live:
            return
        try:
            self._log_artifacts({name: path.read_bytes() for name, path in kept.items()})
        except Exception as exc:  # then the journal is kept: a replay sends them
            self._log.warning("tracking.journal_send_failed", error=redact_uri(str(exc))[:300], metrics=False)
            journal.keep()
