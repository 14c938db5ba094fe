"""Accounting: every outcome of a task counted once, and the bytes that crossed each link, per version and tier."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from flasync.core.client_table import ClientTable
from flasync.core.errors import TrainingError

__all__ = ["Accounting", "ServerStats", "VersionFigures"]


@dataclass(slots=True)
class ServerStats:
    """Counters and last figures of a server run."""

    updates_accepted: int = 0
    updates_dropped: int = 0
    updates_failed: int = 0
    tasks_dispatched: int = 0
    upload_bytes: int = 0
    download_bytes: int = 0
    staleness_sum: int = 0
    staleness_max: int = 0
    cloud_ingress_bytes: int = 0
    cloud_egress_bytes: int = 0
    cloud_aggregate_s: float = 0.0
    partials_received: int = 0
    versions: int = 0
    accuracy: float = math.nan
    loss: float = math.nan
    evaluated_version: int = -1
    eval_metrics: dict[str, float] = field(default_factory=dict)
    """The last central evaluation's figures besides accuracy and loss (``eval.metrics``), by name."""
    stop_reason: str = ""
    tasks_timed_out: int = 0
    tasks_abandoned: int = 0
    first_update_s: float = math.nan
    """Real seconds from the start of the federation to its first accepted update (NaN: none yet)."""
    drop_reasons: Counter[str] = field(default_factory=Counter)
    failure_kinds: Counter[str] = field(default_factory=Counter)

    @property
    def staleness_mean(self) -> float:
        """Mean staleness of the accepted updates (0 when none was accepted)."""
        return self.staleness_sum / max(self.updates_accepted, 1)

    def to_state(self) -> dict[str, Any]:
        """Return the counters as plain values (for a checkpoint)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = dict(value) if isinstance(value, Counter) else value
        return out

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ServerStats:
        """Rebuild counters from :meth:`to_state`."""
        stats = cls()
        for f in fields(stats):
            if f.name in state:
                value = state[f.name]
                setattr(stats, f.name, Counter(value) if isinstance(getattr(stats, f.name), Counter) else value)
        return stats


@dataclass(frozen=True, slots=True)
class VersionFigures:
    """What went into one model version: updates, their mean staleness, and the cloud's bytes since the last one."""

    updates: int
    staleness_mean: float
    ingress_bytes: int
    egress_bytes: int


