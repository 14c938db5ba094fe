"""How flasync runs are shown in MLflow's runs table: the columns a user compares runs by.

The view is saved on each experiment flasync logs to (see :class:`tracking.MlflowTracker`'s ``runs_view``) and the
command's summary prints the address that opens it; without it MLflow's table shows no metric at all.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RUNS_VIEW"]


def _metric(key: str) -> str:
    return f"metrics.`{key}`"


def _param(key: str) -> str:
    return f"params.`{key}`"


RUNS_VIEW: dict[str, Any] = {
    "selectedColumns": [
        "attributes.`Dataset`",
        "attributes.`Source`",
        _param("server.kind"),
        # The last evaluation's figures (the UI sorts metric columns by name, so accuracy comes first).
        _metric("server/eval/accuracy"),
        _metric("server/eval/loss"),
        _metric("server/eval/simulated_s"),
        _metric("server/eval/updates"),
        _metric("server/eval/wall_s"),
    ],
    "orderByKey": "attributes.start_time",
    "orderByAsc": False,
}
"""The runs-table state MLflow's UI shares: these columns, newest run first."""
