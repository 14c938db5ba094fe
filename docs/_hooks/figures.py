"""Render the documentation's measured figures from the stored benchmark results, never typed by hand.

The benchmark scripts store their results as JSON in ``benchmarks/results/`` (``benchmarks/record.py``): each file
names the benchmark, the command, when it ran and the machine (CPU, cores, load average, versions, commit). This
module turns those files into text in two ways:

* the performance page's marker ``<!-- generated: benchmark-results -->`` becomes one section per stored result:
  the machine and the command, the headline figures with their baselines and ratios, and every other figure;
* a figure quoted in prose is written between two markers, ``<!-- figure: RESULT PATH UNIT -->TEXT<!-- /figure -->``:
  ``RESULT`` is a file's stem, ``PATH`` a dotted path into it (``figures.total_s``; ``machine`` gives the machine's
  description), ``UNIT`` how the value is shown (``s``, ``ms``, ``GB``, ``MB``, ``x``, ``%`` or ``-`` for the number
  alone, an integer whole). ``TEXT`` is what this module rendered last.

MkDocs loads this file as a hook (``hooks:`` in ``mkdocs.yml``): the built site always shows the stored results.
The README and the pages on disk are refreshed with ``python docs/_hooks/figures.py`` after a benchmark stored a
new result; ``--check`` exits 1 when a page's figures differ from the results (``tests/docs`` checks the same).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
"""The repository root (``docs/_hooks/`` is two levels below it)."""

RESULTS = ROOT / "benchmarks" / "results"
"""Where the benchmark scripts store their results."""

RESULTS_MARKER = "<!-- generated: benchmark-results -->"

FIGURE = re.compile(
    r"<!-- figure: (?P<result>[\w-]+) (?P<path>[\w.]+)(?: (?P<unit>\S+))? -->(?P<text>.*?)<!-- /figure -->", re.S
)
"""A figure quoted in prose: the marker naming the value, the rendered text, the closing marker."""

_UNITS: dict[str, tuple[float, str]] = {
    "s": (1.0, " s"),
    "ms": (1e-3, " ms"),
    "GB": (1e9, " GB"),
    "MB": (1e6, " MB"),
    "x": (1.0, "x"),
    "%": (0.01, "%"),
    "-": (1.0, ""),
}
_RESERVED = ("benchmark", "command", "measured_at", "machine", "settings", "headline")


class FigureError(ValueError):
    """A figure marker names a result, a path or a unit that is not there."""


def load_results(folder: Path = RESULTS) -> dict[str, dict[str, Any]]:
    """Return every stored result of ``folder`` by file stem: the JSON files that name a benchmark (other JSON files,
    such as recorded golden weights, are not results)."""
    results: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "benchmark" in data:
            results[path.stem] = data
    return results


def number(value: float) -> str:
    """Return a measured value with three significant digits (thousands separated, no exponent)."""
    if value == 0 or not math.isfinite(value):
        return str(value)
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    digits = max(0, 2 - math.floor(math.log10(abs(value))))
    return f"{value:.{digits}f}"


def machine_line(machine: dict[str, Any]) -> str:
    """Describe a machine in one line: CPU, cores, load average when the run started, Python, torch, commit."""
    parts = [f"{machine.get('cpus')}-core {machine.get('cpu') or 'unknown CPU'}"]
    parts.append(f"load average {machine.get('load_average_1m')}")
    parts += [f"{name} {machine[name]}" for name in ("python", "torch", "mlflow") if machine.get(name)]
    if machine.get("commit"):
        parts.append(f"commit {machine['commit']}")
    return ", ".join(parts)


def _bytes(value: float) -> str:
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if abs(value) >= scale:
            return f"{number(value / scale)} {unit}"
    return f"{number(value)} bytes"


def show(value: float, unit: str) -> str:
    """Return a headline value with its unit (bytes shown in kB, MB or GB)."""
    if unit == "bytes":
        return _bytes(value)
    return f"{number(value)}x" if unit == "x" else f"{number(value)} {unit}"


def lookup(results: dict[str, dict[str, Any]], result: str, path: str) -> Any:
    """Return the value at a dotted ``path`` of stored result ``result``.

    Raises:
        FigureError: There is no such result or path.
    """
    if result not in results:
        raise FigureError(f"no stored result {result!r} in {RESULTS.relative_to(ROOT)} (have: {sorted(results)})")
    value: Any = results[result]
    parts = path.split(".")
    while parts:
        if isinstance(value, list) and parts[0].isdigit() and int(parts[0]) < len(value):
            value, parts = value[int(parts[0])], parts[1:]
            continue
        # A key may hold dots itself (a package's name): the longest key that matches is taken.
        taken = next(
            (n for n in range(len(parts), 0, -1) if isinstance(value, dict) and ".".join(parts[:n]) in value), 0
        )
        if not taken:
            raise FigureError(f"result {result!r} has no {path!r}")
        value, parts = value[".".join(parts[:taken])], parts[taken:]
    return value


def figure_text(results: dict[str, dict[str, Any]], result: str, path: str, unit: str | None) -> str:
    """Return what a figure marker shows: the value in ``unit``, or the machine's description for ``machine``."""
    value = lookup(results, result, path)
    if path == "machine":
        return machine_line(value)
    if unit not in _UNITS:
        raise FigureError(f"figure {result} {path}: unit {unit!r} is not one of {sorted(_UNITS)}")
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise FigureError(f"figure {result} {path} is not a number: {value!r}")
    if isinstance(value, int) and unit == "-":  # a count (clients, runs, a version) is shown whole
        return f"{value:,}"
    scale, suffix = _UNITS[unit]
    return number(value / scale) + suffix


