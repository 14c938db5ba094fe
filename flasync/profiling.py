"""The run profile: time breakdown per version, per-client timings and stragglers, memory and communication.

:class:`Profiler` reads events from the bus and keeps compact records (a few numbers per task and per version);
:func:`build_profile` turns them into the ``profile.json`` dict with pure arithmetic, and :func:`render_plots` draws
that dict as PNG images (matplotlib, Agg backend). :class:`Instrumentation` is the one bus subscriber of a run that
feeds the profiler and the :class:`~flasync.diagnostics.AlertMonitor` and raises alerts (a structlog warning, an
:class:`~flasync.events.AlertRaised` event, MLflow metrics ``alert.<kind>.count`` and an MLflow tag
``alert.<kind>``).

Units: ``*_s`` fields named ``sim_*`` or ``transfer_sim_s`` are simulated seconds of the virtual clock; every other
``*_s`` is wall seconds measured in this process.
"""

from __future__ import annotations

import contextlib
import io
import math
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from flasync.bus import EventBus
from flasync.diagnostics import Alert, AlertMonitor
from flasync.errors import BusClosed, BusFull
from flasync.events import (
    Aggregated,
    AlertRaised,
    ClientFailed,
    ClientId,
    EdgeForwarded,
    Evaluated,
    ModelPublished,
    RunFinished,
    TaskAssigned,
    TaskClosed,
    UpdateReceived,
    UpdateRejected,
    UpdateUploaded,
    Version,
)
from flasync.instruments import Instrument
from flasync.quantiles import percentile

