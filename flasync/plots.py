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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

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


def render_plots(profile: Mapping[str, Any]) -> dict[str, bytes]:
    """Draw the profile as PNG images; return ``{file name: PNG bytes}``.

    ``accuracy.png`` (accuracy against wall and simulated time), ``staleness.png`` (histogram; only when updates'
    staleness differs: synchronous rounds would draw one bar),
    ``time_breakdown.png`` (stacked wall seconds per version; at most 60 bars, each the mean of consecutive
    versions in a longer run), ``bytes.png`` (bytes per version, only when an update's size varies: with a dense
    codec it would say nothing) and
    ``client_times.png`` (distribution of client task times).
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    def png(fig: Figure) -> bytes:
        # Margins set per figure, not bbox_inches="tight": that lays every text out twice, a third of the drawing.
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=100)
        return buffer.getvalue()

    def wide() -> Figure:
        fig = Figure(figsize=(10, 4))
        fig.subplots_adjust(left=0.09, right=0.97, bottom=0.12, top=0.88)
        return fig

    plots: dict[str, bytes] = {}
    evaluations = profile["evaluations"]
    fig = wide()
    axes = fig.subplots(1, 2)
    for ax, key, label in ((axes[0], "wall_s", "wall seconds"), (axes[1], "simulated_s", "simulated seconds")):
        ax.plot([e[key] for e in evaluations], [e["accuracy"] for e in evaluations], marker="o")
        ax.set_xlabel(label)
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
    fig.suptitle("Accuracy of the global model")
    plots["accuracy.png"] = png(fig)

    # A histogram of one bar (synchronous rounds: every update has staleness 0) says nothing.
    histogram = profile["staleness"]["histogram"]
    if len(histogram) > 1:
        fig = Figure(figsize=(6, 4))
        ax = fig.subplots()
        counts = {int(k): v for k, v in histogram.items()}
        low, high = min(counts), max(counts)
        # One filled step outline, not one rectangle per staleness: each rectangle is a matplotlib artist.
        ax.stairs([counts.get(k, 0) for k in range(low, high + 1)], _edges(low - 0.5, high + 1.5), fill=True)
        ax.set_xlabel("staleness (versions)")
        ax.set_ylabel("accepted updates")
        ax.set_title("Staleness of accepted updates")
        plots["staleness.png"] = png(fig)

    # At most _MAX_BARS bars: beyond that many versions, each bar is the mean of consecutive versions (a thousand
    # bars are unreadable, and each is one matplotlib artist: seconds to draw).
    bars = _binned(profile["time"]["per_version"], _MAX_BARS)
    span = max((b["versions"] for b in bars), default=1.0)
    per = "per version" if span == 1 else f"per version (mean over each bar's {span:g} versions)"
    # Bar i spans versions (edges[i], edges[i + 1]]; each series is one filled step outline on the ones below it.
    edges = [bars[0]["version"] - bars[0]["versions"] + 0.5 if bars else 0.5] + [b["version"] + 0.5 for b in bars]
    fig = wide()
    ax = fig.subplots()
    keys = ("compute_s", "encode_s", "decode_s", "queue_wait_s", "aggregate_s", "eval_s", "idle_s")
    bottom = [0.0] * len(bars)
    for key in keys if bars else ():
        top = [x + b[key] / b["versions"] for x, b in zip(bottom, bars, strict=True)]
        ax.stairs(top, edges, baseline=bottom, fill=True, label=key.removesuffix("_s"))
        bottom = top
    ax.set_xlabel("version")
    ax.set_ylabel("wall seconds (client columns summed over clients)")
    ax.set_title(f"Time breakdown {per}")
    ax.legend(fontsize="small", ncols=4)
    plots["time_breakdown.png"] = png(fig)

    # Bytes per version say something only when an update's size varies (compression, sparsity, partials): a
    # dense run's bars would all be the same height times the number of updates.
    rows = profile["time"]["per_version"]
    sizes = {(r["upload_bytes"] / r["updates"], r["download_bytes"] / r["updates"]) for r in rows if r["updates"]}
    if len(sizes) > 1:
        fig = wide()
        ax = fig.subplots()
        up = [b["upload_bytes"] / b["versions"] for b in bars]
        down = [b["download_bytes"] / b["versions"] for b in bars]
        ax.stairs(up, edges, label="up")
        ax.stairs(down, edges, label="down")
        ax.set_xlabel("version")
        ax.set_ylabel("bytes")
        ax.set_title(f"Bytes {per} (of the updates folded into it)")
        ax.legend()
        plots["bytes.png"] = png(fig)

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
    plots["client_times.png"] = png(fig)
    return plots


def write_plots(*, folder: str, profile: str) -> None:
    """Draw the profile stored as JSON in the file ``profile`` (see :func:`render_plots`) as PNG files in ``folder``.

    What the MLflow writer process (or a one-shot process) runs for a tracked run, so that the run's own process
    never imports matplotlib (see :mod:`tracking._files`).

    Args:
        folder: An existing folder; one file per plot goes there (``accuracy.png``, ...).
        profile: Path of the profile as JSON (``profile.json``'s content).
    """
    data = json.loads(Path(profile).read_text(encoding="utf-8"))
    for name, image in render_plots(data).items():
        Path(folder, name).write_bytes(image)


def warm_up_plots() -> None:
    """Import matplotlib and draw a throwaway figure, so the first plot of a run finds its fonts loaded."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 2))
    fig.subplots().plot([0, 1], [0, 1])
    fig.savefig(io.BytesIO(), format="png", dpi=20)
