"""Draw a run's profile as PNG plots, from its JSON form alone (no torch: a fresh process draws them quickly).

:func:`write_plots` is what the MLflow writer process, or a one-shot process, runs for a tracked run, so that the
run's own process never imports matplotlib (see :mod:`tracking._files`); :func:`merge_rows` is how consecutive
per-version rows of a profile become one, here for the bars of a long run and in :mod:`flasync.profiling` for its
bounded table.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["ADDITIVE", "merge_rows", "render_plots", "warm_up_plots", "write_plots"]

ADDITIVE = (
    "updates",
    "wall_s",
    "compute_s",
    "encode_s",
    "decode_s",
    "queue_wait_s",
    "aggregate_s",
    "eval_s",
    "idle_s",
    "sim_train_s",
    "transfer_sim_s",
    "upload_bytes",
    "download_bytes",
    "straggler_wait_sim_s",
)


def merge_rows(first: dict[str, float], second: dict[str, float]) -> dict[str, float]:
    """One row for two consecutive spans of versions: sums, the later version and time, staleness by update."""
    merged = {key: first[key] + second[key] if key in ADDITIVE else second[key] for key in second}
    updates = first["updates"] + second["updates"]
    merged["staleness_mean"] = (
        (first["staleness_mean"] * first["updates"] + second["staleness_mean"] * second["updates"]) / updates
        if updates
        else 0.0
    )
    merged["versions"] = first["versions"] + second["versions"]
    return merged


_MAX_BARS = 60  # per-version plots draw at most this many bars (each the mean of consecutive versions beyond)


def _binned(rows: Sequence[Mapping[str, float]], limit: int) -> list[dict[str, float]]:
    """Merge consecutive per-version rows into at most ``limit`` rows of equal spans (sums added; see
    :func:`merge_rows`)."""
    group = max(1, math.ceil(len(rows) / limit))
    out: list[dict[str, float]] = []
    for start in range(0, len(rows), group):
        merged = dict(rows[start])
        merged.setdefault("versions", 1.0)
        for row in rows[start + 1 : start + group]:
            merged = merge_rows(merged, {**row, "versions": row.get("versions", 1.0)})
        out.append(merged)
    return out


def _edges(first: float, stop: float) -> list[float]:
    """Return the unit steps ``first, first + 1, ...`` below ``stop``: the edges of one bar per integer."""
    return [first + i for i in range(math.ceil(stop - first))]


def render_plots(profile: Mapping[str, Any], names: Collection[str] | None = None) -> dict[str, bytes]:
    """Draw the profile as PNG images; return ``{file name: PNG bytes}``.

    ``accuracy.png`` (accuracy against wall and simulated time), ``staleness.png`` (histogram; only when updates'
    staleness differs: synchronous rounds would draw one bar),
    ``time_breakdown.png`` (stacked wall seconds per version; at most 60 bars, each the mean of consecutive
    versions in a longer run), ``bytes.png`` (bytes per version, only when an update's size varies: with a dense
    codec it would say nothing) and
    ``client_times.png`` (distribution of client task times).

    Args:
        profile: The run's profile (``profile.json``'s content).
        names: Draw only these plots (file names as above; None: all of them).
    """
    import matplotlib

    matplotlib.use("Agg", force=False)

    from matplotlib.ticker import MaxNLocator

    plots: dict[str, bytes] = {}
    for name in _saying_something(profile):
        if names is None or name in names:
            figure = _DRAWERS[name](profile)
            for ax in figure.axes:
                # A tick is a handful of matplotlib artists: at most 6 per axis, not up to 10, is a fifth less drawing.
                ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
                ax.yaxis.set_major_locator(MaxNLocator(nbins=5))
            # Margins set per figure, not bbox_inches="tight": that lays every text out twice, a third of the drawing.
            # zlib's fastest level: a fifth less time than the default for files a third larger (tens of kB).
            buffer = io.BytesIO()
            figure.savefig(buffer, format="png", dpi=100, pil_kwargs={"compress_level": 1})
            plots[name] = buffer.getvalue()
    return plots


def _saying_something(profile: Mapping[str, Any]) -> list[str]:
    """Return the plots (file names) that say something for this run's profile."""
    return [name for name in _DRAWERS if name not in _ONLY_WHEN or _ONLY_WHEN[name](profile)]


