"""Charts as SVG, drawn in plain Python: lines, filled or outlined steps and dashed rules on linear axes.

A run's plots are drawn where the run ends, while its user waits. Drawn with matplotlib, each took 40-100 ms of CPU
(text layout, rasterising, PNG compression) after an import of tens of thousands of objects, which had to happen in
another process so that the training process's garbage collector never met them. The charts a run logs are a few
fixed kinds, and SVG leaves text, antialiasing and scaling to the viewer (MLflow's artifact view shows ``.svg`` files
as images): building the document takes about a millisecond in the process that has the figures, and the file is
sharp at any zoom.

:func:`render` lays out one or more :class:`Panel` side by side, each holding :class:`Line`, :class:`Stairs`,
:class:`VLine` and :class:`HLine` series; :func:`histogram` and :func:`nice_ticks` are the pure helpers it and its
callers use.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from xml.sax.saxutils import escape, quoteattr

__all__ = ["PALETTE", "HLine", "Line", "Panel", "Stairs", "VLine", "histogram", "nice_ticks", "render"]

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
"""Series colours, in the order series without a colour of their own take them (matplotlib's ``tab10``)."""

_FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
_CHAR_EM = 0.6  # a character's mean advance in that font, in ems: enough to lay out labels without font metrics
_TICK_FONT, _LABEL_FONT, _TITLE_FONT, _LEGEND_FONT = 11, 12, 14, 11
_MAX_MARKERS = 200  # a line with more points than this draws none (they would merge into a band)


@dataclass(frozen=True, slots=True, kw_only=True)
class Line:
    """A polyline through ``(xs[i], ys[i])``; a point with a coordinate that is not finite breaks it.

    Args:
        xs: The x coordinates.
        ys: The y coordinates, as many.
        label: The legend's entry (None: none).
        color: A CSS colour (None: the panel's next of :data:`PALETTE`).
        markers: Draw a dot at each point (only up to 200 points).
    """

    xs: Sequence[float]
    ys: Sequence[float]
    label: str | None = None
    color: str | None = None
    markers: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Stairs:
    """Steps: ``values[i]`` over ``[edges[i], edges[i + 1])``, filled down to ``baseline`` or outlined.

    Args:
        values: One height per step.
        edges: ``len(values) + 1`` increasing x coordinates.
        baseline: Where each step's fill ends: one value for all, or one per step (stacked series).
        fill: Fill the steps (else draw their top outline).
        label: The legend's entry (None: none).
        color: A CSS colour (None: the panel's next of :data:`PALETTE`).
    """

    values: Sequence[float]
    edges: Sequence[float]
    baseline: float | Sequence[float] = 0.0
    fill: bool = True
    label: str | None = None
    color: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class _Rule:
    """A dashed line across a panel: its legend's entry (None: none) and its CSS colour."""

    label: str | None = None
    color: str = "#000000"


@dataclass(frozen=True, slots=True, kw_only=True)
class VLine(_Rule):
    """A dashed vertical line across the panel at ``x`` (a median, a deadline); ``label`` and ``color`` as for
    every line."""

    x: float


@dataclass(frozen=True, slots=True, kw_only=True)
class HLine(_Rule):
    """A dashed horizontal line across the panel at ``y`` (a target, a threshold); ``label`` and ``color`` as for
    every line."""

    y: float


Series = Line | Stairs | VLine | HLine
"""What a panel draws."""

_Map = Callable[[float], float]  # data to pixel coordinates, along one axis


@dataclass(frozen=True, slots=True, kw_only=True)
class Panel:
    """One set of axes: its series, drawn in order (the first one lowest), and its texts.

    Args:
        series: What is drawn.
        title: Above the axes ("" for none).
        xlabel: Below the x axis.
        ylabel: Beside the y axis.
        grid: Draw light lines at the ticks.
        integer_x: Ticks of the x axis at whole numbers only (versions, counts).
    """

    series: Sequence[Series] = field(default_factory=tuple)
    title: str = ""
    xlabel: str = ""
    ylabel: str = ""
    grid: bool = False
    integer_x: bool = False


def nice_ticks(low: float, high: float, target: int = 5, *, integer: bool = False) -> list[float]:
    """Return the round values (steps of 1, 2, 2.5 or 5 times a power of ten) in ``[low, high]``: at most
    ``target + 1`` of them, at least two for any ``low < high`` (with ``integer``, whole numbers only: there may be
    one, or none, in a short span).

    Args:
        low: The axis's lower limit.
        high: Its upper limit (above ``low``).
        target: The most intervals between ticks.
        integer: Ticks at whole numbers only (an axis of versions or counts).
    """
    step = _tick_step(low, high, target)
    if integer:  # every step from 1 on is whole but 2.5
        step = 1.0 if step < 1 else 2.0 if step == 2.5 else step
    first = math.ceil(low / step - 1e-9)
    last = math.floor(high / step + 1e-9)
    return [0.0 if i == 0 else i * step for i in range(first, last + 1)]


def _tick_step(low: float, high: float, target: int) -> float:
    raw = (high - low) / target
    magnitude = 10.0 ** math.floor(math.log10(raw))
    for multiple in (1.0, 2.0, 2.5, 5.0):
        if raw <= multiple * magnitude * (1 + 1e-9):
            return multiple * magnitude
    return 10.0 * magnitude


def histogram(samples: Sequence[float], bins: int) -> tuple[list[int], list[float]]:
    """Count ``samples`` in ``bins`` equal bins from their least to their greatest; return ``(counts, edges)``.

    Non-finite samples are left out; with no finite sample, one empty bin over ``[0, 1]``. The greatest sample falls
    in the last bin (its upper edge is included, as NumPy's ``histogram`` counts).

    Args:
        samples: The values.
        bins: How many bins (at least 1).
    """
    finite = [s for s in samples if math.isfinite(s)]
    if not finite:
        return [0], [0.0, 1.0]
    low, high = min(finite), max(finite)
    if high == low:
        low, high = low - 0.5, high + 0.5
    width = (high - low) / bins
    counts = [0] * bins
    for sample in finite:
        counts[min(bins - 1, int((sample - low) / width))] += 1
    return counts, [low + i * width for i in range(bins)] + [high]


def render(panels: Sequence[Panel], *, width: int = 1000, height: int = 400, title: str = "") -> str:
    """Draw ``panels`` side by side, equal in width, under ``title``; return the SVG document.

    Each panel's axes fit its data (with a margin, none below a fill's baseline). A legend of the labelled series
    (each label once, from whichever panel) sits under the title, across the picture, in as many rows as it needs,
    so that every panel's axes start at the same height; the picture grows by the legend's height rather than
    squeezing the axes. Raises nothing for odd data: NaN or infinite points are left out, an empty panel gets axes
    from 0 to 1.

    Args:
        panels: At least one.
        width: The picture's width, in pixels.
        height: Its height without the legend, in pixels.
        title: Above every panel ("" for none).

    Raises:
        ValueError: No panel.
    """
    if not panels:
        raise ValueError("a chart needs at least one panel")
    colored = [_colored(panel) for panel in panels]
    legend: list[tuple[str, str, Series]] = []
    for pairs in colored:
        for s, color in pairs:
            if s.label and all(s.label != label for label, _, _ in legend):
                legend.append((s.label, color, s))
    rows = _legend_rows([label for label, _, _ in legend], width - 24)
    legend_height = 8 + len(rows) * 18 if rows else 0
    plot_height = height
    height += legend_height
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}"'
        f' font-family="{_FONT}">',
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
    ]
    top = 0.0
    if title:
        out.append(_text(width / 2, 24, title, _TITLE_FONT, anchor="middle"))
        top = 32.0
    if rows:
        _legend(out, rows, legend, width / 2, top + 4)
    panel_width = width / len(panels)
    for i, (panel, pairs) in enumerate(zip(panels, colored, strict=True)):
        _panel(out, panel, pairs, f"p{i}", i * panel_width, top + legend_height, panel_width, plot_height - top)
    out.append("</svg>\n")
    return "\n".join(out)


