"""The run profile: time breakdown per version, per-client timings and stragglers, memory and communication.

:class:`Profiler` reads events from the bus and keeps compact records (a few numbers per task and per version);
:func:`build_profile` turns them into the ``profile.json`` dict with pure arithmetic, and
:func:`flasync.observe.plots.render_plots` draws that dict as SVG charts. :class:`Instrumentation`
is the one bus subscriber of a run that feeds the profiler and the :class:`~flasync.training.diagnostics.AlertMonitor`
and
raises alerts (a structlog warning, an :class:`~flasync.core.events.AlertRaised` event, MLflow metrics
``alert.<kind>.count`` and an MLflow tag ``alert.<kind>``).

Units: ``*_s`` fields named ``sim_*`` or ``transfer_sim_s`` are simulated seconds of the virtual clock; every other
``*_s`` is wall seconds measured in this process.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import operator
import random
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import reduce
from itertools import groupby, repeat
from typing import Any, NamedTuple, cast

import torch

from flasync.core.bus import EventBus
from flasync.core.errors import BusClosed, BusFull
from flasync.core.events import (
    BATCH_EVENTS,
    Aggregated,
    AlertRaised,
    ClientEvaluated,
    ClientFailed,
    ClientId,
    EdgeForwarded,
    Evaluated,
    ModelPublished,
    RunFinished,
    SecureGroupClosed,
    TaskAssigned,
    TaskClosed,
    UpdateReceived,
    UpdateRejected,
    UpdateUploaded,
    Version,
)
from flasync.core.instruments import Instrument
from flasync.core.quantiles import StreamSummary, Thinned, add_columns, counted_percentile, percentile
from flasync.observe.plots import merge_rows
from flasync.training.diagnostics import Alert, AlertMonitor

__all__ = [
    "Instrumentation",
    "Profiler",
    "build_profile",
    "gpu_status",
    "headline",
    "peak_rss_bytes",
    "quantiles",
]


def quantiles(values: Sequence[float]) -> dict[str, float] | None:
    """Return ``p50``, ``p90``, ``max``, ``mean`` and ``count`` of ``values`` (None when empty)."""
    if not values:
        return None
    ordered = sorted(values)
    return {
        "p50": percentile(ordered, 0.5),
        "p90": percentile(ordered, 0.9),
        "max": ordered[-1],
        "mean": sum(ordered) / len(ordered),
        "count": float(len(ordered)),
    }


class _Task(NamedTuple):
    """An uploaded update waiting to be folded into a version (kept only until then)."""

    compute_s: float
    encode_s: float
    sim_task_s: float
    sim_train_s: float
    upload_bytes: int
    download_bytes: int


@dataclass(slots=True)
class _Client:
    """One client's totals over the run."""

    tasks: int = 0
    sim_task_s: float = 0.0
    compute_s: float = 0.0
    upload_bytes: int = 0
    download_bytes: int = 0


@dataclass(slots=True)
class _Version:
    """A version being made: the updates folded into it and its own costs (folded into a row once complete)."""

    updates: int = 0
    compute_s: float = 0.0
    encode_s: float = 0.0
    decode_s: float = 0.0
    queue_wait_s: float = 0.0
    sim_train_s: float = 0.0
    transfer_sim_s: float = 0.0
    upload_bytes: int = 0
    download_bytes: int = 0
    staleness_sum: int = 0
    durations: list[float] = field(default_factory=list)
    aggregate_s: float = 0.0
    wall_s: float = math.nan
    simulated_s: float = math.nan
    publish_encode_s: float = 0.0
    eval_s: float = 0.0
    client_eval_s: float = 0.0
    secagg_cpu_s: float = 0.0
    secagg_sim_s: float = 0.0
    aggregated: bool = False


class VersionRows:
    """The per-version rows of a run, in at most ``capacity`` rows however many versions it makes.

    Each row covers one version until ``capacity`` rows are full; then neighbouring rows are merged in pairs (sums
    added, the later version and times kept, staleness weighted by updates) and from then on each row covers twice
    as many versions (``versions`` says how many; ``version`` is the last one it covers). Column totals stay exact.

    Args:
        capacity: The most rows kept (even, at least 2).
    """

    def __init__(self, capacity: int = 1024) -> None:
        """Start empty."""
        if capacity < 2 or capacity % 2:
            raise ValueError(f"capacity must be an even number of at least 2, got {capacity}")
        self.capacity = capacity
        self.span = 1
        self._rows: list[dict[str, float]] = []
        self._open: dict[str, float] | None = None

    def add(self, row: dict[str, float]) -> None:
        """Append the row of the next version (with ``versions`` = 1)."""
        self._open = row if self._open is None else merge_rows(self._open, row)
        if self._open["versions"] < self.span:
            return
        self._rows.append(self._open)
        self._open = None
        if len(self._rows) >= self.capacity:
            self._rows = [merge_rows(a, b) for a, b in zip(self._rows[::2], self._rows[1::2], strict=True)]
            self.span *= 2

    def rows(self) -> list[dict[str, float]]:
        """The rows, oldest first (the last may cover fewer versions than the others)."""
        return [*self._rows, *([self._open] if self._open is not None else [])]


