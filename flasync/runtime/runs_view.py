"""How flasync runs are shown in MLflow's experiment page: the columns a user compares runs by, evaluation first.

The view is saved on each experiment flasync logs to (see :class:`tracking.MlflowTracker`'s ``runs_view``) and the
command's summary prints the address that opens it; without it MLflow's table shows no metric at all. It also lays
out the page's chart view: MLflow groups metric charts in one section per key prefix and sorts the sections by name,
which would put the evaluation (``server/eval``) third, after ``client`` and ``profile/version`` (a run's final
figures are tags, not a section of one-point charts); the view lists the sections in flasync's order instead, the
evaluation's accuracy and loss first. (MLflow 3.17 keeps a single run's chart layout in the browser only, sorted by
name: there the evaluation section stays where its name puts it.)
"""

from __future__ import annotations

from typing import Any

__all__ = ["CHART_SECTIONS", "RUNS_VIEW"]


def _metric(key: str) -> str:
    return f"metrics.`{key}`"


def _param(key: str) -> str:
    return f"params.`{key}`"


CHART_SECTIONS = (
    "server/eval",
    "client",
    "server/update",
    "server/version",
    "profile/version",
    "Model metrics",  # MLflow's name for keys without a prefix
    "System metrics",  # MLflow's name for system/ keys
)
"""The chart view's sections in order (MLflow adds sections of other keys after them)."""


def _section(name: str) -> dict[str, Any]:
    return {
        "uuid": f"flasync-{name.replace('/', '-').replace(' ', '-').lower()}",
        "name": name,
        "display": True,
        # In a section marked reordered MLflow appends charts of further keys after the given ones (the accuracy
        # and the loss first); elsewhere it sorts them by name.
        "isReordered": name == "server/eval",
        "deleted": False,
        "isGenerated": True,
    }


def _line_chart(key: str, section: str) -> dict[str, Any]:
    """A line chart of ``key`` against the step (the model version), as MLflow's UI makes one."""
    return {
        "uuid": f"flasync-chart-{key.replace('/', '-')}",
        "type": "LINE",
        "runsCountToCompare": 10,
        "metricSectionId": _section(section)["uuid"],
        "deleted": False,
        "isGenerated": True,
        "metricKey": key,
        "lineSmoothness": 0,
        "xAxisScaleType": "linear",
        "scaleType": "linear",
        "xAxisKey": "step",
        "selectedXAxisMetricKey": "",
        "yAxisKey": "metric",
        "yAxisExpressions": [],
        "ignoreOutliers": False,
        "useGlobalXaxisKey": True,
        "useGlobalLineSmoothing": True,
    }


RUNS_VIEW: dict[str, Any] = {
    "selectedColumns": [
        # No Source or Dataset column (the entry point; the data set, on the run page and in the Datasets filter):
        # MLflow puts them before the metrics, and without them the accuracy fits a laptop's screen.
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
    # The chart view: sections in CHART_SECTIONS' order (kept, as a user's reordering would be), the evaluation's
    # charts given; MLflow adds a chart for every other key to its section.
    "compareRunSections": [_section(name) for name in CHART_SECTIONS],
    "compareRunCharts": [_line_chart(f"server/eval/{name}", "server/eval") for name in ("accuracy", "loss")],
    "isAccordionReordered": True,
}
"""The experiment page state MLflow's UI shares: these columns, newest run first, the evaluation's charts first."""