def _colored(panel: Panel) -> list[tuple[Series, str]]:
    """Return the panel's series with their colours: their own, or the palette's next (panels listing the same
    series in the same order colour them alike)."""
    colors = itertools.cycle(PALETTE)
    return [(s, s.color if s.color is not None else next(colors)) for s in panel.series]


def _panel(
    out: list[str],
    panel: Panel,
    series: list[tuple[Series, str]],
    ident: str,
    x0: float,
    y0: float,
    width: float,
    height: float,
) -> None:
    """Append one panel's axes and ``series`` (with their colours), inside the box at ``(x0, y0)`` of ``width`` x
    ``height`` pixels."""
    (xlo, xhi), (ylo, yhi) = _limits(panel.series)
    xticks, yticks = nice_ticks(xlo, xhi, integer=panel.integer_x), nice_ticks(ylo, yhi)
    xlabels, ylabels = _labels(xticks, xlo, xhi, integer=panel.integer_x), _labels(yticks, ylo, yhi)

    widest = max((len(label) for label in ylabels), default=1)
    left = x0 + 10 + (_LABEL_FONT + 8 if panel.ylabel else 0) + widest * _CHAR_EM * _TICK_FONT + 8
    right = x0 + width - 16
    top = y0 + 10 + (_TITLE_FONT + 10 if panel.title else 0)
    bottom = y0 + height - 12 - (_LABEL_FONT + 8 if panel.xlabel else 0) - _TICK_FONT - 8

    def sx(x: float) -> float:
        return left + (x - xlo) / (xhi - xlo) * (right - left)

    def sy(y: float) -> float:
        return bottom - (y - ylo) / (yhi - ylo) * (bottom - top)

    if panel.title:
        out.append(_text((left + right) / 2, y0 + 10 + _TITLE_FONT, panel.title, _TITLE_FONT, anchor="middle"))
    if panel.grid:
        grid = [f"M{sx(t):.1f} {top:.1f}V{bottom:.1f}" for t in xticks]
        grid += [f"M{left:.1f} {sy(t):.1f}H{right:.1f}" for t in yticks]
        out.append(f'<path d="{"".join(grid)}" stroke="#dddddd" stroke-width="1" fill="none"/>')
    out.append(
        f'<clipPath id="{ident}"><rect x="{left:.1f}" y="{top:.1f}" width="{right - left:.1f}"'
        f' height="{bottom - top:.1f}"/></clipPath>'
    )
    out.append(f'<g clip-path="url(#{ident})">')
    for s, color in series:
        _series(out, s, color, sx, sy, (left, top, right, bottom))
    out.append("</g>")
    out.append(
        f'<rect x="{left:.1f}" y="{top:.1f}" width="{right - left:.1f}" height="{bottom - top:.1f}"'
        ' fill="none" stroke="#333333" stroke-width="1"/>'
    )
    ticks = [f"M{sx(t):.1f} {bottom:.1f}v4" for t in xticks] + [f"M{left:.1f} {sy(t):.1f}h-4" for t in yticks]
    out.append(f'<path d="{"".join(ticks)}" stroke="#333333" stroke-width="1"/>')
    for t, label in zip(xticks, xlabels, strict=True):
        out.append(_text(sx(t), bottom + 6 + _TICK_FONT, label, _TICK_FONT, anchor="middle"))
    for t, label in zip(yticks, ylabels, strict=True):
        out.append(_text(left - 7, sy(t) + _TICK_FONT * 0.35, label, _TICK_FONT, anchor="end"))
    if panel.xlabel:
        below = bottom + 6 + _TICK_FONT + 8 + _LABEL_FONT
        out.append(_text((left + right) / 2, below, panel.xlabel, _LABEL_FONT, anchor="middle"))
    if panel.ylabel:
        x, y = x0 + 10 + _LABEL_FONT, (top + bottom) / 2
        out.append(_text(x, y, panel.ylabel, _LABEL_FONT, anchor="middle", rotate=True))