class Accounting:
    """Count each task's outcome once, the bytes on every link, and what each version was made of.

    Args:
        failure_limit: Consecutive genuine training errors (not injected faults, dropouts or timeouts) after which
            the model or the data is taken to be broken and the run fails.
        rejection_limit: Consecutive refused updates after which the server is taken to be unable to make
            progress (every update refused, e.g. by a validation rule that no client can pass) and the run fails
            with the refusal reasons (None: no limit).
        clients: Where each outcome and byte is also counted per client (``tracking.client_table``; None: nowhere).
            It is a part of the accounting's checkpoint state.
    """

    def __init__(
        self, failure_limit: int, rejection_limit: int | None = None, *, clients: ClientTable | None = None
    ) -> None:
        """Start with zero counts."""
        self.stats = ServerStats()
        self.clients = clients
        self.failure_limit = failure_limit
        self.rejection_limit = rejection_limit
        self._failure_streak = 0
        self._rejections: Counter[str] = Counter()
        self._staleness: list[int] = []
        self._ingress = 0
        self._egress = 0

    # --------------------------------------------------------------------------------------------- outcomes
    def accepted(self, staleness: int, *, client_id: int | None = None) -> None:
        """Count one update folded in (by the cloud or an edge), of client ``client_id`` when known."""
        if self.clients is not None and client_id is not None:
            self.clients.accepted(client_id, staleness)
        stats = self.stats
        self._failure_streak = 0
        if self._rejections:
            self._rejections.clear()
        stats.updates_accepted += 1
        stats.staleness_sum += staleness
        if staleness > stats.staleness_max:
            stats.staleness_max = staleness
        self._staleness.append(staleness)

    def took(self, upload_bytes: Sequence[int], staleness: Sequence[int], client_ids: Sequence[int]) -> None:
        """Count updates that reached the cloud and were folded in there, in order: :meth:`arrived` and then
        :meth:`accepted` of each in turn (the per-client table is told of each in that order; the sums are added
        once)."""
        clients = self.clients
        if clients is not None:
            for client_id, num_bytes, tau in zip(client_ids, upload_bytes, staleness, strict=True):
                clients.uploaded(client_id, num_bytes)
                clients.accepted(client_id, tau)
        if not staleness:
            return
        stats, size = self.stats, sum(upload_bytes)
        stats.upload_bytes += size
        stats.cloud_ingress_bytes += size
        self._ingress += size
        self._failure_streak = 0
        if self._rejections:
            self._rejections.clear()
        stats.updates_accepted += len(staleness)
        stats.staleness_sum += sum(staleness)
        most = max(staleness)
        if most > stats.staleness_max:
            stats.staleness_max = most
        self._staleness.extend(staleness)

    def rejected(self, reason: str, *, client_id: int | None = None) -> None:
        """Count one update refused by an intake (of client ``client_id`` when known).

        Raises:
            TrainingError: If this refusal ends a streak of ``rejection_limit`` with no update accepted.
        """
        if self.clients is not None and client_id is not None:
            self.clients.refused(client_id, reason)
        self.stats.updates_dropped += 1
        self.stats.drop_reasons[reason] += 1
        self._rejections[reason] += 1
        streak = self._rejections.total()
        if self.rejection_limit is not None and streak >= self.rejection_limit:
            reasons = ", ".join(f"{key} x{count}" for key, count in self._rejections.most_common())
            raise TrainingError(
                f"the last {streak} updates were all refused ({reasons}) and none was accepted: the server cannot "
                "make progress (check the resilience settings and the clients)"
            )

    def failed(self, kind: str, error: str, *, client_id: int | None = None) -> None:
        """Count one task whose client (``client_id`` when known) reported a failure.

        Raises:
            TrainingError: If this genuine error (``kind == "error"``) ends a streak of ``failure_limit``.
        """
        if self.clients is not None and client_id is not None:
            self.clients.failed(client_id)
        self.stats.updates_failed += 1
        self.stats.failure_kinds[kind] += 1
        if kind == "error":
            self._failure_streak += 1
            if self._failure_streak >= self.failure_limit:
                raise TrainingError(f"the last {self._failure_streak} client tasks all failed; the last error: {error}")

    def timed_out(self, *, client_id: int | None = None) -> None:
        """Count one task the registry's watchdog ended (of client ``client_id`` when known)."""
        if self.clients is not None and client_id is not None:
            self.clients.timed_out(client_id)
        self.stats.tasks_timed_out += 1

    def abandoned(self, count: int) -> None:
        """Count tasks a closed round left behind."""
        self.stats.tasks_abandoned += count

    # ------------------------------------------------------------------------------------------------ bytes
    def dispatched(self, download_bytes: int, *, from_cloud: bool, client_id: int | None = None) -> int:
        """Count one task and its model download (to client ``client_id`` when known); return the task's id (the
        count before it): :meth:`dispatched_many` of one."""
        return self.dispatched_many(download_bytes, (client_id,), from_cloud=from_cloud)[0]

    def dispatched_many(self, download_bytes: int, clients: Sequence[int | None], *, from_cloud: bool) -> range:
        """Count a task and its model download for each of ``clients`` (None: a client not known), in order; return
        the tasks' ids (each the count before it)."""
        if self.clients is not None:
            for client_id in clients:
                if client_id is not None:
                    self.clients.dispatched(client_id, download_bytes)
        stats, count = self.stats, len(clients)
        first = stats.tasks_dispatched
        stats.tasks_dispatched = first + count
        stats.download_bytes += download_bytes * count
        if from_cloud:
            self.egress(download_bytes * count)
        return range(first, first + count)

    def uploaded(self, num_bytes: int, *, client_id: int | None = None) -> None:
        """Count a client's upload (of client ``client_id`` when known), whatever becomes of it."""
        if self.clients is not None and client_id is not None:
            self.clients.uploaded(client_id, num_bytes)
        self.stats.upload_bytes += num_bytes

    def arrived(self, num_bytes: int, *, client_id: int | None = None) -> None:
        """Count a client's upload that reached the cloud (of client ``client_id`` when known): :meth:`uploaded` and
        :meth:`ingress` of its bytes in one call (one is made per update on the event loop)."""
        if self.clients is not None and client_id is not None:
            self.clients.uploaded(client_id, num_bytes)
        stats = self.stats
        stats.upload_bytes += num_bytes
        stats.cloud_ingress_bytes += num_bytes
        self._ingress += num_bytes

    def ingress(self, num_bytes: int) -> None:
        """Count bytes that reached the cloud."""
        self.stats.cloud_ingress_bytes += num_bytes
        self._ingress += num_bytes

    def egress(self, num_bytes: int) -> None:
        """Count bytes that left the cloud."""
        self.stats.cloud_egress_bytes += num_bytes
        self._egress += num_bytes

    # --------------------------------------------------------------------------------------------- versions
    def close_version(self, version: int) -> VersionFigures:
        """Record a new version and return what went into it (the per-version figures start afresh)."""
        self.stats.versions = version
        updates = len(self._staleness)
        figures = VersionFigures(
            updates=updates,
            staleness_mean=sum(self._staleness) / max(updates, 1),
            ingress_bytes=self._ingress,
            egress_bytes=self._egress,
        )
        self._staleness.clear()
        self._ingress = self._egress = 0
        return figures

    def state_dict(self) -> dict[str, Any]:
        """Return the counters for a checkpoint (with the per-client table's state, when there is one)."""
        clients = {"clients": self.clients.state_dict()} if self.clients is not None else {}
        return {
            **clients,
            "stats": self.stats.to_state(),
            "failure_streak": self._failure_streak,
            "rejection_streak": dict(self._rejections),
            "round_staleness": list(self._staleness),
            "ingress": self._ingress,
            "egress": self._egress,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.stats = ServerStats.from_state(state["stats"])
        self._failure_streak = int(state["failure_streak"])
        self._rejections = Counter({str(k): int(v) for k, v in state.get("rejection_streak", {}).items()})
        self._staleness = [int(x) for x in state["round_staleness"]]
        self._ingress = int(state.get("ingress", 0))
        self._egress = int(state.get("egress", 0))
        if self.clients is not None:
            self.clients.load_state_dict(state.get("clients", {}))
