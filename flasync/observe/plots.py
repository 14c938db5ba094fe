"""Draw a run's profile as SVG charts, from its JSON form alone.

:func:`render_plots` is what a tracked run logs under ``plots/`` as it ends: the charts are built as text by
:mod:`flasync.tracking.charts` (a millisecond or two, in the run's own process); :func:`write_plots` draws a stored
``profile.json`` into a folder. :func:`merge_rows` is how consecutive
per-version rows of a profile become one, here for the bars of a long run and in :mod:`flasync.observe.profiling` for
its
bounded table.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from flasync.tracking.charts import Line, Panel, Stairs, VLine, histogram, render

__all__ = ["ADDITIVE", "merge_rows", "render_plots", "write_plots"]

ADDITIVE = (
    "updates",
    "wall_s",
    "compute_s",
    "encode_s",
    "decode_s",
    "queue_wait_s",
    "aggregate_s",
    "eval_s",
    "client_eval_s",
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
    """Draw the profile as SVG charts; return ``{file name: UTF-8 SVG}``.

    ``accuracy.svg`` (accuracy against wall and simulated time), ``staleness.svg`` (histogram; only when updates'
    staleness differs: synchronous rounds would draw one bar),
    ``time_breakdown.svg`` (stacked wall seconds per version; at most 60 bars, each the mean of consecutive
    versions in a longer run), ``bytes.svg`` (bytes per version, only when an update's size varies: with a dense
    codec it would say nothing) and
    ``client_times.svg`` (distribution of client task times).

    Args:
        profile: The run's profile (``profile.json``'s content).
        names: Draw only these charts (file names as above; None: all of them).
    """
    return {
        name: _DRAWERS[name](profile).encode() for name in _saying_something(profile) if names is None or name in names
    }


def _saying_something(profile: Mapping[str, Any]) -> list[str]:
    """Return the charts (file names) that say something for this run's profile."""
    return [name for name in _DRAWERS if name not in _ONLY_WHEN or _ONLY_WHEN[name](profile)]


def _accuracy(profile: Mapping[str, Any]) -> str:
    evaluations = profile["evaluations"]
    accuracy = [float(e["accuracy"]) for e in evaluations]
    panels = [
        Panel(
            series=[Line(xs=[float(e[key]) for e in evaluations], ys=accuracy, markers=True)],
            xlabel=label,
            ylabel="accuracy",
            grid=True,
        )
        for key, label in (("wall_s", "wall seconds"), ("simulated_s", "simulated seconds"))
    ]
    return render(panels, title="Accuracy of the global model")


def _staleness_varies(profile: Mapping[str, Any]) -> bool:
    # A histogram of one bar (synchronous rounds: every update has staleness 0) says nothing.
    return len(profile["staleness"]["histogram"]) > 1


def _staleness(profile: Mapping[str, Any]) -> str:
    counts = {int(k): v for k, v in profile["staleness"]["histogram"].items()}
    low, high = min(counts), max(counts)
    bars = Stairs(values=[counts.get(k, 0) for k in range(low, high + 1)], edges=_edges(low - 0.5, high + 1.5))
    panel = Panel(series=[bars], xlabel="staleness (versions)", ylabel="accepted updates", integer_x=True)
    return render([panel], width=600, title="Staleness of accepted updates")


def _bars(profile: Mapping[str, Any]) -> tuple[list[dict[str, float]], list[float], str]:
    """Return the per-version bars (at most ``_MAX_BARS``), their edges and how the title names what a bar is."""
    # Beyond _MAX_BARS versions, each bar is the mean of consecutive versions (a thousand bars are unreadable).
    bars = _binned(profile["time"]["per_version"], _MAX_BARS)
    span = max((b["versions"] for b in bars), default=1.0)
    per = "per version" if span == 1 else f"per version (mean over each bar's {span:g} versions)"
    # Bar i spans versions (edges[i], edges[i + 1]].
    edges = [bars[0]["version"] - bars[0]["versions"] + 0.5 if bars else 0.5] + [b["version"] + 0.5 for b in bars]
    return bars, edges, per


