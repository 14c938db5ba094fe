"""Read a finished run back from MLflow and print its profile (``flasync report RUN_ID``).

Everything is read through ``MlflowClient``: the run's metrics and its ``profile.json`` artifact. Formatting is a
pure function of the run's data and the profile dict, so it is testable without a store.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Run

from flasync.core.client_table import HISTOGRAMS_ARTIFACT, TABLE_ARTIFACT
from flasync.tracking._runs import RUNS_VIEW_KEY, RUNS_VIEW_TAG
from flasync.tracking.journal import JOURNAL_ID, run_of_journal
from flasync.tracking.metrics import FINISHED_TAG_PREFIX
from flasync.tracking.store import experiment_url, redact_uri, resolve_tracking_uri, sqlite_path, ui_command

__all__ = [
    "RunLookupError",
    "experiment_address",
    "final_figures",
    "format_client_table",
    "format_report",
    "get_run",
    "load_client_views",
    "load_profile",
    "open_store",
]


class RunLookupError(LookupError):
    """A store, experiment or run that was asked for does not exist (the message is one line)."""


def open_store(uri: str | None = None) -> mlflow.MlflowClient:
    """Return a client of the store ``uri`` names (resolved as a tracker resolves it).

    Raises:
        RunLookupError: The URI names a SQLite file that does not exist (nothing is created), or a scheme MLflow
            has no store for.
    """
    resolved = resolve_tracking_uri(uri)
    db = sqlite_path(resolved)
    if db is not None and not db.exists():
        raise RunLookupError(f"no MLflow store at {db} (pass --tracking-uri)")
    try:
        return mlflow.MlflowClient(tracking_uri=resolved)
    except mlflow.exceptions.MlflowException as exc:  # a scheme MLflow has no store for
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RunLookupError(f"{redact_uri(resolved)!r} is not an MLflow store URI: {first}") from None


def final_figures(metrics: Mapping[str, float], tags: Mapping[str, str]) -> dict[str, float]:
    """Return a run's metrics with its final figures as ``run/finished/<name>``: read from its ``finished.*`` tags,
    or, for a run that logged them as one-point metrics, from those.

    Args:
        metrics: The run's latest metric values.
        tags: The run's tags.
    """
    figures = dict(metrics)
    for key, value in tags.items():
        if key.startswith(FINISHED_TAG_PREFIX):
            try:
                figures[f"run/finished/{key.removeprefix(FINISHED_TAG_PREFIX)}"] = float(value)
            except ValueError:
                continue
    return figures


def experiment_address(
    client: mlflow.MlflowClient, experiment: str, base: str = "http://127.0.0.1:5000"
) -> tuple[str | None, str]:
    """Return the command that serves the store in the MLflow UI (None for a tracking server) and the address of
    experiment ``experiment``'s training runs there, with flasync's runs view when the experiment has it.

    Args:
        client: A client of the store.
        experiment: The experiment's name.
        base: Where ``mlflow ui`` serves the UI; a tracking server's own address is used instead.

    Raises:
        RunLookupError: The store has no experiment of that name.
    """
    found = client.get_experiment_by_name(experiment)
    if found is None:
        names = sorted(e.name for e in client.search_experiments())
        raise RunLookupError(f"no experiment {experiment!r} in the store (it has: {', '.join(names) or 'none'})")
    command = ui_command(client.tracking_uri)
    served = base if command is not None else client.tracking_uri
    view = RUNS_VIEW_KEY if RUNS_VIEW_TAG in found.tags else None
    return command, experiment_url(served, found.experiment_id, view)


def get_run(client: mlflow.MlflowClient, run_id: str) -> Run:
    """Return the run ``run_id``: an MLflow run id, or the journal id a run prints in its first lines
    (``run.started run=ID``, before MLflow has the run), which the run carries as a tag.

    Raises:
        RunLookupError: There is no such run in the store.
    """
    try:
        return client.get_run(run_id)
    except mlflow.exceptions.MlflowException:
        pass
    try:
        found = run_of_journal(client, run_id) if JOURNAL_ID.fullmatch(run_id) else None
        if found is not None:
            return client.get_run(found)
    except mlflow.exceptions.MlflowException:
        pass
    raise RunLookupError(f"no run {run_id!r} in {client.tracking_uri}")


def load_profile(client: mlflow.MlflowClient, run_id: str) -> dict[str, Any] | None:
    """Return the run's ``profile.json`` artifact, or None when the run has none."""
    return _load_json(client, run_id, "profile.json")