_new_task = cast("Callable[[type[_Task], tuple[Any, ...]], _Task]", tuple.__new__)
"""Make a :class:`_Task` from a tuple of its fields, without a Python call per task."""

_FIRST = operator.itemgetter(0)

_SAMPLE = 4096  # values kept per streamed quantile summary (exact up to this many)
_IN_FLIGHT = 65_536  # uploads awaiting their version, at most (the oldest are dropped beyond)
_DOWNLOAD_SIZES = 1024  # published versions whose download size is remembered


@dataclass(slots=True)
class ProfileRecords:
    """What the profiler keeps: bounded however long the run (per client, per pending update, summaries and rows).

    Memory grows with the number of distinct clients that took part, never with the number of updates or versions:
    uploads are kept only until their version is made, versions are folded into :class:`VersionRows`, evaluations
    are :class:`Thinned`, and distributions are :class:`~flasync.core.quantiles.StreamSummary` samples.
    """

    rng: random.Random
    clients: dict[int, _Client] = field(default_factory=dict)
    pending: dict[int, _Task] = field(default_factory=dict)
    """Task id -> an upload not yet folded into a version."""
    dropped_pending: int = 0
    """Uploads forgotten before their version was made because more than ``_IN_FLIGHT`` waited."""
    tasks_completed: int = 0
    sim_task_s: StreamSummary = field(init=False)
    sim_train_s: StreamSummary = field(init=False)
    compute_s: StreamSummary = field(init=False)
    encode_s: StreamSummary = field(init=False)
    peak_mem_bytes: StreamSummary = field(init=False)
    staleness: Counter[int] = field(default_factory=Counter)
    open_versions: dict[int, _Version] = field(default_factory=lambda: defaultdict(_Version))
    made: list[int] = field(default_factory=list)
    """The versions of ``open_versions`` that were aggregated (their rows not yet closed), ascending."""
    rows: VersionRows = field(default_factory=VersionRows)
    last_row_wall_s: float = 0.0
    last_eval_s: float = 0.0
    """Evaluation seconds of the version before the next row's (they fall in that row's wall interval)."""
    download_sizes: dict[int, int] = field(default_factory=dict)
    """Version -> bytes of its download (the latest ``_DOWNLOAD_SIZES`` versions)."""
    downloads: int = 0
    download_tiers: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    evaluations: Thinned[dict[str, float]] = field(default_factory=Thinned)
    failed: Counter[int] = field(default_factory=Counter)
    rejected: Counter[str] = field(default_factory=Counter)
    alerts: Counter[str] = field(default_factory=Counter)
    forwarded: Counter[str] = field(default_factory=Counter)
    """Tier name -> bytes its edges forwarded to their parents."""
    forwards: Counter[str] = field(default_factory=Counter)
    """Tier name -> partials (or raw updates) its edges forwarded."""
    tier_uploads: Counter[str] = field(default_factory=Counter)
    """Tier name -> bytes uploaded by the clients of that tier."""
    wall_s: float = math.nan
    simulated_s: float = math.nan
    secure: bool = False
    """Secure aggregation groups ran: each row carries their CPU and simulated seconds."""

    def __post_init__(self) -> None:
        """Create the streamed summaries on the records' generator."""
        for name in ("sim_task_s", "sim_train_s", "compute_s", "encode_s", "peak_mem_bytes"):
            setattr(self, name, StreamSummary(_SAMPLE, self.rng))

    def client(self, client_id: int) -> _Client:
        """The totals of one client (created on first use)."""
        found = self.clients.get(client_id)
        if found is None:
            found = self.clients[client_id] = _Client()
        return found