def _wide() -> Figure:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    fig.subplots_adjust(left=0.09, right=0.97, bottom=0.12, top=0.88)
    return fig


def _accuracy(profile: Mapping[str, Any]) -> Figure:
    evaluations = profile["evaluations"]
    fig = _wide()
    axes = fig.subplots(1, 2)
    for ax, key, label in ((axes[0], "wall_s", "wall seconds"), (axes[1], "simulated_s", "simulated seconds")):
        ax.plot([e[key] for e in evaluations], [e["accuracy"] for e in evaluations], marker="o")
        ax.set_xlabel(label)
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
    fig.suptitle("Accuracy of the global model")
    return fig


def _staleness_varies(profile: Mapping[str, Any]) -> bool:
    # A histogram of one bar (synchronous rounds: every update has staleness 0) says nothing.
    return len(profile["staleness"]["histogram"]) > 1


def _staleness(profile: Mapping[str, Any]) -> Figure:
    from matplotlib.figure import Figure

    histogram = profile["staleness"]["histogram"]

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    counts = {int(k): v for k, v in histogram.items()}
    low, high = min(counts), max(counts)
    # One filled step outline, not one rectangle per staleness: each rectangle is a matplotlib artist.
    ax.stairs([counts.get(k, 0) for k in range(low, high + 1)], _edges(low - 0.5, high + 1.5), fill=True)
    ax.set_xlabel("staleness (versions)")
    ax.set_ylabel("accepted updates")
    ax.set_title("Staleness of accepted updates")
    return fig


def _bars(profile: Mapping[str, Any]) -> tuple[list[dict[str, float]], list[float], str]:
    """Return the per-version bars (at most ``_MAX_BARS``), their edges and how the title names what a bar is."""
    # Beyond _MAX_BARS versions, each bar is the mean of consecutive versions (a thousand bars are unreadable, and
    # each is one matplotlib artist: seconds to draw).
    bars = _binned(profile["time"]["per_version"], _MAX_BARS)
    span = max((b["versions"] for b in bars), default=1.0)
    per = "per version" if span == 1 else f"per version (mean over each bar's {span:g} versions)"
    # Bar i spans versions (edges[i], edges[i + 1]].
    edges = [bars[0]["version"] - bars[0]["versions"] + 0.5 if bars else 0.5] + [b["version"] + 0.5 for b in bars]
    return bars, edges, per


def _time_breakdown(profile: Mapping[str, Any]) -> Figure:
    bars, edges, per = _bars(profile)
    fig = _wide()
    ax = fig.subplots()
    keys = ("compute_s", "encode_s", "decode_s", "queue_wait_s", "aggregate_s", "eval_s", "idle_s")
    bottom = [0.0] * len(bars)
    for key in keys if bars else ():  # each series one filled step outline on the ones below it
        top = [x + b[key] / b["versions"] for x, b in zip(bottom, bars, strict=True)]
        ax.stairs(top, edges, baseline=bottom, fill=True, label=key.removesuffix("_s"))
        bottom = top
    ax.set_xlabel("version")
    ax.set_ylabel("wall seconds (client columns summed over clients)")
    ax.set_title(f"Time breakdown {per}")
    ax.legend(fontsize="small", ncols=4)
    return fig


def _size_varies(profile: Mapping[str, Any]) -> bool:
    # Bytes per version say something only when an update's size varies (compression, sparsity, partials): a
    # dense run's bars would all be the same height times the number of updates.
    rows = profile["time"]["per_version"]
    sizes = {(r["upload_bytes"] / r["updates"], r["download_bytes"] / r["updates"]) for r in rows if r["updates"]}
    return len(sizes) > 1