def load_client_views(client: mlflow.MlflowClient, run_id: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Return the run's per-client table (``columns`` and ``data``) and its histograms (``tracking.client_table``),
    or None when the run has no table (its histograms are empty when only they are missing)."""
    table = _load_json(client, run_id, TABLE_ARTIFACT)
    if table is None:
        return None
    return table, _load_json(client, run_id, HISTOGRAMS_ARTIFACT) or {}


def _load_json(client: mlflow.MlflowClient, run_id: str, artifact: str) -> dict[str, Any] | None:
    """Return the JSON artifact ``artifact`` of the run, or None when it has none."""
    with tempfile.TemporaryDirectory(prefix="tracking-report-") as tmp:
        try:
            path = client.download_artifacts(run_id, artifact, tmp)
        except Exception:
            return None
        loaded: dict[str, Any] = json.loads(Path(path).read_text())
        return loaded


def _num(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.{digits}g}"
    return str(value)


def _bytes(value: Any) -> str:
    if value is None:
        return "-"
    n = float(value)
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover


def _spread(summary: Mapping[str, Any] | None, fmt: Any = _num) -> str:
    if not summary:
        return "-"
    return f"p50 {fmt(summary['p50'])}  p90 {fmt(summary['p90'])}  max {fmt(summary['max'])}"


def format_report(run_id: str, name: str, metrics: Mapping[str, float], profile: Mapping[str, Any] | None) -> str:
    """Return the text report of one run.

    Args:
        run_id: The run's id.
        name: The run's name.
        metrics: The run's latest metric values and final figures (``run/finished/*`` are used, see
            :func:`final_figures`).
        profile: The run's ``profile.json`` (None: only the headline is printed).
    """
    lines = _headline_lines(run_id, name, metrics)
    if profile is None:
        lines.append("  (no profile.json: the run ended before writing it, or ran with diagnostics.profile off)")
        return "\n".join(lines)
    lines += _time_lines(profile)
    lines += _client_lines(profile["clients"])
    lines += _communication_lines(profile["communication"])
    staleness = profile["staleness"]["summary"]
    lines.append(f"staleness               {_spread(staleness)}")
    lines += _memory_lines(profile["memory"])
    lines += _diagnostics_lines(profile.get("diagnostics") or {}, profile.get("alerts") or {})
    return "\n".join(lines)


def _headline_lines(run_id: str, name: str, metrics: Mapping[str, float]) -> list[str]:
    """Return the report's first lines: the run, its accuracy, updates, versions and time."""
    m = metrics
    return [
        f"run {name} ({run_id})",
        f"  accuracy      {_num(m.get('run/finished/accuracy'))}   loss {_num(m.get('run/finished/loss'))}",
        f"  updates       {_num(m.get('run/finished/updates_accepted'))} accepted, "
        f"{_num(m.get('run/finished/updates_dropped'))} dropped, {_num(m.get('run/finished/updates_failed'))} failed",
        f"  versions      {_num(m.get('run/finished/versions'))}   wall {_num(m.get('run/finished/wall_s'))} s, "
        f"simulated {_num(m.get('run/finished/simulated_s'))} s",
    ]