class Profiler:
    """Keep the records of one run from its events (call :meth:`observe` with every event, in order).

    Args:
        mode: ``"sync"`` or ``"async"``: sync rows carry the straggler wait of their round.
        rng: Draws which values the quantile summaries keep once there are too many to keep all (seeded by
            default, so a profile is reproducible).
    """

    def __init__(self, mode: str = "async", rng: random.Random | None = None) -> None:
        """Start empty."""
        self.mode = mode
        self.records = ProfileRecords(rng=rng if rng is not None else random.Random(0))
        self._version = 0

    def observe(self, event: object) -> None:
        """Record one event."""
        r = self.records
        # First the two events a buffered server sees one by one for every update. (No event is an instance of two
        # of these classes: slotted classes with fields of their own cannot be combined, so the order decides nothing.)
        if isinstance(event, UpdateReceived):
            self._received(event)
        elif isinstance(event, TaskAssigned):
            self._assigned(event)
        elif isinstance(event, UpdateUploaded):
            self._uploaded(event)
        elif isinstance(event, UpdateRejected):
            r.rejected[event.reason] += 1
            r.pending.pop(event.task_id, None)
        elif isinstance(event, ModelPublished):
            self._published(event)
        elif isinstance(event, TaskClosed):
            # An edge closed a client's task; an accepted update goes into the cloud's next version.
            # (Its rejections and failures are counted from UpdateRejected and ClientFailed, which edges publish too.)
            if event.outcome == "accepted":
                self._fold(self._version + 1, event.task_id, event.staleness, 0.0, 0.0)
            else:
                r.pending.pop(event.task_id, None)
        elif isinstance(event, EdgeForwarded):
            r.forwarded[event.tier] += len(event.payload)
            r.forwards[event.tier] += 1
        elif isinstance(event, Aggregated):
            self._aggregated(event)
        elif isinstance(event, SecureGroupClosed):
            self._secure_group(event)
        elif isinstance(event, ClientEvaluated):
            # Clients' evaluation time counts towards the version being made while it is spent, as training does.
            r.open_versions[self._version + 1].client_eval_s += event.eval_s
        elif isinstance(event, Evaluated):
            r.open_versions[int(event.version)].eval_s += event.eval_s
            r.evaluations.add(
                {
                    "version": float(event.version),
                    "accuracy": event.accuracy,
                    "loss": event.loss,
                    "simulated_s": event.simulated_s,
                    "wall_s": event.wall_s,
                }
            )
        elif isinstance(event, ClientFailed):
            r.failed[int(event.client_id)] += 1
        elif isinstance(event, AlertRaised):
            r.alerts[event.kind] += 1
        elif isinstance(event, RunFinished):
            r.wall_s, r.simulated_s = event.wall_s, event.simulated_s

    def handler(self, kind: type[Any]) -> Callable[[Any], None]:
        """Return what records an event of class ``kind``: :meth:`observe` itself, or for the events a buffered
        server sees one by one for every update (a receipt, a task) the part of it they reach, a call fewer."""
        if issubclass(kind, UpdateReceived):
            return self._received
        if issubclass(kind, TaskAssigned):
            return self._assigned
        if issubclass(kind, ModelPublished):
            return self._published
        if issubclass(kind, Aggregated):
            return self._aggregated
        return self.observe

    def _published(self, event: ModelPublished) -> None:
        """Record a published version: its encoding time and its download's size."""
        r = self.records
        version = int(event.version)
        r.open_versions[version].publish_encode_s += event.encode_s
        sizes = r.download_sizes
        sizes[version] = event.download_bytes
        while len(sizes) > _DOWNLOAD_SIZES:
            del sizes[next(iter(sizes))]

    def _received(self, event: UpdateReceived) -> None:
        """Record one accepted upload: :meth:`_fold` it into its version."""
        self._fold(int(event.version) + 1, event.task_id, event.staleness, event.decode_s, event.queue_wait_s)

    def finish(self) -> ProfileRecords:
        """Fold every version made so far into rows and return the records (call once, at the end of the run)."""
        r = self.records
        made, r.made = r.made, []
        for version in made:
            self._close(version)
        return r

    def observe_many(self, events: Sequence[object]) -> None:
        """Record the events of one batch (of one class), in order: what :meth:`observe` of each records."""
        if not events:
            return
        first = events[0]
        if isinstance(first, UpdateUploaded):
            self._uploaded_many(cast("Sequence[UpdateUploaded]", events))
        elif isinstance(first, UpdateReceived):
            self._received_many(cast("Sequence[UpdateReceived]", events))
        elif isinstance(first, TaskAssigned):
            self._assigned_many(cast("Sequence[TaskAssigned]", events))
        else:
            for event in events:
                self.observe(event)

    def _assigned(self, event: TaskAssigned) -> None:
        """Record one task handed out: :meth:`_assigned_many` of one."""
        self._assigned_many((event,))

    def _assigned_many(self, events: Sequence[TaskAssigned]) -> None:
        """Record tasks handed out: each client's download and the run's."""
        if not events:
            return
        r = self.records
        sizes, clients, new_client = r.download_sizes, r.clients, _Client
        versions = [event.base_version for event in events]
        if versions.count(versions[0]) == len(versions):  # one model (the common case): its size looked up once
            downloads: Iterable[int] = repeat(sizes.get(int(versions[0]), 0), len(events))
        else:
            downloads = [sizes.get(int(version), 0) for version in versions]
        total = 0
        for client_id, size in zip(map(int, [event.client_id for event in events]), downloads, strict=True):
            client = clients.get(client_id)
            if client is None:
                client = clients[client_id] = new_client()
            client.download_bytes += size
            total += size
        r.downloads += len(events)
        r.download_tiers["client"] += total

    def _uploaded(self, event: UpdateUploaded) -> None:
        """Record a client's upload: :meth:`_uploaded_many` of one."""
        self._uploaded_many((event,))

    def _uploaded_many(self, events: Sequence[UpdateUploaded]) -> None:
        """Record clients' uploads, in order: their totals, the run's summaries, and each task until its version is
        made."""
        if not events:
            return
        r = self.records
        compute = [event.compute_s for event in events]
        train = [event.sim_train_s for event in events]
        task = [event.sim_download_s + event.sim_train_s + event.sim_upload_s for event in events]
        uploaded = [event.upload_bytes for event in events]
        ids = [event.client_id for event in events]
        clients, new_client = r.clients, _Client
        for client_id, sim_task_s, compute_s, upload_bytes in zip(map(int, ids), task, compute, uploaded, strict=True):
            client = clients.get(client_id)
            if client is None:
                client = clients[client_id] = new_client()
            client.tasks += 1
            client.sim_task_s += sim_task_s
            client.compute_s += compute_s
            client.upload_bytes += upload_bytes
        totals = r.tier_uploads
        tiers = [event.tier for event in events]
        if tiers.count(tiers[0]) == len(tiers):  # one tier (byte counts are integers: their sum in any order)
            totals[tiers[0]] += sum(uploaded)
        else:
            for tier, group in groupby(zip(tiers, uploaded, strict=True), key=_FIRST):
                totals[tier] += sum(upload_bytes for _, upload_bytes in group)
        encode = [event.encode_s for event in events]
        # One random stream behind every summary: its draws are taken upload by upload, as one at a time would.
        add_columns(
            (r.sim_task_s, r.sim_train_s, r.compute_s, r.encode_s, r.peak_mem_bytes),
            (task, train, compute, encode, [float(event.peak_mem_bytes) for event in events]),
        )
        held = zip(compute, encode, task, train, uploaded, [event.download_bytes for event in events], strict=True)
        waiting = zip([event.task_id for event in events], map(_new_task, repeat(_Task), held), strict=True)
        pending = r.pending
        if len(pending) + len(events) <= _IN_FLIGHT:
            pending.update(waiting)
        else:
            for task_id, waiter in waiting:
                if len(pending) >= _IN_FLIGHT:
                    del pending[next(iter(pending))]
                    r.dropped_pending += 1
                pending[task_id] = waiter
        r.tasks_completed += len(events)

    def _received_many(self, events: Sequence[UpdateReceived]) -> None:
        """Fold accepted uploads into the versions they go into, in order: what :meth:`_fold` of each does."""
        if not events:
            return
        r = self.records
        staleness = [event.staleness for event in events]
        r.staleness.update(staleness)
        tasks = list(map(r.pending.pop, [event.task_id for event in events], repeat(None)))
        versions = [event.version for event in events]
        decode = [event.decode_s for event in events]
        queue_wait = [event.queue_wait_s for event in events]
        if None in tasks:  # uploads not (or no longer) waiting: folded into nothing
            kept = [k for k, task in enumerate(tasks) if task is not None]
            if not kept:
                return
            tasks = [tasks[k] for k in kept]
            versions = [versions[k] for k in kept]
            staleness = [staleness[k] for k in kept]
            decode = [decode[k] for k in kept]
            queue_wait = [queue_wait[k] for k in kept]
        if versions.count(versions[0]) == len(versions):  # one version (the common case): one run
            self._fold_run(int(versions[0]) + 1, cast("list[_Task]", tasks), staleness, decode, queue_wait)
            return
        start = 0
        for version, run in groupby(map(int, versions)):
            end = start + sum(1 for _ in run)
            self._fold_run(
                version + 1,
                cast("list[_Task]", tasks[start:end]),
                staleness[start:end],
                decode[start:end],
                queue_wait[start:end],
            )
            start = end

    def _fold_run(
        self,
        version: int,
        tasks: list[_Task],
        staleness: Sequence[int],
        decode: Sequence[float],
        queue_wait: Sequence[float],
    ) -> None:
        """Fold accepted uploads of one version (their tasks, staleness, decoding and queue seconds), each sum taken
        value by value in the order of the uploads."""
        rec = self.records.open_versions[version]
        compute, encode, task, train, uploaded, downloaded = zip(*tasks, strict=True)
        add = operator.add
        rec.updates += len(tasks)
        rec.compute_s = reduce(add, compute, rec.compute_s)
        rec.encode_s = reduce(add, encode, rec.encode_s)
        rec.decode_s = reduce(add, decode, rec.decode_s)
        rec.queue_wait_s = reduce(add, queue_wait, rec.queue_wait_s)
        rec.sim_train_s = reduce(add, train, rec.sim_train_s)
        rec.transfer_sim_s = reduce(add, map(operator.sub, task, train), rec.transfer_sim_s)
        rec.upload_bytes += sum(uploaded)
        rec.download_bytes += sum(downloaded)
        rec.staleness_sum += sum(staleness)
        if self.mode == "sync":
            rec.durations.extend(task)

    def _aggregated(self, event: Aggregated) -> None:
        """Record a version's aggregation, closing the rows of the versions made before it."""
        r = self.records
        version = int(event.version)
        # The previous version's row is complete now: its publication and evaluation came before this. (``made``
        # holds exactly the open versions aggregated, ascending: those before this one are a prefix of it.)
        made = r.made
        while made and made[0] < version:
            self._close(made.pop(0))
        if version > self._version:
            self._version = version
        rec = r.open_versions[version]
        rec.aggregate_s += event.aggregate_s
        rec.wall_s = event.wall_s
        rec.simulated_s = event.simulated_s
        if not rec.aggregated:
            rec.aggregated = True
            bisect.insort(made, version)

    def _secure_group(self, event: SecureGroupClosed) -> None:
        """Record a secure-aggregation group: its protocol's CPU and simulated seconds and bytes, and its members'
        updates, in the version its sum goes into."""
        r = self.records
        r.secure = True
        rec = r.open_versions[int(event.version) + 1]
        figures = event.figures
        rec.secagg_cpu_s += figures.get("secagg.cpu_s", 0.0)
        rec.secagg_sim_s += figures.get("secagg.protocol_s", 0.0)
        rec.upload_bytes += sum(event.upload_bytes.values())
        rec.download_bytes += sum(event.download_bytes.values())
        if not event.abandoned:
            rec.updates += len(event.survivors)
            for task in event.members:
                if int(task.client_id) in event.survivors:
                    staleness = int(event.version) - int(task.base_version)
                    r.staleness[staleness] += 1
                    rec.staleness_sum += staleness

    def _fold(self, version: int, task_id: int, staleness: int, decode_s: float, queue_wait_s: float) -> None:
        """Fold one accepted upload into the version it goes into."""
        r = self.records
        r.staleness[staleness] += 1
        task = r.pending.pop(task_id, None)
        if task is None:
            return
        rec = r.open_versions[version]
        rec.updates += 1
        rec.compute_s += task.compute_s
        rec.encode_s += task.encode_s
        rec.decode_s += decode_s
        rec.queue_wait_s += queue_wait_s
        rec.sim_train_s += task.sim_train_s
        rec.transfer_sim_s += task.sim_task_s - task.sim_train_s
        rec.upload_bytes += task.upload_bytes
        rec.download_bytes += task.download_bytes
        rec.staleness_sum += staleness
        if self.mode == "sync":
            rec.durations.append(task.sim_task_s)

    def _close(self, version: int) -> None:
        """Turn a made version into its row (its wall interval, breakdown and idle time) and forget its details."""
        r = self.records
        rec = r.open_versions.pop(version)
        if version <= 0 or math.isnan(rec.wall_s):
            r.last_eval_s = rec.eval_s
            return
        interval = rec.wall_s - r.last_row_wall_s
        r.last_row_wall_s = rec.wall_s
        busy = rec.decode_s + rec.aggregate_s + rec.publish_encode_s + r.last_eval_s
        r.last_eval_s = rec.eval_s
        row = {
            "version": float(version),
            "versions": 1.0,
            "updates": float(rec.updates),
            "wall_s": interval,
            "compute_s": rec.compute_s,
            "encode_s": rec.encode_s + rec.publish_encode_s,
            "decode_s": rec.decode_s,
            "queue_wait_s": rec.queue_wait_s,
            "aggregate_s": rec.aggregate_s,
            "eval_s": rec.eval_s,
            "client_eval_s": rec.client_eval_s,
            "idle_s": max(0.0, interval - busy),
            "sim_train_s": rec.sim_train_s,
            "transfer_sim_s": rec.transfer_sim_s,
            "simulated_s": rec.simulated_s,
            "upload_bytes": float(rec.upload_bytes),
            "download_bytes": float(rec.download_bytes),
            "staleness_mean": rec.staleness_sum / rec.updates if rec.updates else 0.0,
        }
        if r.secure:
            row["secagg_cpu_s"] = rec.secagg_cpu_s
            row["secagg_sim_s"] = rec.secagg_sim_s
        if self.mode == "sync":
            durations = rec.durations
            row["straggler_wait_sim_s"] = max(durations) - statistics.median(durations) if durations else 0.0
        r.rows.add(row)