def _limits(series: Sequence[Series]) -> tuple[tuple[float, float], tuple[float, float]]:
    """Return the axes' limits ``((xlo, xhi), (ylo, yhi))`` that show every finite point of ``series``."""
    xs: list[float] = []
    ys: list[float] = []
    floors: list[float] = []  # fill baselines: the y axis starts there, with no margin below
    for s in series:
        if isinstance(s, Line):
            points = [(x, y) for x, y in zip(s.xs, s.ys, strict=True) if math.isfinite(x) and math.isfinite(y)]
            xs += [x for x, _ in points]
            ys += [y for _, y in points]
        elif isinstance(s, Stairs):
            xs += [e for e in s.edges if math.isfinite(e)]
            ys += [v for v in s.values if math.isfinite(v)]
            base = [s.baseline] if isinstance(s.baseline, int | float) else list(s.baseline)
            if s.fill:  # an outline has no baseline to show
                floors += [b for b in base if math.isfinite(b)]
                ys += [b for b in base if math.isfinite(b)]
        elif isinstance(s, VLine):
            xs += [s.x] if math.isfinite(s.x) else []
        elif math.isfinite(s.y):
            ys.append(s.y)
    return _padded(xs, None), _padded(ys, min(floors) if floors else None)


def _padded(values: list[float], floor: float | None) -> tuple[float, float]:
    """Return limits 5% of the span beyond the least and greatest value (none below ``floor`` when it is the least)."""
    if not values:
        return 0.0, 1.0
    low, high = min(values), max(values)
    if high == low:
        if low == 0:
            return 0.0, 1.0
        half = abs(low) * 0.05
        low, high = low - half, high + half
    pad = (high - low) * 0.05
    return (low if floor is not None and floor <= low else low - pad), high + pad


