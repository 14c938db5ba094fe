"""Charts of a run's profile: SVG documents that say what the profile says, drawn only where they say something."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import flasync
from flasync.core.client_table import ClientTable
from flasync.observe.plots import render_client_histograms, render_plots
from flasync.testing import MemoryTracker, small_config

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Return the profile of a short FedBuff run with top-k uploads (every chart says something in it)."""
    tracker = MemoryTracker()
    config = small_config("stop.max_versions=8", "codec.upload=[{kind: topk, ratio: 0.05}]")
    flasync.run(config, tracker=tracker)
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    path.write_bytes(tracker.artifacts["profile.json"])
    return dict(json.loads(Path(path).read_text(encoding="utf-8")))


def _texts(document: bytes) -> list[str]:
    return [t.text or "" for t in ET.fromstring(document).iter(f"{SVG}text")]


def test_every_chart_is_an_svg_document_with_its_title(profile: dict[str, object]) -> None:
    """Each chart parses as SVG and carries its title and axis labels."""
    charts = render_plots(profile)
    assert set(charts) == {f"{n}.svg" for n in ("accuracy", "staleness", "time_breakdown", "bytes", "client_times")}
    titles = {
        "accuracy.svg": ["Accuracy of the global model", "wall seconds", "simulated seconds"],
        "staleness.svg": ["Staleness of accepted updates", "staleness (versions)"],
        "time_breakdown.svg": ["Time breakdown per version", "compute", "idle"],
        "bytes.svg": ["Bytes per version, of the updates folded into it", "bytes up", "bytes down"],
        "client_times.svg": ["Client task times", "p50", "p90"],
    }
    for name, document in charts.items():
        assert ET.fromstring(document).tag == f"{SVG}svg"
        assert set(titles[name]) <= set(_texts(document)), name


def test_names_choose_the_charts(profile: dict[str, object]) -> None:
    """``names`` draws only the charts named, the same bytes as when all are drawn."""
    every = render_plots(profile)
    assert render_plots(profile, ("bytes.svg",)) == {"bytes.svg": every["bytes.svg"]}


def test_the_accuracy_chart_draws_every_evaluation(profile: dict[str, object]) -> None:
    """The accuracy panels have one marker per evaluation, in each of its two panels (wall and simulated time)."""
    evaluations = profile["evaluations"]
    assert isinstance(evaluations, list)
    document = ET.fromstring(render_plots(profile, ("accuracy.svg",))["accuracy.svg"])
    markers = [p for p in document.iter(f"{SVG}path") if p.get("d", "").count("a3 3") > 0]
    assert [p.get("d", "").count("a3 3 0 1 0 6 0") for p in markers] == [len(evaluations)] * 2


def test_charts_that_would_say_nothing_are_not_drawn(profile: dict[str, object]) -> None:
    """One staleness for every update (FedAvg's rounds) draws no histogram; one size per update no bytes chart."""
    dense = json.loads(json.dumps(profile))
    dense["staleness"]["histogram"] = {"0": 100}
    for row in dense["time"]["per_version"]:
        row["upload_bytes"], row["download_bytes"] = 1_000.0 * row["updates"], 2_000.0 * row["updates"]
    assert sorted(render_plots(dense)) == ["accuracy.svg", "client_times.svg", "time_breakdown.svg"]


def test_a_diverged_run_still_gets_its_charts(profile: dict[str, object]) -> None:
    """NaN accuracy (a run whose model diverged) and a lone task time draw charts, leaving out what is not finite."""
    odd = json.loads(json.dumps(profile))
    for evaluation in odd["evaluations"][1:]:
        evaluation["accuracy"] = float("nan")
    odd["clients"]["sim_task_s_samples"] = [2.0]
    charts = render_plots(odd)
    assert {"accuracy.svg", "client_times.svg"} <= set(charts)
    assert "nan" not in charts["accuracy.svg"].decode().lower()


@pytest.mark.slow
def test_charts_take_about_a_millisecond_of_python_not_a_plotting_library(profile: dict[str, object]) -> None:
    """Drawing imports no plotting library (matplotlib would bring tens of thousands of objects into the run's
    process); run in a fresh interpreter so that nothing else imported it first."""
    import subprocess
    import sys

    script = (
        "import json, sys\n"
        "from flasync.observe.plots import render_plots\n"
        f"render_plots(json.loads({json.dumps(json.dumps(profile))}))\n"
        "print('matplotlib' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.strip() == "False"


def test_write_plots_draws_a_stored_profile_into_a_folder(profile: dict[str, object], tmp_path: Path) -> None:
    """write_plots reads a profile.json and writes one file per chart, the bytes render_plots draws."""
    from flasync.observe.plots import write_plots

    stored = tmp_path / "profile.json"
    stored.write_text(json.dumps(profile), encoding="utf-8")
    folder = tmp_path / "plots"
    folder.mkdir()
    write_plots(folder=str(folder), profile=str(stored))
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == render_plots(profile)


def test_client_histograms_draw_one_panel_per_histogram_with_data() -> None:
    """The client chart draws tasks, refusals and staleness where they have counts, and says so when none does."""
    table = ClientTable(rows=10, top=5)
    empty = ET.fromstring(render_client_histograms(table.histograms()))
    assert "no client took part" in {e.text for e in empty.iter()}
    for client in range(6):
        table.dispatched(client, 100)
        table.accepted(client, client)
    chart = ET.fromstring(render_client_histograms(table.histograms()))
    texts = {e.text for e in chart.iter() if e.text}
    assert {"Tasks per client", "Staleness of accepted updates"} <= texts
    assert "Refused updates per client" in texts  # every client refused 0 times: one bar at bin 0