def build_profile(
    records: ProfileRecords,
    *,
    mode: str,
    num_params: int,
    dense_bytes: int,
    stragglers: int = 5,
    memory: Mapping[str, Any] | None = None,
    diagnostics: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Summarise a run's records into the ``profile.json`` dict (pure).

    Args:
        records: The profiler's records, after :meth:`Profiler.finish`.
        mode: ``"sync"`` or ``"async"`` (straggler wait is reported for sync rounds).
        num_params: Length of the flat model.
        dense_bytes: Bytes of one uncompressed (float32) model, header included, for compression ratios.
        stragglers: How many of the slowest clients to name.
        memory: Memory figures measured by the runtime.
        diagnostics: The alert monitor's summary.
    """
    rows = records.rows.rows()
    trained = {c: stats for c, stats in records.clients.items() if stats.tasks}
    wall = records.wall_s
    time_totals = _time_totals(rows, mode)
    stale = records.staleness
    return {
        "mode": mode,
        "num_params": num_params,
        "wall_s": wall,
        "simulated_s": records.simulated_s,
        "versions": int(_column_total(rows, "versions")),
        "time": {
            "totals": time_totals,
            "server_idle_fraction": time_totals["idle_s"] / wall if wall and wall > 0 else math.nan,
            "versions_per_row": records.rows.span,
            "per_version": rows,
        },
        "clients": _clients_section(records, trained, stragglers),
        "communication": _communication_section(records, trained, dense_bytes),
        "staleness": {
            "histogram": {str(k): n for k, n in sorted(stale.items())},
            "summary": _staleness_summary(stale),
        },
        "evaluations": records.evaluations.items(),
        "memory": {
            **(memory or {}),
            "training_call_peak_bytes": records.peak_mem_bytes.summary(),
        },
        "diagnostics": dict(diagnostics or {}),
        "alerts": dict(records.alerts),
    }


def _column_total(rows: Sequence[Mapping[str, float]], key: str) -> float:
    """Return the sum of one column of the per-version rows."""
    return sum(row[key] for row in rows)


def _time_totals(rows: Sequence[Mapping[str, float]], mode: str) -> dict[str, float]:
    """Return the run's time totals: wall seconds by phase, then simulated transfer, training and straggler wait."""
    time_totals = {
        key: _column_total(rows, key)
        for key in (
            "compute_s",
            "encode_s",
            "decode_s",
            "queue_wait_s",
            "aggregate_s",
            "eval_s",
            "client_eval_s",
            "idle_s",
        )
    }
    time_totals["transfer_sim_s"] = _column_total(rows, "transfer_sim_s")
    time_totals["sim_train_s"] = _column_total(rows, "sim_train_s")
    if mode == "sync":
        time_totals["straggler_wait_sim_s"] = _column_total(rows, "straggler_wait_sim_s")
    return time_totals


def _straggler_rows(trained: Mapping[int, _Client], count: int) -> list[dict[str, Any]]:
    """Return the ``count`` clients with the longest mean simulated task, slowest first, against the median."""
    client_means = {c: stats.sim_task_s / stats.tasks for c, stats in trained.items()}
    population_median = statistics.median(client_means.values()) if client_means else math.nan
    slowest = sorted(client_means.items(), key=lambda item: (-item[1], item[0]))[:count]
    return [
        {
            "client_id": c,
            "task_sim_s": s,
            "times_median": s / population_median if population_median > 0 else math.nan,
            "tasks": trained[c].tasks,
            "compute_s_mean": trained[c].compute_s / trained[c].tasks,
        }
        for c, s in slowest
    ]


def _clients_section(records: ProfileRecords, trained: Mapping[int, _Client], stragglers: int) -> dict[str, Any]:
    """Return the profile's ``clients`` section: participation, failures, timing summaries and stragglers."""
    return {
        "participants": len(trained),
        "tasks_completed": records.tasks_completed,
        "tasks_failed": sum(records.failed.values()),
        "uploads_not_joined": records.dropped_pending,
        "failures_by_client": {str(c): n for c, n in sorted(records.failed.items())},
        "rejected": dict(records.rejected),
        "sim_task_s": records.sim_task_s.summary(),
        "sim_task_s_samples": records.sim_task_s.sample,
        "sim_train_s": records.sim_train_s.summary(),
        "compute_s": records.compute_s.summary(),
        "encode_s": records.encode_s.summary(),
        "stragglers": _straggler_rows(trained, stragglers),
    }


def _tier_bytes(records: ProfileRecords) -> dict[str, dict[str, int]]:
    """Return each tier's uploaded and downloaded bytes (and its edges' forwards), by tier name."""
    tiers: dict[str, dict[str, int]] = defaultdict(lambda: {"upload_bytes": 0, "download_bytes": 0})
    for tier, value in records.tier_uploads.items():
        tiers[tier]["upload_bytes"] += value
    for tier, value in records.download_tiers.items():
        tiers[tier]["download_bytes"] += value
    for tier, value in records.forwarded.items():
        tiers[tier]["upload_bytes"] += value
        tiers[tier]["forwards"] = records.forwards[tier]
    return {k: dict(v) for k, v in sorted(tiers.items())}


def _communication_section(records: ProfileRecords, trained: Mapping[int, _Client], dense_bytes: int) -> dict[str, Any]:
    """Return the profile's ``communication`` section: bytes moved, per tier and per client, and compression."""
    upload_total = sum(records.tier_uploads.values())
    download_total = sum(stats.download_bytes for stats in records.clients.values())
    return {
        "upload_bytes": upload_total,
        "download_bytes": download_total,
        "per_tier": _tier_bytes(records),
        "upload_bytes_per_client": quantiles([float(stats.upload_bytes) for stats in trained.values()]),
        "download_bytes_per_client": quantiles(
            [float(stats.download_bytes) for stats in records.clients.values() if stats.download_bytes]
        ),
        "upload_compression": dense_bytes * records.tasks_completed / upload_total if upload_total else 1.0,
        "download_compression": dense_bytes * records.downloads / download_total if download_total else 1.0,
    }


def _staleness_summary(stale: Counter[int]) -> dict[str, float] | None:
    """Return the staleness distribution's percentiles, maximum, mean and count (None: no update was counted)."""
    if not stale:
        return None
    return {
        "p50": counted_percentile(stale, 0.5),
        "p90": counted_percentile(stale, 0.9),
        "max": float(max(stale)),
        "mean": sum(k * n for k, n in stale.items()) / stale.total(),
        "count": float(stale.total()),
    }


def headline(profile: Mapping[str, Any]) -> dict[str, float]:
    """Return the profile's headline figures as flat numbers (logged as ``profile/*`` metrics)."""
    out: dict[str, float] = {}
    for key, value in profile["time"]["totals"].items():
        out[f"time_{key}"] = float(value)
    out["server_idle_fraction"] = float(profile["time"]["server_idle_fraction"])
    for key in ("sim_task_s", "compute_s"):
        summary = profile["clients"][key]
        if summary:
            out[f"client_{key}_p50"] = summary["p50"]
            out[f"client_{key}_p90"] = summary["p90"]
            out[f"client_{key}_max"] = summary["max"]
    comm = profile["communication"]
    out["upload_compression"] = float(comm["upload_compression"])
    out["download_compression"] = float(comm["download_compression"])
    for tier, figures in comm["per_tier"].items():
        for key, value in figures.items():
            out[f"{tier}_{key}"] = float(value)
    for key, value in profile["memory"].items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[f"memory_{key}"] = float(value)
    out["alerts"] = float(sum(profile["alerts"].values()))
    return out


def peak_rss_bytes() -> int:
    """Return the peak resident set size of this process in bytes (0 where the platform cannot say)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def gpu_status() -> list[dict[str, Any]] | None:
    """Return memory and utilisation of each GPU through NVML, or None without a GPU or NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        devices = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
            devices.append(
                {
                    "index": index,
                    "name": str(pynvml.nvmlDeviceGetName(handle)),
                    "memory_used_bytes": int(memory.used),
                    "memory_total_bytes": int(memory.total),
                    "utilization_percent": float(rates.gpu),
                }
            )
        return devices
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def torch_memory() -> dict[str, int]:
    """Return CUDA peak allocator figures when CUDA is in use (empty otherwise)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return {}
    return {
        "cuda_max_allocated_bytes": int(torch.cuda.max_memory_allocated()),
        "cuda_max_reserved_bytes": int(torch.cuda.max_memory_reserved()),
    }


_ALERTS_PRINTED = 3


def _ignore(event: object) -> None:
    """Do nothing with ``event``."""


class Instrumentation(Instrument):
    """The run's profiler and alert monitor, as an instrument on its bus (hooks, no task of its own).

    Every event published is handed to the profiler and the monitor as it is published. An alert is logged (a
    warning, so a metric; the first few of a kind, the rest at debug) and published as :class:`AlertRaised`; the
    first alert of each kind also becomes an MLflow tag, set off the event loop by the runtime at the end of the
    run (:attr:`first_alerts`).

    Args:
        bus: The run's bus; the instrument adds itself to it now.
        profiler: Keeps the profile records (None: no profile).
        monitor: Decides alerts (None: no alerts).
        log: The run's logger (alerts are warnings, and so MLflow metrics).
        now: The simulated time.
    """

    def __init__(
        self,
        bus: EventBus,
        *,
        profiler: Profiler | None,
        monitor: AlertMonitor | None,
        log: Any,
        now: Callable[[], float],
    ) -> None:
        """Attach to the bus."""
        self.bus = bus
        self.profiler = profiler
        self.monitor = monitor
        self._log = log
        self._now = now
        self._version = 0
        self.lost_alerts = 0
        self.first_alerts: dict[str, str] = {}
        """The message of the first alert of each kind (MLflow tags ``alert.<kind>`` at the end of the run)."""
        self._reads: dict[type[Any], bool] = {}
        self._handlers: dict[type[Any], Callable[[Any], None]] = {}
        self._profile_aggregated: Callable[[Aggregated], None] = _ignore
        bus.add_instrument(self)

    takes_batches = True

    def event_published(self, event: object) -> None:
        """Profile the event and raise the alerts it triggers (a batch's events one by one, in order)."""
        try:
            handle = self._handlers[type(event)]
        except KeyError:
            handle = self._handlers[type(event)] = self._handler(type(event))
        handle(event)

    def _handler(self, kind: type[Any]) -> Callable[[Any], None]:
        """Return what :meth:`event_published` does with events of class ``kind`` (made once per class)."""
        if issubclass(kind, BATCH_EVENTS):
            return self._observe_batch_event
        if issubclass(kind, AlertRaised):  # this instrument's own
            return _ignore
        if issubclass(kind, Aggregated):
            if self.profiler is not None:
                self._profile_aggregated = self.profiler.handler(kind)
            return self._observe_aggregated
        if self.profiler is not None and not self._monitor_reads(kind):
            return self.profiler.handler(kind)  # the profiler alone reads it
        return self._observe

    def _observe_aggregated(self, event: Aggregated) -> None:
        """:meth:`_observe` a version made, through the profiler's handler of the class (made by :meth:`_handler`)."""
        self._version = version = int(event.version)
        if self.profiler is not None:
            self._profile_aggregated(event)
        if self.monitor is not None and self._monitor_reads(type(event)):
            for alert in self.monitor.observe(event, version):
                self._raise(alert)

    def _observe_batch_event(self, event: Any) -> None:
        self._observe_batch(event.members)

    def _monitor_reads(self, kind: type[Any]) -> bool:
        """Tell whether the alert monitor reads events of class ``kind`` (``AlertMonitor.READS``; cached)."""
        reads = self._reads.get(kind)
        if reads is None:
            reads = self._reads[kind] = self.monitor is not None and issubclass(kind, self.monitor.READS)
        return reads

    def _observe_batch(self, members: tuple[object, ...]) -> None:
        """:meth:`_observe` each of a batch's events (of one class, never a version), without asking the alert
        monitor about those it does not read (``AlertMonitor.READS``)."""
        profiler, monitor = self.profiler, self.monitor
        if profiler is not None:
            profiler.observe_many(members)
        if monitor is not None and members and self._monitor_reads(type(members[0])):
            for index, alert in monitor.observe_many(members, self._version):
                # At the member's own time: a batch may hold events of several times (its uploads).
                self._raise(alert, getattr(members[index], "simulated_s", None))

    def _observe(self, event: object) -> None:
        if isinstance(event, Aggregated):
            self._version = int(event.version)
        if self.profiler is not None:
            self.profiler.observe(event)
        # The monitor is asked only about the events it reads: it raises nothing and keeps nothing of the others.
        if self.monitor is not None and self._monitor_reads(type(event)):
            for alert in self.monitor.observe(event, self._version):
                self._raise(alert)

    def _raise(self, alert: Alert, at: float | None = None) -> None:
        """Log, count and publish ``alert``, raised at virtual time ``at`` (None: now)."""
        assert self.monitor is not None
        count = self.monitor.record(alert)
        kind = alert.kind
        # Every alert is a metric; only the first few of a kind are printed as warnings (the rest at debug).
        emit = self._log.warning if count <= _ALERTS_PRINTED else self._log.debug
        if count == _ALERTS_PRINTED:
            alert = Alert(kind, f"{alert.message} (further {kind} alerts at debug level)", alert.value, alert.client_id)
        emit(
            f"alert.{kind}",
            step=self._version,
            count=count,
            value=alert.value,
            message=alert.message,
            **({} if alert.client_id is None else {"client_id": int(alert.client_id)}),
        )
        event = AlertRaised(
            kind=kind,
            message=alert.message,
            value=alert.value,
            count=count,
            version=Version(self._version),
            client_id=None if alert.client_id is None else ClientId(int(alert.client_id)),
            simulated_s=self._now() if at is None else at,
        )
        try:
            self.bus.publish_nowait(event)
        except (BusFull, BusClosed):
            self.lost_alerts += 1
        if count == 1:
            self.first_alerts[kind] = alert.message