def _time_lines(profile: Mapping[str, Any]) -> list[str]:
    """Return the lines of the profile's time totals, the server's as shares of the wall time."""
    time = profile["time"]
    totals = time["totals"]
    wall = profile.get("wall_s") or 0.0
    lines = ["time (wall seconds; client columns summed over clients; sim = simulated seconds)"]
    for key, value in totals.items():
        share = f"  ({100 * value / wall:.1f}% of wall)" if key in _SERVER_KEYS and wall else ""
        lines.append(f"  {key:<22}{_num(value)}{share}")
    lines.append(f"  server idle fraction  {_num(time.get('server_idle_fraction'))}")
    return lines


def _client_lines(clients: Mapping[str, Any]) -> list[str]:
    """Return the lines of the profile's ``clients`` section: tasks, their times and the stragglers."""
    lines = [
        f"clients ({clients['participants']} took part, {clients['tasks_completed']} tasks completed, "
        f"{clients['tasks_failed']} failed)"
    ]
    lines.append(f"  task time (sim s)     {_spread(clients['sim_task_s'])}")
    lines.append(f"  compute (wall s)      {_spread(clients['compute_s'])}")
    if clients["stragglers"]:
        lines.append("  stragglers (slowest mean task time):")
        for row in clients["stragglers"]:
            lines.append(
                f"    client {row['client_id']:<6} {_num(row['task_sim_s'])} sim s  "
                f"{_num(row['times_median'], 3)}x the median  ({row['tasks']} tasks)"
            )
    return lines


def _communication_lines(comm: Mapping[str, Any]) -> list[str]:
    """Return the lines of the profile's ``communication`` section: bytes, compression, tiers and clients."""
    lines = [
        f"communication: up {_bytes(comm['upload_bytes'])}, down {_bytes(comm['download_bytes'])}, "
        f"compression up {_num(comm['upload_compression'], 3)}x, down {_num(comm['download_compression'], 3)}x"
    ]
    for tier, figures in comm["per_tier"].items():
        lines.append(
            f"  tier {tier:<10} up {_bytes(figures['upload_bytes'])}, down {_bytes(figures['download_bytes'])}"
        )
    lines.append(f"  per client up         {_spread(comm['upload_bytes_per_client'], _bytes)}")
    lines.append(f"  per client down       {_spread(comm['download_bytes_per_client'], _bytes)}")
    return lines


def _memory_lines(memory: Mapping[str, Any]) -> list[str]:
    """Return the lines of the profile's ``memory`` section: the process, the training calls and the GPUs."""
    lines = [
        f"memory: peak RSS {_bytes(memory.get('peak_rss_bytes'))}, model {_bytes(memory.get('model_bytes'))}, "
        f"gradients {_bytes(memory.get('gradient_bytes'))}, optimizer {_bytes(memory.get('optimizer_bytes'))}, "
        f"aggregator {_bytes(memory.get('aggregator_bytes'))}"
    ]
    lines.append(f"  training call peak    {_spread(memory.get('training_call_peak_bytes'), _bytes)}")
    for gpu in memory.get("gpus") or []:
        lines.append(
            f"  gpu {gpu['index']} {gpu['name']}: {_bytes(gpu['memory_used_bytes'])} used, "
            f"{_num(gpu['utilization_percent'])}% busy"
        )
    return lines


def _diagnostics_lines(diagnostics: Mapping[str, Any], alerts: Mapping[str, Any]) -> list[str]:
    """Return the lines of the alerts raised and the diagnostics' update, weight and per-layer norms."""
    lines = [
        f"diagnostics (level {diagnostics.get('level', '-')}): alerts "
        + (", ".join(f"{k} x{v}" for k, v in sorted(alerts.items())) or "none")
    ]
    if diagnostics.get("update_norm"):
        lines.append(f"  update norm           {_spread(diagnostics['update_norm'])}")
    weights = diagnostics.get("weights") or []
    if weights:
        last = weights[-1]
        lines.append(f"  weights (version {last['version']})  norm {_num(last['norm'])}, drift {_num(last['drift'])}")
    for layer in diagnostics.get("layers") or []:
        lines.append(
            f"  grad norm {layer['name']:<24} mean {_num(layer['grad_norm_mean'])}  max {_num(layer['grad_norm_max'])}"
        )
    for name, norm in (diagnostics.get("layer_weight_norms") or {}).items():
        lines.append(f"  weight norm {name:<22} {_num(norm)}")
    return lines