def render_figures(text: str, results: dict[str, dict[str, Any]]) -> str:
    """Return ``text`` with every figure marker's text rendered from ``results``."""

    def replace(match: re.Match[str]) -> str:
        shown = figure_text(results, match["result"], match["path"], match["unit"])
        unit = f" {match['unit']}" if match["unit"] else ""
        return f"<!-- figure: {match['result']} {match['path']}{unit} -->{shown}<!-- /figure -->"

    return FIGURE.sub(replace, text)


def flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yield ``(dotted path, value)`` for each scalar leaf of a JSON value; a list of scalars is one leaf."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from flatten(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list) and any(isinstance(item, dict | list) for item in value):
        for index, item in enumerate(value):
            yield from flatten(item, f"{prefix}.{index}")
    else:
        yield prefix, value


def _leaf(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return f"`{json.dumps(value)}`"
    if isinstance(value, float):
        return number(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, list):
        return ", ".join(_leaf(item) for item in value)
    return str(value).replace("|", "\\|")


def result_markdown(name: str, result: dict[str, Any]) -> str:
    """Return one stored result as a section of the performance page."""
    lines = [f"### {name} {{ #result-{name} }}", ""]
    machine = f"a {machine_line(result['machine'])}" if "machine" in result else "a machine it did not describe"
    lines.append(
        f"Measured {result.get('measured_at', 'at an unrecorded time')} on {machine}, "
        f"with `{result.get('command', 'an unrecorded command')}` (stored in `benchmarks/results/{name}.json`)."
    )
    settings = result.get("settings") or {}
    if settings:
        shown = ", ".join(f"`{key}` = `{json.dumps(value)}`" for key, value in settings.items())
        lines[-1] += f" Settings: {shown}."
    lines.append("")
    headline = result.get("headline") or []
    if headline:
        lines += ["| figure | value | baseline (same run) | ratio |", "|---|---|---|---|"]
        for row in headline:
            ratio = "" if row.get("ratio") is None else f"{number(row['ratio'])}x"
            baseline = row.get("baseline") or ""
            lines.append(f"| {row['name']} | {show(row['value'], row['unit'])} | {baseline} | {ratio} |")
        lines.append("")
    rest = result.get("figures") if "figures" in result else {k: v for k, v in result.items() if k not in _RESERVED}
    rows = [f"    | `{path}` | {_leaf(value)} |" for path, value in flatten(rest)]
    if rows:
        lines += [f'??? note "{"Every figure stored" if headline else "The figures stored"} ({len(rows)})"', ""]
        lines += ["    | figure | value |", "    |---|---|", *rows, ""]
    return "\n".join(lines)


def performance_markdown(results: dict[str, dict[str, Any]]) -> str:
    """Return the performance page's generated part: one section per stored result, by benchmark name."""
    if not results:
        return "No benchmark result is stored yet."
    return "\n".join(result_markdown(name, results[name]) for name in sorted(results))


def render_page(markdown: str, results: dict[str, dict[str, Any]]) -> str:
    """Return a page with the results section (where its marker is) and every quoted figure rendered."""
    if RESULTS_MARKER in markdown:
        markdown = markdown.replace(RESULTS_MARKER, performance_markdown(results))
    return render_figures(markdown, results)


def pages() -> list[Path]:
    """Return the pages that may quote figures: the README and every page under ``docs/``."""
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "_hooks" not in p.parts)]


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Render the stored results into a page (MkDocs hook)."""
    return render_page(markdown, load_results())


def main(argv: list[str] | None = None) -> int:
    """Rewrite the figures quoted in the README and the docs from the stored results (``--check``: only compare)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 when a page's figures are not the stored ones")
    args = parser.parse_args(argv)
    results = load_results()
    stale = []
    for page in pages():
        text = page.read_text()
        rendered = render_figures(text, results)
        if rendered != text:
            stale.append(str(page.relative_to(ROOT)))
            if not args.check:
                page.write_text(rendered)
    verb = "differ from the stored results" if args.check else "rewritten"
    print(f"{verb}: {', '.join(stale)}" if stale else "every quoted figure is the stored one")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
