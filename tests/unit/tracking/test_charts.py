"""SVG charts in plain Python: round ticks, histograms, and documents that parse, whatever the data."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import pytest

from flasync.tracking.charts import Line, Panel, Stairs, VLine, histogram, nice_ticks, render
from flasync.tracking.charts import _labels as labels

SVG = "{http://www.w3.org/2000/svg}"


@pytest.mark.parametrize(
    ("low", "high", "ticks"),
    [
        (0.0, 1.7, [0.0, 0.5, 1.0, 1.5]),
        (0.0, 1.05, [0.0, 0.25, 0.5, 0.75, 1.0]),
        (-0.3, 0.3, [-0.2, 0.0, 0.2]),
        (0.0, 43_000.0, [0.0, 10_000.0, 20_000.0, 30_000.0, 40_000.0]),
        (5.0, 5.4, [5.0, 5.1, 5.2, 5.3, 5.4]),
    ],
)
def test_ticks_are_round_values_inside_the_limits(low: float, high: float, ticks: list[float]) -> None:
    """Ticks step by 1, 2, 2.5 or 5 times a power of ten and stay within the axis."""
    assert nice_ticks(low, high) == pytest.approx(ticks)


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [
        (0.0, 1.05, ["0", "0.25", "0.50", "0.75", "1.00"]),
        (0.0, 0.0176, ["0", "0.005", "0.010", "0.015"]),
        (0.0, 1500.0, ["0", "500", "1000", "1500"]),
        (0.0, 43_000.0, ["0", "10k", "20k", "30k", "40k"]),
        (0.0, 2.6e6, ["0", "1M", "2M"]),
        (1e-7, 3e-7, ["1e-07", "1.5e-07", "2e-07", "2.5e-07", "3e-07"]),
    ],
)
def test_tick_labels_share_their_decimals_and_shorten_large_numbers(
    low: float, high: float, expected: list[str]
) -> None:
    """Labels have the decimals their step needs (no more), thousands and millions as k and M."""
    assert labels(nice_ticks(low, high), low, high) == expected


def test_histogram_counts_every_finite_sample_once() -> None:
    """Equal bins from the least to the greatest sample; the greatest falls in the last bin; NaN is left out."""
    counts, edges = histogram([0.0, 1.0, 1.5, 2.0, 4.0, math.nan], 4)
    assert counts == [1, 2, 1, 1]
    assert edges == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert histogram([3.0, 3.0], 2) == ([0, 2], [2.5, 3.0, 3.5])
    assert histogram([], 3) == ([0], [0.0, 1.0])


def test_a_document_parses_and_holds_its_texts() -> None:
    """Titles, labels, legend entries and tick labels are text elements of a well-formed SVG document; text is
    escaped, and a control character (not allowed in XML) becomes a space."""
    panel = Panel(
        series=[
            Stairs(values=[1.0, 3.0], edges=[0.0, 1.0, 2.0], label="a < b"),
            Stairs(values=[2.0, 4.0], edges=[0.0, 1.0, 2.0], baseline=[1.0, 3.0], label="stacked"),
            VLine(x=1.5, label="p50"),
        ],
        title="T & t",
        xlabel="version",
        ylabel="seconds",
    )
    root = ET.fromstring(render([panel], width=600, title="Top\x00run\n"))
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert {"Top run ", "T & t", "version", "seconds", "a < b", "stacked", "p50"} <= set(texts)
    assert root.get("width") == "600"


def test_odd_data_draws_an_empty_or_partial_chart() -> None:
    """No points, one point and points that are not finite give a chart, not an error; a line breaks at NaN."""
    render([Panel()])
    render([Panel(series=[Line(xs=[1.0], ys=[1.0], markers=True)])])
    document = render([Panel(series=[Line(xs=[0.0, 1.0, 2.0, 3.0], ys=[1.0, math.nan, 2.0, math.inf])])])
    root = ET.fromstring(document)
    lines = [p.get("d", "") for p in root.iter(f"{SVG}path") if p.get("stroke-linejoin") == "round"]
    assert len(lines) == 1 and lines[0].count("M") == 2  # two runs of finite points
    assert "nan" not in document.lower() and "inf" not in document.lower()


def test_a_long_legend_wraps_into_rows_and_makes_the_picture_taller() -> None:
    """A legend wider than the picture takes more rows above the axes; the picture grows by them, so the axes keep
    the height of a chart without a legend."""

    def frame(root: ET.Element) -> tuple[float, float]:
        [rect] = [r for r in root.iter(f"{SVG}rect") if r.get("stroke") == "#333333"]
        return float(rect.get("y", 0)), float(rect.get("height", 0))

    many = [Line(xs=[0.0, 1.0], ys=[0.0, 1.0], label=f"series number {i}") for i in range(12)]
    root = ET.fromstring(render([Panel(series=many)], width=400, height=300))
    legend_y = {float(t.get("y", 0)) for t in root.iter(f"{SVG}text") if (t.text or "").startswith("series")}
    assert len(legend_y) > 2
    top, height = frame(root)
    assert top > max(legend_y)
    plain = ET.fromstring(render([Panel(series=[Line(xs=[0.0, 1.0], ys=[0.0, 1.0])])], width=400, height=300))
    assert height == frame(plain)[1]
    assert float(root.get("height", 0)) > float(plain.get("height", 0)) == 300


def test_a_chart_needs_a_panel() -> None:
    """No panel at all is a ValueError, not a division by zero."""
    with pytest.raises(ValueError, match="at least one panel"):
        render([])


def test_integer_ticks_are_whole_numbers() -> None:
    """An axis of versions or counts gets ticks at whole numbers only: one in a short span, steps of 2 not 2.5."""
    assert nice_ticks(0.5, 1.5, integer=True) == [1.0]
    assert nice_ticks(0.0, 12.0, integer=True) == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0]
    assert nice_ticks(0.0, 1000.0, integer=True) == nice_ticks(0.0, 1000.0)
    assert labels([1.0], 0.5, 1.5, integer=True) == ["1"]


def test_a_lone_point_is_drawn_as_a_dot() -> None:
    """A line of one point (a run evaluated once) draws no visible path: it gets a dot."""
    root = ET.fromstring(render([Panel(series=[Line(xs=[0.0], ys=[0.4], color="#123456")])]))
    dots = [p for p in root.iter(f"{SVG}path") if p.get("fill") == "#123456"]
    assert len(dots) == 1 and dots[0].get("d", "").count("a3 3") == 2


def test_an_outline_is_scaled_to_its_values_not_its_baseline() -> None:
    """Outlined steps (bytes that vary by a few) are not drawn down to 0, nor is the axis stretched to it; a span of
    zero at 0 gets the axis 0 to 1."""
    root = ET.fromstring(render([Panel(series=[Stairs(values=[1238.0, 1250.0], edges=[0.0, 1.0, 2.0], fill=False)])]))
    y_labels = [t.text for t in root.iter(f"{SVG}text") if t.get("text-anchor") == "end"]
    assert y_labels == ["1240", "1245", "1250"]
    flat = ET.fromstring(render([Panel(series=[Line(xs=[0.0, 0.0], ys=[0.0, 0.0])])]))
    assert {"0", "1.0"} <= {t.text for t in flat.iter(f"{SVG}text")}
