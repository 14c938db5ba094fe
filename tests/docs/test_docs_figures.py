"""Measured figures in the docs: the performance page and every quoted figure are the stored benchmark results."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from benchmarks.record import Figure, machine, store

ROOT = Path(__file__).resolve().parents[2]
_SECTION = re.compile(r"^### (?P<name>[\w-]+) \{ #result-(?P=name) \}$")
_HEADLINE_ROW = re.compile(
    r"^\| (?P<name>[^|]+) \| (?P<value>[-\d.,]+)(?P<unit>x| [^|]+) \| [^|]* \| (?P<ratio>[^|]*) \|$"
)
_FIGURE_ROW = re.compile(r"^ {4}\| `(?P<path>[^`]+)` \| (?P<text>.*) \|$")
_SCALES = {"GB": 1e9, "MB": 1e6, "kB": 1e3, "bytes": 1.0}


def _figures() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_figures_hook", ROOT / "docs" / "_hooks" / "figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _close(shown: str, stored: float, scale: float = 1.0) -> bool:
    """Whether ``shown`` (a rounded number, maybe with thousands separators) is ``stored / scale`` to its digits."""
    text = shown.replace(",", "")
    decimals = len(text.split(".")[1]) if "." in text else 0
    return abs(float(text) - stored / scale) <= 0.5 * 10**-decimals + 1e-12


def _sections(page: str) -> dict[str, list[str]]:
    """Return the rendered performance page's lines by result section."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in page.splitlines():
        heading = _SECTION.match(line)
        if heading:
            current = sections.setdefault(heading["name"], [])
        elif line.startswith("#"):
            current = None
        elif current is not None:
            current.append(line)
    return sections


def test_performance_page_numbers_are_the_stored_results() -> None:
    """Every stored result has a section naming its machine, and each number shown there is the stored one."""
    figures = _figures()
    results = figures.load_results()
    assert results, "no benchmark result is stored in benchmarks/results/"
    page = figures.render_page((ROOT / "docs" / "performance.md").read_text(), results)
    sections = _sections(page)
    assert set(sections) == set(results)
    for name, result in results.items():
        lines = sections[name]
        assert "machine" in result, f"{name}.json has no machine description: store it with benchmarks/record.py"
        described = result["machine"]
        first = next(line for line in lines if line.strip())
        assert f"{described['cpus']}-core {described['cpu']}, load average {described['load_average_1m']}" in first
        headline = [m for line in lines if (m := _HEADLINE_ROW.match(line)) and m["name"] != "figure"]
        assert [m["name"] for m in headline] == [row["name"] for row in result.get("headline", [])]
        for match, row in zip(headline, result.get("headline", []), strict=True):
            unit = match["unit"].strip()
            scale = _SCALES[unit] if row["unit"] == "bytes" else 1.0
            assert unit == row["unit"] or row["unit"] == "bytes", f"{name}: {match.group(0)}"
            assert _close(match["value"], row["value"], scale), f"{name}: {match.group(0)} against {row}"
            if row.get("ratio") is not None:
                assert _close(match["ratio"].strip().removesuffix("x"), row["ratio"]), f"{name}: {match.group(0)}"
        rows = [m for line in lines if (m := _FIGURE_ROW.match(line)) and m["path"] != "figure"]
        assert rows, f"{name}: no stored figure shown"
        base = "figures." if "figures" in result else ""
        for match in rows:
            stored = figures.lookup(results, name, base + match["path"])
            if isinstance(stored, int | float) and not isinstance(stored, bool):
                assert _close(match["text"], stored), f"{name}: {match.group(0)} against {stored}"


def test_quoted_figures_are_the_stored_ones() -> None:
    """A figure the README or a page quotes between figure markers is the stored value (never typed by hand)."""
    figures = _figures()
    results = figures.load_results()
    stale = [
        str(page.relative_to(ROOT))
        for page in figures.pages()
        if figures.render_figures(page.read_text(), results) != page.read_text()
    ]
    assert not stale, f"figures differ from benchmarks/results/ in {stale}: run python docs/_hooks/figures.py"


def test_every_figure_marker_names_a_value_the_hook_reads() -> None:
    """A figure marker on a page is one the hook can read (a path of letters, digits, ``_`` and ``.``): a marker it
    cannot parse would keep its text, typed, for ever."""
    figures = _figures()
    unread = [
        f"{page.relative_to(ROOT)}: {opening[:80]}"
        for page in figures.pages()
        for text in [page.read_text()]
        for opening in re.findall(r"<!-- figure: [^>]*-->", text)
        if not figures.FIGURE.match(opening + "x<!-- /figure -->")
    ]
    assert not unread, unread