def _bytes(profile: Mapping[str, Any]) -> Figure:
    bars, edges, per = _bars(profile)
    fig = _wide()
    ax = fig.subplots()
    up = [b["upload_bytes"] / b["versions"] for b in bars]
    down = [b["download_bytes"] / b["versions"] for b in bars]
    ax.stairs(up, edges, label="up")
    ax.stairs(down, edges, label="down")
    ax.set_xlabel("version")
    ax.set_ylabel("bytes")
    ax.set_title(f"Bytes {per} (of the updates folded into it)")
    ax.legend()
    return fig


def _client_times(profile: Mapping[str, Any]) -> Figure:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    samples = profile["clients"]["sim_task_s_samples"]
    ax.hist(samples, bins=min(30, max(5, len(samples) // 3 or 5)), histtype="stepfilled")
    ax.set_xlabel("simulated seconds per task (download + train + upload)")
    ax.set_ylabel("tasks")
    summary = profile["clients"]["sim_task_s"]
    if summary:
        ax.axvline(summary["p50"], color="k", linestyle="--", label="p50")
        ax.axvline(summary["p90"], color="r", linestyle="--", label="p90")
        ax.legend()
    ax.set_title("Client task times")
    return fig


_DRAWERS: dict[str, Callable[[Mapping[str, Any]], Figure]] = {
    "accuracy.png": _accuracy,
    "staleness.png": _staleness,
    "time_breakdown.png": _time_breakdown,
    "bytes.png": _bytes,
    "client_times.png": _client_times,
}
"""Each plot's file name and what draws it."""

_ONLY_WHEN: dict[str, Callable[[Mapping[str, Any]], bool]] = {
    "staleness.png": _staleness_varies,
    "bytes.png": _size_varies,
}
"""The plots drawn only for some runs, and the test of a run's profile that says whether."""


def write_plots(*, folder: str, profile: str, parallel: bool = True) -> None:
    """Draw the profile stored as JSON in the file ``profile`` (see :func:`render_plots`) as PNG files in ``folder``.

    What the MLflow writer process (or a one-shot process) runs for a tracked run, so that the run's own process
    never imports matplotlib (see :mod:`tracking._files`). The plots are drawn at a run's end, where the user waits
    for them: with ``parallel``, in a process with no other thread (the writer's helper, a one-shot process) on an
    OS that forks, each plot but the first is drawn by a forked copy of the process at once, on whatever cores are
    free; a plot whose copy failed is drawn again here.

    Args:
        folder: An existing folder; one file per plot goes there (``accuracy.png``, ...).
        profile: Path of the profile as JSON (``profile.json``'s content).
        parallel: Draw the plots in forked processes where that is safe.
    """
    data = json.loads(Path(profile).read_text(encoding="utf-8"))
    names = _saying_something(data)
    forked: list[tuple[str, int]] = []
    if parallel and _FORKS and threading.active_count() == 1:
        import matplotlib

        matplotlib.use("Agg", force=False)  # imported once, before the copies
        for name in names[1:]:
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the forked copy (its file is checked by the tests)
                status = 1
                try:
                    for written, image in render_plots(data, (name,)).items():
                        Path(folder, written).write_bytes(image)
                    status = 0
                finally:
                    os._exit(status)
            forked.append((name, pid))
        names = names[:1]
    try:
        for name, image in render_plots(data, names).items():
            Path(folder, name).write_bytes(image)
    finally:  # every copy is reaped, whatever happened here
        failed = [name for name, pid in forked if os.waitpid(pid, 0)[1] != 0]
    for name, image in render_plots(data, failed).items():
        Path(folder, name).write_bytes(image)


_FORKS = sys.platform.startswith("linux")
"""Whether :func:`write_plots` may fork (Linux; macOS's system frameworks may not survive a fork)."""


def warm_up_plots() -> None:
    """Import matplotlib and draw a throwaway figure, so the first plot of a run finds its fonts loaded."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 2))
    fig.subplots().plot([0, 1], [0, 1])
    fig.savefig(io.BytesIO(), format="png", dpi=20)