__all__ = [
    "Instrumentation",
    "Profiler",
    "build_profile",
    "gpu_status",
    "headline",
    "peak_rss_bytes",
    "quantiles",
    "render_plots",
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


@dataclass(slots=True)
class _Task:
    client_id: int
    base_version: int
    tier: str
    compute_s: float
    encode_s: float
    sim_download_s: float
    sim_train_s: float
    sim_upload_s: float
    upload_bytes: int
    download_bytes: int
    peak_mem_bytes: int


@dataclass(slots=True)
class _Version:
    aggregate_s: float = 0.0
    wall_s: float = math.nan
    simulated_s: float = math.nan
    num_updates: int = 0
    publish_encode_s: float = 0.0
    download_bytes_each: int = 0
    downloads: int = 0
    eval_s: float = 0.0


@dataclass(slots=True)
class ProfileRecords:
    """What the profiler keeps: per task, per received update, per version and per evaluation."""

    tasks: dict[int, _Task] = field(default_factory=dict)
    received: list[tuple[int, int, int, float, float]] = field(default_factory=list)
    """``(version it went into, task id, staleness, decode_s, queue_wait_s)``."""
    versions: dict[int, _Version] = field(default_factory=lambda: defaultdict(_Version))
    evaluations: list[dict[str, float]] = field(default_factory=list)
    downloads: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    """Client id -> downloaded bytes."""
    download_tiers: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    failed: Counter[int] = field(default_factory=Counter)
    rejected: Counter[str] = field(default_factory=Counter)
    alerts: Counter[str] = field(default_factory=Counter)
    forwarded: Counter[str] = field(default_factory=Counter)
    """Tier name -> bytes its edges forwarded to their parents."""
    forwards: Counter[str] = field(default_factory=Counter)
    """Tier name -> partials (or raw updates) its edges forwarded."""
    wall_s: float = math.nan
    simulated_s: float = math.nan


class Profiler:
    """Keep the records of one run from its events (call :meth:`observe` with every event, in order)."""

    def __init__(self) -> None:
        """Start empty."""
        self.records = ProfileRecords()
        self._version = 0

    def observe(self, event: object) -> None:
        """Record one event."""
        r = self.records
        if isinstance(event, UpdateUploaded):
            r.tasks[event.task_id] = _Task(
                client_id=int(event.client_id),
                base_version=int(event.base_version),
                tier=event.tier,
                compute_s=event.compute_s,
                encode_s=event.encode_s,
                sim_download_s=event.sim_download_s,
                sim_train_s=event.sim_train_s,
                sim_upload_s=event.sim_upload_s,
                upload_bytes=len(event.payload),
                download_bytes=event.download_bytes,
                peak_mem_bytes=event.peak_mem_bytes,
            )
        elif isinstance(event, UpdateReceived):
            r.received.append(
                (int(event.version) + 1, event.task_id, event.staleness, event.decode_s, event.queue_wait_s)
            )
        elif isinstance(event, TaskAssigned):
            version = r.versions[int(event.base_version)]
            version.downloads += 1
            r.downloads[int(event.client_id)] += version.download_bytes_each
            r.download_tiers["client"] += version.download_bytes_each
        elif isinstance(event, ModelPublished):
            version = r.versions[int(event.version)]
            version.publish_encode_s += event.encode_s
            version.download_bytes_each = event.download_bytes
        elif isinstance(event, TaskClosed):
            # An edge folded a client's update: it goes into the cloud's next version.
            # (Its rejections and failures are counted from UpdateRejected and ClientFailed, which edges publish too.)
            if event.outcome == "accepted":
                r.received.append((self._version + 1, event.task_id, event.staleness, 0.0, 0.0))
        elif isinstance(event, EdgeForwarded):
            r.forwarded[event.tier] += len(event.payload)
            r.forwards[event.tier] += 1
        elif isinstance(event, Aggregated):
            self._version = max(self._version, int(event.version))
            version = r.versions[int(event.version)]
            version.aggregate_s += event.aggregate_s
            version.wall_s = event.wall_s
            version.simulated_s = event.simulated_s
            version.num_updates = event.num_updates
        elif isinstance(event, Evaluated):
            r.versions[int(event.version)].eval_s += event.eval_s
            r.evaluations.append(
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
        elif isinstance(event, UpdateRejected):
            r.rejected[event.reason] += 1
        elif isinstance(event, AlertRaised):
            r.alerts[event.kind] += 1
        elif isinstance(event, RunFinished):
            r.wall_s, r.simulated_s = event.wall_s, event.simulated_s


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
        records: The profiler's records.
        mode: ``"sync"`` or ``"async"`` (straggler wait is reported for sync rounds).
        num_params: Length of the flat model.
        dense_bytes: Bytes of one uncompressed (float32) model, header included, for compression ratios.
        stragglers: How many of the slowest clients to name.
        memory: Memory figures measured by the runtime.
        diagnostics: The alert monitor's summary.
    """
    tasks = records.tasks
    by_version: dict[int, list[tuple[_Task, int, float, float]]] = defaultdict(list)
    staleness: list[int] = []
    for version, task_id, tau, decode_s, wait_s in records.received:
        task = tasks.get(task_id)
        staleness.append(tau)
        if task is not None:
            by_version[version].append((task, tau, decode_s, wait_s))
    produced = sorted(v for v, rec in records.versions.items() if v > 0 and not math.isnan(rec.wall_s))
    rows: list[dict[str, float]] = []
    previous_wall = 0.0
    for v in produced:
        rec = records.versions[v]
        members = by_version.get(v, [])
        decode = sum(m[2] for m in members)
        interval = rec.wall_s - previous_wall
        previous_wall = rec.wall_s
        eval_before = records.versions[v - 1].eval_s if v - 1 in records.versions else 0.0
        busy = decode + rec.aggregate_s + rec.publish_encode_s + eval_before
        durations = [m[0].sim_download_s + m[0].sim_train_s + m[0].sim_upload_s for m in members]
        row = {
            "version": float(v),
            "updates": float(len(members)),
            "wall_s": interval,
            "compute_s": sum(m[0].compute_s for m in members),
            "encode_s": sum(m[0].encode_s for m in members) + rec.publish_encode_s,
            "decode_s": decode,
            "queue_wait_s": sum(m[3] for m in members),
            "aggregate_s": rec.aggregate_s,
            "eval_s": rec.eval_s,
            "idle_s": max(0.0, interval - busy),
            "sim_train_s": sum(m[0].sim_train_s for m in members),
            "transfer_sim_s": sum(m[0].sim_download_s + m[0].sim_upload_s for m in members),
            "simulated_s": rec.simulated_s,
            "upload_bytes": float(sum(m[0].upload_bytes for m in members)),
            "download_bytes": float(sum(m[0].download_bytes for m in members)),
            "staleness_mean": sum(m[1] for m in members) / len(members) if members else 0.0,
        }
        if mode == "sync":
            row["straggler_wait_sim_s"] = max(durations) - statistics.median(durations) if durations else 0.0
        rows.append(row)

    per_client: dict[int, list[_Task]] = defaultdict(list)
    for task in tasks.values():
        per_client[task.client_id].append(task)
    client_medians = {
        c: statistics.median(t.sim_download_s + t.sim_train_s + t.sim_upload_s for t in ts)
        for c, ts in per_client.items()
    }
    population_median = statistics.median(client_medians.values()) if client_medians else math.nan
    slowest = sorted(client_medians.items(), key=lambda item: (-item[1], item[0]))[:stragglers]
    straggler_rows = [
        {
            "client_id": c,
            "task_sim_s": s,
            "times_median": s / population_median if population_median > 0 else math.nan,
            "tasks": len(per_client[c]),
            "compute_s_mean": sum(t.compute_s for t in per_client[c]) / len(per_client[c]),
        }
        for c, s in slowest
    ]

    uploads_by_client: dict[int, int] = defaultdict(int)
    tiers: dict[str, dict[str, int]] = defaultdict(lambda: {"upload_bytes": 0, "download_bytes": 0})
    for task in tasks.values():
        uploads_by_client[task.client_id] += task.upload_bytes
        tiers[task.tier]["upload_bytes"] += task.upload_bytes
    for tier, value in records.download_tiers.items():
        tiers[tier]["download_bytes"] += value
    for tier, value in records.forwarded.items():
        tiers[tier]["upload_bytes"] += value
        tiers[tier]["forwards"] = records.forwards[tier]
    upload_total = sum(t.upload_bytes for t in tasks.values())
    download_total = sum(records.downloads.values())
    downloads = sum(rec.downloads for rec in records.versions.values())

    def total(key: str) -> float:
        return sum(row[key] for row in rows)

    wall = records.wall_s
    time_totals = {
        key: total(key)
        for key in ("compute_s", "encode_s", "decode_s", "queue_wait_s", "aggregate_s", "eval_s", "idle_s")
    }
    time_totals["transfer_sim_s"] = total("transfer_sim_s")
    time_totals["sim_train_s"] = total("sim_train_s")
    if mode == "sync":
        time_totals["straggler_wait_sim_s"] = total("straggler_wait_sim_s")
    stale_hist = Counter(staleness)
    task_times = [t.sim_download_s + t.sim_train_s + t.sim_upload_s for t in tasks.values()]
    return {
        "mode": mode,
        "num_params": num_params,
        "wall_s": wall,
        "simulated_s": records.simulated_s,
        "versions": len(rows),
        "time": {
            "totals": time_totals,
            "server_idle_fraction": time_totals["idle_s"] / wall if wall and wall > 0 else math.nan,
            "per_version": rows,
        },
        "clients": {
            "participants": len(per_client),
            "tasks_completed": len(tasks),
            "tasks_failed": sum(records.failed.values()),
            "failures_by_client": {str(c): n for c, n in sorted(records.failed.items())},
            "rejected": dict(records.rejected),
            "sim_task_s": quantiles(task_times),
            "sim_task_s_samples": task_times[:: max(1, len(task_times) // 5000)],
            "sim_train_s": quantiles([t.sim_train_s for t in tasks.values()]),
            "compute_s": quantiles([t.compute_s for t in tasks.values()]),
            "encode_s": quantiles([t.encode_s for t in tasks.values()]),
            "stragglers": straggler_rows,
        },
        "communication": {
            "upload_bytes": upload_total,
            "download_bytes": download_total,
            "per_tier": {k: dict(v) for k, v in sorted(tiers.items())},
            "upload_bytes_per_client": quantiles([float(b) for b in uploads_by_client.values()]),
            "download_bytes_per_client": quantiles([float(b) for b in records.downloads.values()]),
            "upload_compression": dense_bytes * len(tasks) / upload_total if upload_total else 1.0,
            "download_compression": dense_bytes * downloads / download_total if download_total else 1.0,
        },
        "staleness": {
            "histogram": {str(k): n for k, n in sorted(stale_hist.items())},
            "summary": quantiles([float(s) for s in staleness]),
        },
        "evaluations": records.evaluations,
        "memory": {
            **(memory or {}),
            "training_call_peak_bytes": quantiles([float(t.peak_mem_bytes) for t in tasks.values()]),
        },
        "diagnostics": dict(diagnostics or {}),
        "alerts": dict(records.alerts),
    }


def headline(profile: Mapping[str, Any]) -> dict[str, float]:
    """Return the profile's headline figures as flat numbers (logged as ``profile.*`` metrics)."""
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


_MAX_BARS = 60  # per-version plots draw areas and lines beyond this many versions


def render_plots(profile: Mapping[str, Any]) -> dict[str, bytes]:
    """Draw the profile as PNG images; return ``{file name: PNG bytes}``.

    ``accuracy.png`` (accuracy against wall and simulated time), ``staleness.png`` (histogram),
    ``time_breakdown.png`` (stacked wall seconds per version), ``bytes.png`` (bytes per version) and
    ``client_times.png`` (distribution of client task times).
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    def png(fig: Figure) -> bytes:
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
        return buffer.getvalue()

    plots: dict[str, bytes] = {}
    evaluations = profile["evaluations"]
    fig = Figure(figsize=(10, 4))
    axes = fig.subplots(1, 2)
    for ax, key, label in ((axes[0], "wall_s", "wall seconds"), (axes[1], "simulated_s", "simulated seconds")):
        ax.plot([e[key] for e in evaluations], [e["accuracy"] for e in evaluations], marker="o")
        ax.set_xlabel(label)
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
    fig.suptitle("Accuracy of the global model")
    plots["accuracy.png"] = png(fig)

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    histogram = profile["staleness"]["histogram"]
    ax.bar([int(k) for k in histogram], list(histogram.values()))
    ax.set_xlabel("staleness (versions)")
    ax.set_ylabel("accepted updates")
    ax.set_title("Staleness of accepted updates")
    plots["staleness.png"] = png(fig)

    rows = profile["time"]["per_version"]
    versions = [int(r["version"]) for r in rows]
    # One bar per version while bars stay readable; beyond that, areas and lines (a bar is one matplotlib artist,
    # and a thousand of them take seconds to draw).
    as_bars = len(rows) <= _MAX_BARS
    fig = Figure(figsize=(10, 4))
    ax = fig.subplots()
    keys = ("compute_s", "encode_s", "decode_s", "queue_wait_s", "aggregate_s", "eval_s", "idle_s")
    if as_bars:
        bottom = [0.0] * len(rows)
        for key in keys:
            heights = [r[key] for r in rows]
            ax.bar(versions, heights, bottom=bottom, label=key.removesuffix("_s"), width=0.9)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    elif rows:
        series = [[r[key] for r in rows] for key in keys]
        ax.stackplot(versions, *series, labels=[key.removesuffix("_s") for key in keys], step="mid")
    ax.set_xlabel("version")
    ax.set_ylabel("wall seconds (client columns summed over clients)")
    ax.set_title("Time breakdown per version")
    ax.legend(fontsize="small", ncols=4)
    plots["time_breakdown.png"] = png(fig)

    fig = Figure(figsize=(10, 4))
    ax = fig.subplots()
    if as_bars:
        width = 0.4
        ax.bar([v - width / 2 for v in versions], [r["upload_bytes"] for r in rows], width=width, label="up")
        ax.bar([v + width / 2 for v in versions], [r["download_bytes"] for r in rows], width=width, label="down")
    else:
        ax.plot(versions, [r["upload_bytes"] for r in rows], drawstyle="steps-mid", label="up")
        ax.plot(versions, [r["download_bytes"] for r in rows], drawstyle="steps-mid", label="down")
    ax.set_xlabel("version")
    ax.set_ylabel("bytes")
    ax.set_title("Bytes per version (of the updates folded into it)")
    ax.legend()
    plots["bytes.png"] = png(fig)

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    samples = profile["clients"]["sim_task_s_samples"]
    ax.hist(samples, bins=min(30, max(5, len(samples) // 3 or 5)))
    ax.set_xlabel("simulated seconds per task (download + train + upload)")
    ax.set_ylabel("tasks")
    summary = profile["clients"]["sim_task_s"]
    if summary:
        ax.axvline(summary["p50"], color="k", linestyle="--", label="p50")
        ax.axvline(summary["p90"], color="r", linestyle="--", label="p90")
        ax.legend()
    ax.set_title("Client task times")
    plots["client_times.png"] = png(fig)
    return plots


_ALERTS_PRINTED = 3


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
        bus.add_instrument(self)

    def event_published(self, event: object) -> None:
        """Profile the event and raise the alerts it triggers."""
        if isinstance(event, AlertRaised):
            return  # this instrument's own
        if isinstance(event, Aggregated):
            self._version = int(event.version)
        if self.profiler is not None:
            self.profiler.observe(event)
        if self.monitor is not None:
            for alert in self.monitor.observe(event, self._version):
                self._raise(alert)

    def _raise(self, alert: Alert) -> None:
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
            simulated_s=self._now(),
        )
        try:
            self.bus.publish_nowait(event)
        except (BusFull, BusClosed):
            self.lost_alerts += 1
        if count == 1:
            self.first_alerts[kind] = alert.message
