"""Compare runs side by side from MLflow (``flasync compare``).

:func:`fetch_runs` reads runs through ``MlflowClient`` (params, latest metrics and the accuracy history);
:func:`comparison_table` and :func:`time_to_target` are pure functions of what was read, and :func:`plot_comparison`
draws the runs' accuracy against client updates, simulated and wall time as an SVG chart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlflow
from mlflow.entities import Run

from flasync.tracking.report import RunLookupError, final_figures, get_run

__all__ = [
    "DEFAULT_LAST",
    "SWEEP_PARENT_TAG",
    "EvalPoint",
    "RunRecord",
    "comparison_table",
    "config_differences",
    "default_target",
    "fetch_runs",
    "plot_comparison",
    "time_to_target",
]

DEFAULT_LAST = 50
"""How many of an experiment's latest runs ``flasync compare`` compares unless told (``--last``)."""

SWEEP_PARENT_TAG = "flasync.sweep.grid"
"""The tag only a sweep's parent run carries (its grid; :mod:`flasync.runtime.sweep_runs` writes it): a parent trains
nothing, so comparing an experiment leaves it out (its child runs are compared)."""


@dataclass(frozen=True, slots=True)
class EvalPoint:
    """One evaluation of a run's global model."""

    version: int
    accuracy: float
    simulated_s: float
    wall_s: float
    updates: float = math.nan
    """Client updates accepted by then (the axis on which aggregators that make versions at different rates compare)."""


@dataclass(frozen=True, slots=True)
class RunRecord:
    """What a comparison needs of one run."""

    run_id: str
    name: str
    status: str
    params: dict[str, str]
    metrics: dict[str, float]
    history: list[EvalPoint] = field(default_factory=list)


def _history(client: mlflow.MlflowClient, run_id: str) -> list[EvalPoint]:
    accuracy = {m.step: m.value for m in client.get_metric_history(run_id, "server/eval/accuracy")}
    simulated = {m.step: m.value for m in client.get_metric_history(run_id, "server/eval/simulated_s")}
    wall = {m.step: m.value for m in client.get_metric_history(run_id, "server/eval/wall_s")}
    updates = {m.step: m.value for m in client.get_metric_history(run_id, "server/eval/updates")}
    return [
        EvalPoint(step, value, simulated.get(step, math.nan), wall.get(step, math.nan), updates.get(step, math.nan))
        for step, value in sorted(accuracy.items())
    ]


def fetch_runs(
    client: mlflow.MlflowClient,
    run_ids: Sequence[str] = (),
    *,
    experiment: str | None = None,
    last: int = DEFAULT_LAST,
    filter_string: str = "",
) -> list[RunRecord]:
    """Read the runs to compare: the given ids, else the latest ``last`` runs of ``experiment`` that match
    ``filter_string``, oldest first, sweeps' parent runs left out (:data:`SWEEP_PARENT_TAG`; their child runs are
    the experiment's runs like any other).

    Args:
        client: The store's client.
        run_ids: The runs, in the order given (the experiment's when empty).
        experiment: The experiment whose runs are compared without ``run_ids`` (``flasync`` when None).
        last: How many of the experiment's latest runs.
        filter_string: An MLflow search filter the experiment's runs must match, e.g.
            ``params.`server.kind` = 'fedavg'`` or ``tags.aggregator = 'fedbuff'`` (all runs when empty).

    Raises:
        RunLookupError: A run id or the experiment does not exist, the filter is not one MLflow reads, or no run of
            the experiment matches it.
    """
    from mlflow.exceptions import MlflowException

    if run_ids:
        runs = [get_run(client, run_id) for run_id in run_ids]
    else:
        name = experiment or "flasync"
        found = client.get_experiment_by_name(name)
        if found is None:
            raise RunLookupError(f"no experiment {name!r} in {client.tracking_uri}")
        try:
            runs = _latest_trained(client, found.experiment_id, filter_string, last)
        except MlflowException as exc:
            reason = " ".join(str(exc.message).split())[:300]
            raise RunLookupError(f"--filter {filter_string!r}: {reason}") from None
        if not runs:
            matching = f" matching {filter_string!r}" if filter_string else ""
            raise RunLookupError(f"experiment {name!r} has no runs{matching}")
        runs.reverse()
    return [
        RunRecord(
            run_id=run.info.run_id,
            name=run.info.run_name or run.info.run_id[:8],
            status=run.info.status,
            params=dict(run.data.params),
            metrics=final_figures(run.data.metrics, run.data.tags),
            history=_history(client, run.info.run_id),
        )
        for run in runs
    ]


def _latest_trained(client: mlflow.MlflowClient, experiment_id: str, filter_string: str, last: int) -> list[Run]:
    """Return the latest ``last`` runs of the experiment that match ``filter_string`` and are no sweep's parent,
    newest first (a page of ``last`` at a time, as long as parents took places)."""
    runs: list[Run] = []
    token: str | None = None
    while len(runs) < last:
        page = client.search_runs(
            [experiment_id],
            filter_string=filter_string,
            order_by=["attributes.start_time DESC"],
            max_results=last,
            page_token=token,
        )
        runs += [run for run in page if SWEEP_PARENT_TAG not in run.data.tags]
        token = page.token
        if not token:
            break
    return runs[:last]


def time_to_target(history: Sequence[EvalPoint], target: float) -> EvalPoint | None:
    """Return the first evaluation whose accuracy reached ``target`` (None if none did)."""
    for point in history:
        if point.accuracy >= target:
            return point
    return None