def _time_breakdown(profile: Mapping[str, Any]) -> str:
    bars, edges, per = _bars(profile)
    keys = ("compute_s", "encode_s", "decode_s", "queue_wait_s", "aggregate_s", "eval_s", "idle_s")
    series: list[Stairs] = []
    bottom = [0.0] * len(bars)
    for key in keys if bars else ():  # each series stacked on the ones below it
        top = [x + b[key] / b["versions"] for x, b in zip(bottom, bars, strict=True)]
        series.append(Stairs(values=top, edges=edges, baseline=bottom, label=key.removesuffix("_s")))
        bottom = top
    panel = Panel(
        series=series, xlabel="version", ylabel="wall seconds (client columns summed over clients)", integer_x=True
    )
    return render([panel], title=f"Time breakdown {per}")


def _size_varies(profile: Mapping[str, Any]) -> bool:
    # Bytes per version say something only when an update's size varies (compression, sparsity, partials): a
    # dense run's bars would all be the same height times the number of updates.
    rows = profile["time"]["per_version"]
    sizes = {(r["upload_bytes"] / r["updates"], r["download_bytes"] / r["updates"]) for r in rows if r["updates"]}
    return len(sizes) > 1


def _bytes(profile: Mapping[str, Any]) -> str:
    bars, edges, _ = _bars(profile)
    span = max((b["versions"] for b in bars), default=1.0)
    # Up and down on axes of their own: a compressed upload is a fraction of the model sent down, and on one axis its
    # variation (what makes this chart say something) would be flat.
    panels = [
        Panel(
            series=[Stairs(values=[b[key] / b["versions"] for b in bars], edges=edges, fill=False)],
            xlabel="version",
            ylabel=label,
            integer_x=True,
        )
        for key, label in (("upload_bytes", "bytes up"), ("download_bytes", "bytes down"))
    ]
    mean = "" if span == 1 else f" (each step the mean over {span:g} versions)"
    return render(panels, title=f"Bytes per version, of the updates folded into it{mean}")


def _client_times(profile: Mapping[str, Any]) -> str:
    samples = [float(s) for s in profile["clients"]["sim_task_s_samples"]]
    counts, edges = histogram(samples, min(30, max(5, len(samples) // 3 or 5)))
    series: list[Stairs | VLine] = [Stairs(values=counts, edges=edges)]
    summary = profile["clients"]["sim_task_s"]
    if summary:
        series.append(VLine(x=float(summary["p50"]), label="p50", color="#000000"))
        series.append(VLine(x=float(summary["p90"]), label="p90", color="#d62728"))
    panel = Panel(series=series, xlabel="simulated seconds per task (download + train + upload)", ylabel="tasks")
    return render([panel], width=600, title="Client task times")


_DRAWERS: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "accuracy.svg": _accuracy,
    "staleness.svg": _staleness,
    "time_breakdown.svg": _time_breakdown,
    "bytes.svg": _bytes,
    "client_times.svg": _client_times,
}
"""Each plot's file name and what draws it."""

_ONLY_WHEN: dict[str, Callable[[Mapping[str, Any]], bool]] = {
    "staleness.svg": _staleness_varies,
    "bytes.svg": _size_varies,
}
"""The plots drawn only for some runs, and the test of a run's profile that says whether."""


def write_plots(*, folder: str, profile: str) -> None:
    """Draw the profile stored as JSON in the file ``profile`` (see :func:`render_plots`) as SVG files in ``folder``:
    the charts of a run whose ``profile.json`` was downloaded.

    Args:
        folder: An existing folder; one file per chart goes there (``accuracy.svg``, ...).
        profile: Path of the profile as JSON (``profile.json``'s content).
    """
    data = json.loads(Path(profile).read_text(encoding="utf-8"))
    for name, image in render_plots(data).items():
        Path(folder, name).write_bytes(image)