def test_quoted_figures_exist() -> None:
    """The README quotes its install figures from a stored result (the markers are there and name real values)."""
    figures = _figures()
    quoted = figures.FIGURE.findall((ROOT / "README.md").read_text())
    assert {(result, path) for result, path, _, _ in quoted} >= {
        ("install", "figures.total_s"),
        ("install", "figures.venv_bytes"),
        ("install", "machine"),
    }


def _result(tmp_path: Path) -> dict[str, dict[str, Any]]:
    store(
        "demo",
        machine(),
        settings={"repeats": 3},
        headline=[Figure("whole call", 17.345, "s", "plain loop", 1.25), Figure("memory", 1_900_000_000, "bytes")],
        figures={"total_s": 17.345, "venv_bytes": 1_900_000_000, "rows": [{"n": 1000, "ms": 0.5234}]},
        out=tmp_path / "demo.json",
    )
    return dict(_figures().load_results(tmp_path))


def test_a_stored_result_renders_with_its_machine(tmp_path: Path) -> None:
    """A result written by benchmarks/record.py renders its machine, its headline with ratio, and its other figures."""
    results = _result(tmp_path)
    stored = json.loads((tmp_path / "demo.json").read_text())
    assert {"cpu", "cpus", "load_average_1m", "python", "torch", "mlflow", "commit"} <= set(stored["machine"])
    section = _figures().result_markdown("demo", results["demo"])
    assert "| whole call | 17.3 s | plain loop | 1.25x |" in section
    assert "| memory | 1.90 GB |  |  |" in section
    assert "    | `rows.0.ms` | 0.523 |" in section
    assert f"{stored['machine']['cpus']}-core" in section


def test_figure_markers_render_values_in_their_unit(tmp_path: Path) -> None:
    """A marker's text becomes the stored value in its unit; the marker itself stays, so the page can be rendered
    again."""
    figures = _figures()
    results = _result(tmp_path)
    text = (
        "took <!-- figure: demo figures.total_s s -->99 s<!-- /figure --> and "
        "<!-- figure: demo figures.venv_bytes GB -->?<!-- /figure --> on <!-- figure: demo machine -->x<!-- /figure -->"
    )
    rendered = figures.render_figures(text, results)
    assert "-->17.3 s<!-- /figure --> and" in rendered
    assert "-->1.90 GB<!-- /figure -->" in rendered
    assert f"-->{figures.machine_line(results['demo']['machine'])}<!-- /figure -->" in rendered
    assert figures.render_figures(rendered, results) == rendered


def test_a_count_is_shown_whole(tmp_path: Path) -> None:
    """An integer shown as a number alone (a count of runs, a version) keeps no decimals; in a unit it is scaled."""
    figures = _figures()
    results = _result(tmp_path)
    assert figures.figure_text(results, "demo", "settings.repeats", "-") == "3"
    assert figures.figure_text(results, "demo", "figures.rows.0.n", "-") == "1,000"
    assert figures.figure_text(results, "demo", "figures.venv_bytes", "GB") == "1.90 GB"


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        ("<!-- figure: nothing figures.total_s s -->1<!-- /figure -->", "no stored result 'nothing'"),
        ("<!-- figure: demo figures.absent s -->1<!-- /figure -->", "has no 'figures.absent'"),
        ("<!-- figure: demo figures.total_s hours -->1<!-- /figure -->", "unit 'hours'"),
        ("<!-- figure: demo settings s -->1<!-- /figure -->", "is not a number"),
    ],
)
def test_a_marker_naming_nothing_stored_is_an_error(tmp_path: Path, marker: str, message: str) -> None:
    """A marker that names a missing result, path or unit fails the render (and the site's build) with a message."""
    figures = _figures()
    with pytest.raises(figures.FigureError, match=re.escape(message)):
        figures.render_figures(marker, _result(tmp_path))


@pytest.mark.parametrize(
    ("value", "shown"), [(0.52345, "0.523"), (17.345, "17.3"), (140.2, "140"), (1234.6, "1,235"), (0.0, "0.0")]
)
def test_numbers_show_three_significant_digits(value: float, shown: str) -> None:
    """A measured value is shown to three significant digits, thousands separated."""
    assert _figures().number(value) == shown


def test_a_result_without_a_machine_is_shown_as_such(tmp_path: Path) -> None:
    """A JSON result stored without the machine's description is still a result: its section says so (and the page
    test above fails on it); other JSON files of the folder are not results."""
    (tmp_path / "bare.json").write_text(json.dumps({"benchmark": "bare", "figures": {"s": 1.5}}))
    (tmp_path / "golden.json").write_text(json.dumps({"runs": {}}))
    figures = _figures()
    results = figures.load_results(tmp_path)
    assert set(results) == {"bare"}
    assert "on a machine it did not describe" in figures.result_markdown("bare", results["bare"])