def default_target(records: Sequence[RunRecord]) -> float | None:
    """Return the lowest final accuracy of the runs: the target every run reached (None without accuracies)."""
    finals = [r.metrics["run/finished/accuracy"] for r in records if "run/finished/accuracy" in r.metrics]
    finals = [a for a in finals if math.isfinite(a)]
    return min(finals) if finals else None


def config_differences(records: Sequence[RunRecord]) -> dict[str, list[str]]:
    """Return the params whose values are not the same in every run (``-`` where a run lacks one)."""
    keys = sorted({k for r in records for k in r.params})
    out: dict[str, list[str]] = {}
    for key in keys:
        values = [r.params.get(key, "-") for r in records]
        if len(set(values)) > 1:
            out[key] = values
    return out


def _fmt(value: float | None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}g}"


def _fmt_bytes(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    n = value
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover


def comparison_table(records: Sequence[RunRecord], *, target: float | None = None) -> str:
    """Return a side-by-side text table of runs: one column per run, one row per figure or differing param.

    Args:
        records: The runs.
        target: Accuracy for the time-to-target rows (default: :func:`default_target`).
    """
    if target is None:
        target = default_target(records)

    def metric(record: RunRecord, key: str) -> float | None:
        return record.metrics.get(f"run/finished/{key}")

    rows: list[tuple[str, list[str]]] = [
        ("run", [r.name for r in records]),
        ("run id", [r.run_id for r in records]),
        ("status", [r.status for r in records]),
        ("final accuracy", [_fmt(metric(r, "accuracy")) for r in records]),
        ("final loss", [_fmt(metric(r, "loss")) for r in records]),
    ]
    if target is not None:
        reached = [time_to_target(r.history, target) for r in records]
        rows.append((f"sim s to acc {target:.4g}", [_fmt(p.simulated_s) if p else "never" for p in reached]))
        rows.append((f"wall s to acc {target:.4g}", [_fmt(p.wall_s) if p else "never" for p in reached]))
        rows.append((f"version at acc {target:.4g}", [str(p.version) if p else "never" for p in reached]))

    def total_bytes(r: RunRecord) -> float | None:
        up, down = metric(r, "upload_bytes"), metric(r, "download_bytes")
        return None if up is None or down is None else up + down

    rows += [
        ("bytes up", [_fmt_bytes(metric(r, "upload_bytes")) for r in records]),
        ("bytes down", [_fmt_bytes(metric(r, "download_bytes")) for r in records]),
        ("bytes total", [_fmt_bytes(total_bytes(r)) for r in records]),
        ("updates accepted", [_fmt(metric(r, "updates_accepted"), 9) for r in records]),
        ("updates dropped", [_fmt(metric(r, "updates_dropped"), 9) for r in records]),
        ("versions", [_fmt(metric(r, "versions"), 9) for r in records]),
        ("staleness mean", [_fmt(metric(r, "staleness_mean"), 3) for r in records]),
        ("staleness max", [_fmt(metric(r, "staleness_max"), 9) for r in records]),
        ("wall s", [_fmt(metric(r, "wall_s")) for r in records]),
        ("simulated s", [_fmt(metric(r, "simulated_s")) for r in records]),
        ("updates/s", [_fmt(metric(r, "updates_per_s")) for r in records]),
    ]
    differences = config_differences(records)
    if differences:
        rows.append(("config differences", [""] * len(records)))
        rows += [(f"  {key}", values) for key, values in differences.items()]
    else:
        rows.append(("config differences", ["none"] + [""] * (len(records) - 1)))
    label_width = max(len(label) for label, _ in rows)
    widths = [max(len(values[i]) for _, values in rows) for i in range(len(records))]
    lines = []
    for label, values in rows:
        cells = "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=True))
        lines.append(f"{label.ljust(label_width)}  {cells}".rstrip())
    return "\n".join(lines)


def plot_comparison(records: Sequence[RunRecord], path: str | Path, *, target: float | None = None) -> None:
    """Write an SVG chart of the runs' accuracy against client updates, simulated time and wall time (a dashed line
    at ``target``): not against versions, which mean different amounts of work per aggregator (a FedAvg round folds
    a whole cohort, a FedAsync version one update). Drawn by :mod:`flasync.tracking.charts`, as a run's own plots are.

    Raises:
        ValueError: ``path`` does not end with ``.svg``.
    """
    from flasync.tracking.charts import HLine, Line, Panel, render

    if Path(path).suffix.lower() != ".svg":
        raise ValueError(f"the comparison is an SVG chart: name a .svg file, not {str(path)!r}")
    panels = []
    for axis, xlabel in (
        ("updates", "client updates"),
        ("simulated_s", "simulated seconds"),
        ("wall_s", "wall seconds"),
    ):
        series: list[Line | HLine] = [
            Line(
                xs=[float(getattr(p, axis)) for p in record.history],
                ys=[p.accuracy for p in record.history],
                label=f"{record.name} ({record.run_id[:8]})",  # one legend entry and colour a run, every panel
            )
            for record in records
        ]
        if target is not None:
            series.append(HLine(y=target, label=f"target {target:.4g}"))
        panels.append(Panel(series=series, xlabel=xlabel, ylabel="accuracy", grid=True))
    Path(path).write_text(render(panels, width=1500, height=450, title="flasync runs compared"), encoding="utf-8")