def _labels(ticks: Sequence[float], low: float, high: float, *, integer: bool = False) -> list[str]:
    """Format the ticks alike: as many decimals as their step needs (none for ``integer`` ones), from 10,000 on in
    thousands (``k``), millions (``M``) or billions (``G``), below 0.001 in scientific notation."""
    step = _tick_step(low, high, 5)
    if integer:
        step = max(step, 1.0)
    biggest = max(abs(low), abs(high))
    if biggest < 1e-3:
        return ["0" if tick == 0 else f"{tick:.3g}" for tick in ticks]
    scale, suffix = 1.0, ""
    for factor, name, above in ((1e9, "G", 1e9), (1e6, "M", 1e6), (1e3, "k", 1e4)):
        if biggest >= above:
            scale, suffix = factor, name
            break
    decimals = max(0, -math.floor(math.log10(step / scale) + 1e-9))
    while decimals < 12 and abs(step / scale * 10**decimals - round(step / scale * 10**decimals)) > 1e-6:
        decimals += 1  # a step of 0.25 needs two
    labels = []
    for tick in ticks:
        text = f"{tick / scale:.{decimals}f}"
        labels.append(("0" if float(text) == 0 else text) + (suffix if float(text) != 0 else ""))
    return labels


def _series(out: list[str], s: Series, color: str, sx: _Map, sy: _Map, box: tuple[float, float, float, float]) -> None:
    """Append one series' drawing; ``box`` is the axes' ``(left, top, right, bottom)`` in pixels."""
    left, top, right, bottom = box
    if isinstance(s, Line):
        runs: list[list[tuple[float, float]]] = [[]]
        for x, y in zip(s.xs, s.ys, strict=True):
            if math.isfinite(x) and math.isfinite(y):
                runs[-1].append((sx(x), sy(y)))
            elif runs[-1]:
                runs.append([])
        d = "".join("M" + "L".join(f"{x:.1f} {y:.1f}" for x, y in run) for run in runs if run)
        if d:
            out.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="1.5" stroke-linejoin="round"/>')
        points = [p for run in runs for p in run]
        if not s.markers:  # a lone point draws no line: a dot shows it
            points = [run[0] for run in runs if len(run) == 1]
        if points and len(points) <= _MAX_MARKERS:
            dots = "".join(f"M{x - 3:.1f} {y:.1f}a3 3 0 1 0 6 0a3 3 0 1 0 -6 0" for x, y in points)
            out.append(f'<path d="{dots}" fill="{color}"/>')
    elif isinstance(s, Stairs):
        n = len(s.values)
        base = [float(s.baseline)] * n if isinstance(s.baseline, int | float) else [float(b) for b in s.baseline]
        steps = [
            (sx(s.edges[i]), sx(s.edges[i + 1]), sy(s.values[i]), sy(base[i]))
            for i in range(n)
            if math.isfinite(s.values[i]) and math.isfinite(base[i])
        ]
        if not steps:
            return
        if s.fill:
            # Along the tops left to right, back along the baselines: one shape, however many steps.
            d = f"M{steps[0][0]:.1f} {steps[0][3]:.1f}" + "".join(f"V{y:.1f}H{b:.1f}" for _, b, y, _ in steps)
            d += "".join(f"V{base_y:.1f}H{a:.1f}" for a, _, _, base_y in reversed(steps)) + "Z"
            out.append(f'<path d="{d}" fill="{color}" stroke="none"/>')
        else:
            # The tops and the rises between them, not down to the baseline at the ends: an outline is a line.
            d = f"M{steps[0][0]:.1f} {steps[0][2]:.1f}" + "".join(f"V{y:.1f}H{b:.1f}" for _, b, y, _ in steps)
            out.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="1.5"/>')
    elif isinstance(s, VLine):
        if math.isfinite(s.x):
            out.append(
                f'<path d="M{sx(s.x):.1f} {top:.1f}V{bottom:.1f}" stroke="{color}" stroke-width="1.5"'
                ' stroke-dasharray="6 4"/>'
            )
    elif math.isfinite(s.y):
        out.append(
            f'<path d="M{left:.1f} {sy(s.y):.1f}H{right:.1f}" stroke="{color}" stroke-width="1"'
            ' stroke-dasharray="6 4"/>'
        )


