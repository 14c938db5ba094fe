"""Client-side evaluation's summary of one model version: the clients' reports folded into a few figures.

Each report is one client's evaluation of one model version on its own held-out samples: ``n_i`` samples and a
figure ``m_i`` per metric. Per metric, over the ``k`` reports of a version:

- ``mean`` = ``sum_i n_i m_i / sum_i n_i``: the figure over every held-out sample of the reporting clients (what
  FedAvg-style evaluation reports, e.g. McMahan et al. 2017, and Flower's ``weighted_average``);
- ``p10``, ``p50``, ``p90``: percentiles across the clients, one value per report, unweighted (linear interpolation
  between order statistics, NumPy's default): the spread of the clients' experience, as in the fairness literature
  (Li et al., "Fair Resource Allocation in Federated Learning", ICLR 2020, reports the worst 10% of devices);
- ``worst10``: the mean over the worst decile of the reports, the ``ceil(k / 10)`` lowest figures (highest for a
  metric where lower is better: ``loss``, ``mse``, ``mae``), unweighted.

Pure and synchronous: no event loop, no tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from flasync.config.runtime import CLIENT_EVAL_FIGURES as SUMMARY_FIELDS

__all__ = ["LOWER_IS_BETTER", "SUMMARY_FIELDS", "Report", "summarize"]

LOWER_IS_BETTER = frozenset({"loss", "mse", "mae"})
"""Metrics whose worst decile is their highest values."""


@dataclass(frozen=True, slots=True)
class Report:
    """One client's evaluation of one version: its number of samples and its figure per metric."""

    num_samples: int
    figures: Mapping[str, float]


def summarize(reports: Sequence[Report], names: Iterable[str]) -> dict[str, dict[str, float]]:
    """Return, per metric of ``names``, the figures of :data:`SUMMARY_FIELDS` over ``reports`` (see the module).

    Args:
        reports: A version's reports, each with a figure for every name (a report of no sample counts towards the
            percentiles and the worst decile, not towards the mean).
        names: The metrics to summarize.

    Returns:
        ``{name: {"mean": ..., "p10": ..., "p50": ..., "p90": ..., "worst10": ...}}``; NaN figures where there is no
        report (and a NaN mean where no report has a sample).
    """
    weights = np.array([report.num_samples for report in reports], dtype=np.float64)
    total = float(weights.sum())
    out: dict[str, dict[str, float]] = {}
    for name in names:
        values = np.array([report.figures[name] for report in reports], dtype=np.float64)
        if values.size == 0:
            out[name] = dict.fromkeys(SUMMARY_FIELDS, math.nan)
            continue
        p10, p50, p90 = (float(v) for v in np.percentile(values, [10.0, 50.0, 90.0]))
        worst = math.ceil(values.size / 10)
        ordered = np.sort(values)
        tail = ordered[-worst:] if name in LOWER_IS_BETTER else ordered[:worst]
        out[name] = {
            "mean": float(np.dot(weights, values) / total) if total > 0 else math.nan,
            "p10": p10,
            "p50": p50,
            "p90": p90,
            "worst10": float(tail.mean()),
        }
    return out
