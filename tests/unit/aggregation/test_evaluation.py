"""Client-side evaluation's summary of a version: the figures over a tiny population, by hand."""

from __future__ import annotations

import math

import pytest

from flasync.aggregation.evaluation import Report, summarize


def test_the_figures_of_a_tiny_population_match_a_hand_computation() -> None:
    """Four clients: the mean weights by samples, percentiles interpolate, the worst decile is the worst client."""
    reports = [
        Report(10, {"accuracy": 0.5, "loss": 1.0}),
        Report(30, {"accuracy": 0.9, "loss": 0.2}),
        Report(20, {"accuracy": 0.7, "loss": 0.6}),
        Report(40, {"accuracy": 0.8, "loss": 0.4}),
    ]
    got = summarize(reports, ["accuracy", "loss"])
    # sorted accuracies 0.5 0.7 0.8 0.9: position p * 3 -> p10 at 0.3: 0.5 + 0.3 * 0.2; p50 at 1.5; p90 at 2.7
    assert got["accuracy"] == pytest.approx(
        {
            "mean": (10 * 0.5 + 30 * 0.9 + 20 * 0.7 + 40 * 0.8) / 100,
            "p10": 0.56,
            "p50": 0.75,
            "p90": 0.87,
            "worst10": 0.5,
        }
    )
    # loss: lower is better, so its worst decile is the highest loss
    assert got["loss"]["worst10"] == 1.0
    assert got["loss"]["mean"] == pytest.approx((10 * 1.0 + 30 * 0.2 + 20 * 0.6 + 40 * 0.4) / 100)


def test_the_worst_decile_of_eleven_clients_is_the_two_worst() -> None:
    """ceil(11 / 10) = 2 reports make the worst decile: their unweighted mean."""
    reports = [Report(1, {"accuracy": a / 10}) for a in range(11)]
    assert summarize(reports, ["accuracy"])["accuracy"]["worst10"] == pytest.approx((0.0 + 0.1) / 2)


def test_no_report_gives_nan_and_no_sample_gives_a_nan_mean() -> None:
    """A version without reports has NaN figures; reports of no sample have percentiles but no mean."""
    assert all(math.isnan(v) for v in summarize([], ["accuracy"])["accuracy"].values())
    empty = summarize([Report(0, {"accuracy": 0.0})], ["accuracy"])["accuracy"]
    assert math.isnan(empty["mean"]) and empty["p50"] == 0.0