def format_client_table(run_id: str, name: str, table: Mapping[str, Any], histograms: Mapping[str, Any]) -> str:
    """Return the text view of a run's per-client table (``flasync report --clients``).

    Args:
        run_id: The run's id.
        name: The run's name.
        table: The table artifact: ``columns`` and ``data`` (rows), as :meth:`ClientTable.table` made them.
        histograms: The histograms artifact (empty: only the rows are printed).
    """
    columns = list(table["columns"])
    rows = [dict(zip(columns, row, strict=True)) for row in table["data"]]
    seen = histograms.get("clients_seen")
    sampled = bool(histograms.get("sampled"))
    sample = " (a uniform hash sample)" if sampled else ""
    seen_text = f"~{round(seen)}" if sampled and isinstance(seen, int | float) else _num(seen, 6)
    lines = [
        f"clients of run {name} ({run_id})",
        f"  {histograms.get('rows', len(rows))} rows kept{sample} of {seen_text} clients seen; "
        f"ranked by {histograms.get('rank', '-')}",
    ]
    shown = [c for c in columns if c != "group"]
    for group in ("top", "bottom", "all"):
        chosen = [row for row in rows if row.get("group") == group]
        if chosen:
            title = {"top": "highest", "bottom": "lowest", "all": "every row, highest first"}[group]
            lines.append(f"{title}:")
            lines += _aligned(shown, chosen)
    lines += _histogram_lines(histograms)
    return "\n".join(lines)


def _cell(column: str, value: Any) -> str:
    if column.endswith("_bytes"):
        return _bytes(value)
    return _num(value)


def _aligned(columns: list[str], rows: list[dict[str, Any]]) -> list[str]:
    """Return ``rows`` as lines of right-aligned columns under a header."""
    cells = [[_cell(column, row.get(column)) for column in columns] for row in rows]
    widths = [max(len(column), *(len(line[i]) for line in cells)) for i, column in enumerate(columns)]
    out = ["  " + "  ".join(column.rjust(width) for column, width in zip(columns, widths, strict=True))]
    out += ["  " + "  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)) for line in cells]
    return out


def _histogram_lines(histograms: Mapping[str, Any]) -> list[str]:
    """Return the lines of the per-client distributions, the refusals and the reported figures."""
    lines: list[str] = []
    clients = histograms.get("clients") or {}
    if clients:
        lines.append("per client (over the rows kept)")
        for key, spread in clients.items():
            fmt = _bytes if key.endswith("_bytes") else _num
            lines.append(
                f"  {key:<16} mean {fmt(spread['mean'])}  p10 {fmt(spread['p10'])}  p50 {fmt(spread['p50'])}  "
                f"p90 {fmt(spread['p90'])}"
            )
    heavy = histograms.get("heavy") or []
    if heavy and histograms.get("sampled"):
        rank = histograms.get("rank", "-")
        lines.append(f"heaviest by {rank} over all clients (each at most overstated by the figure in brackets)")
        for row in heavy:
            lines.append(f"  client {row['client_id']:<8} {_num(row[rank])}  (+{row['overstated_by_at_most']})")
    refusals = histograms.get("refusals") or {}
    if refusals:
        lines.append("refusals      " + ", ".join(f"{reason} x{count}" for reason, count in refusals.items()))
    for key, figure in (histograms.get("figures") or {}).items():
        spread = figure["clients"]
        lines.append(
            f"eval.{key:<12} {figure['reports']} reports, mean {_num(figure['mean'])}; per client p10 "
            f"{_num(spread['p10'])}  p50 {_num(spread['p50'])}  p90 {_num(spread['p90'])}"
        )
    return lines


_SERVER_KEYS = frozenset({"decode_s", "aggregate_s", "eval_s", "idle_s"})