def _legend_rows(labels: Sequence[str], width: float) -> list[list[int]]:
    """Split the legend's entries (by index) into rows no wider than ``width`` pixels."""
    rows: list[list[int]] = []
    used = width
    for i, label in enumerate(labels):
        entry = _entry_width(label)
        if used + entry > width and (not rows or rows[-1]):
            rows.append([])
            used = 0.0
        rows[-1].append(i)
        used += entry
    return rows


def _entry_width(label: str) -> float:
    return 18 + len(label) * _CHAR_EM * _LEGEND_FONT + 16


def _legend(
    out: list[str], rows: list[list[int]], legend: list[tuple[str, str, Series]], middle: float, y: float
) -> None:
    """Append the legend's rows, each centred on ``middle``, the first one's top at ``y``."""
    for row in rows:
        x = middle - sum(_entry_width(legend[i][0]) for i in row) / 2 + 8
        for i in row:
            label, color, s = legend[i]
            if isinstance(s, Stairs) and s.fill:
                out.append(f'<rect x="{x:.1f}" y="{y + 3:.1f}" width="14" height="10" fill="{color}"/>')
            else:
                dash = ' stroke-dasharray="4 2"' if isinstance(s, VLine | HLine) else ""
                out.append(f'<path d="M{x:.1f} {y + 8:.1f}h14" stroke="{color}" stroke-width="2"{dash}/>')
            out.append(_text(x + 18, y + 12, label, _LEGEND_FONT))
            x += _entry_width(label)
        y += 18


def _text(x: float, y: float, text: str, size: int, *, anchor: str = "start", rotate: bool = False) -> str:
    turn = f' transform="rotate(-90 {x:.1f} {y:.1f})"' if rotate else ""
    # XML has no place for control characters (a run name may hold one): each becomes a space.
    clean = escape(text.translate(_CONTROLS))
    return f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor={quoteattr(anchor)}{turn}>{clean}</text>'


_CONTROLS = {code: " " for code in [*range(0x20), 0x7F]}
"""Characters XML 1.0 does not allow in text (tabs and line breaks too: a label is one line)."""
