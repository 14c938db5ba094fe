"""The MLflow UI in a real browser, after flasync runs on a new store (opt-in: FLASYNC_UI_TESTS=1).

Needs Playwright (``pip install playwright``) and Debian's ``chromium`` package; the test starts ``mlflow server``
on a free port, drives ``/usr/bin/chromium`` headless, and leaves screenshots in its temporary folder (or in
``$FLASYNC_UI_SCREENSHOTS``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

pytestmark = [
    pytest.mark.skipif(os.environ.get("FLASYNC_UI_TESTS") != "1", reason="set FLASYNC_UI_TESTS=1 (a browser)"),
    pytest.mark.timeout(600),
]


def _browser_and_folder(factory: pytest.TempPathFactory, name: str) -> tuple[Path, dict[str, str]]:
    """Skip without playwright or chromium; return a fresh folder and the environment a flasync command runs in there
    (this checkout first on the path, no tracking URI of the caller's)."""
    pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip("no chromium (apt-get install chromium)")
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return factory.mktemp(name), env


@pytest.fixture(scope="module")
def ui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, str]]:
    """Two flasync runs (FedBuff, FedAsync) into a new store in a fresh folder, and ``mlflow server`` on it."""
    folder, env = _browser_and_folder(tmp_path_factory, "ui")
    summary = ""
    for kind in ("fedbuff", "fedasync"):
        args = ["run", "--no-system-metrics", "--set", "stop.max_versions=30", "--set", f"server.kind={kind}"]
        done = subprocess.run(
            [sys.executable, "-m", "flasync", *args],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        summary = done.stdout
    url = next(line.split()[-1] for line in summary.splitlines() if line.strip().startswith("then browse"))
    with _served(folder, env) as base:
        yield url.replace("http://127.0.0.1:5000", base), folder, summary


@contextmanager
def _served(folder: Path, env: dict[str, str]) -> Iterator[str]:
    """Serve the store ``folder/mlruns/mlflow.db`` with ``mlflow server`` on a free port; yield its address."""
    port = free_port()
    store = f"sqlite:///{folder / 'mlruns' / 'mlflow.db'}"
    command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(
        [*command, "--backend-store-uri", store],
        cwd=folder,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)


def _shots(folder: Path) -> Path:
    """Return where screenshots go: ``$FLASYNC_UI_SCREENSHOTS`` when set, else the runs' temporary folder."""
    shots = Path(os.environ.get("FLASYNC_UI_SCREENSHOTS") or folder)
    shots.mkdir(parents=True, exist_ok=True)
    return shots


@pytest.mark.slow
def test_the_printed_address_opens_the_training_runs_with_accuracy(ui: tuple[str, Path, str]) -> None:
    """The address the summary prints opens the experiment's training runs (not the GenAI pages), the runs table
    shows both runs with their accuracy, and the chart view shows the evaluation section (server/eval) first."""
    from playwright.sync_api import sync_playwright

    url, folder, _ = ui
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1440, "height": 800})  # a laptop's screen
        page.goto(url)
        page.get_by_text("server/eval/accuracy").first.wait_for(timeout=60_000)
        page.screenshot(path=str(_shots(folder) / "runs.png"))
        header = page.get_by_role("columnheader").filter(has_text="server/eval/accuracy").first.bounding_box()
        grid = page.get_by_role("grid").first.bounding_box()
        assert header is not None and grid is not None
        assert header["x"] + header["width"] <= grid["x"] + grid["width"]  # in view without scrolling
        table = page.inner_text("body")
        assert "Model training" in table and "Training runs" not in table.split("Runs")[0]
        assert "fedbuff-digits-seed0-" in table and "fedasync-digits-seed0-" in table
        assert "server/eval/accuracy" in table
        page.locator('input[value="CHART"]').evaluate("radio => radio.click()")  # the runs' chart view
        page.get_by_text("server/eval", exact=True).first.wait_for(timeout=60_000)
        page.screenshot(path=str(_shots(folder) / "charts.png"))
        sections = page.inner_text("body").splitlines()
        for section in ("server/eval", "server/version", "client"):
            assert section in sections, section  # a section of charts per key prefix
        assert sections.index("server/eval") < sections.index("client") < sections.index("server/version")
        text = page.inner_text("body")  # the evaluation's charts: accuracy and loss first
        assert text.index("server/eval/accuracy") < text.index("server/eval/loss") < text.index("server/eval/wall_s")
        browser.close()


@pytest.mark.slow
def test_the_run_page_shows_the_evaluation(ui: tuple[str, Path, str]) -> None:
    """The last run's page, opened as a training run, shows its metrics table with the evaluation's accuracy and,
    in its Model metrics tab, a section of evaluation charts; screenshots of both and the tab's section order are
    kept (MLflow 3.17 orders a run page's sections by name and keeps a user's layout in the browser only)."""
    from playwright.sync_api import sync_playwright

    url, folder, summary = ui
    run_id = next(line.split()[2] for line in summary.splitlines() if line.strip().startswith("MLflow run"))
    base = url.split("/runs?", 1)[0]
    shots = _shots(folder)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.goto(f"{base}/runs/{run_id}?workflowType=machine_learning")
        page.get_by_text("server/eval/accuracy").first.wait_for(timeout=60_000)
        page.screenshot(path=str(shots / "run-overview.png"), full_page=True)
        overview = page.inner_text("body")
        page.get_by_text("Model metrics").first.click()
        page.get_by_text("server/eval", exact=True).first.wait_for(timeout=60_000)
        page.screenshot(path=str(shots / "run-charts.png"))
        lines = page.inner_text("body").splitlines()
        browser.close()
    sections = [lines[i - 1] for i, line in enumerate(lines) if re.fullmatch(r"\(\d+\)", line) and i > 0]
    (shots / "run-page-sections.txt").write_text("\n".join(sections) + "\n")
    assert "Model training" in overview and "Evaluation runs" not in overview  # the sidebar of a training run
    assert "fedasync-digits-seed0-" in overview
    assert "digits (" in overview  # the dataset input
    assert "server/eval" in sections and "client" in sections, sections


REGISTERED = "digits-mlp"
"""The registered model's name in the registry test."""


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, str]]:
    """A tiny run with a selection registered as ``digits-mlp`` into a new store, and ``mlflow server`` on it."""
    folder, env = _browser_and_folder(tmp_path_factory, "registry")
    settings = ["stop.max_versions=4", "tracking.log_model=true", "eval.every_versions=1"]
    settings.append("eval.select=server/eval/accuracy:max")
    args = ["run", "--no-system-metrics", *(f"--set={setting}" for setting in settings), "--register", REGISTERED]
    done = subprocess.run(
        [sys.executable, "-m", "flasync", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    with _served(folder, env) as base:
        yield base, folder, done.stdout


@pytest.mark.slow
def test_the_registered_model_shows_its_champion_alias_and_tags(registry: tuple[str, Path, str]) -> None:
    """The registered model's page lists its version with the alias ``champion``; the version's page shows the
    alias and the tags the run gave it (run id, the model version it holds, the metric, its direction and value).
    Screenshots of both pages are kept (``registered-model.png``, ``registered-version.png``)."""
    from playwright.sync_api import sync_playwright

    base, folder, summary = registry
    assert f"registered {REGISTERED} version 1, alias champion" in summary
    run_id = next(line.split()[2] for line in summary.splitlines() if line.strip().startswith("MLflow run"))
    best = re.search(r"best\s+version (\d+) by server/eval/accuracy:max \(([0-9.]+)\)", summary)
    assert best is not None, summary
    expected = {
        "flasync.run_id": run_id,
        "flasync.version": best[1],
        "flasync.metric": "server/eval/accuracy",
        "flasync.direction": "max",
    }
    shots = _shots(folder)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1440, "height": 1000})
        page.goto(f"{base}/#/models/{REGISTERED}")
        page.get_by_text("flasync.run_id").first.wait_for(timeout=60_000)
        page.get_by_role("button", name="Close").first.click()  # the assistant's side panel: the page in full
        page.screenshot(path=str(shots / "registered-model.png"), full_page=True)
        model = page.inner_text("body")
        page.goto(f"{base}/#/models/{REGISTERED}/versions/1")
        page.get_by_text("digits-seed0-").first.wait_for(timeout=60_000)  # the source run's name
        tag = page.get_by_text("flasync.version", exact=True).first
        tag.wait_for(timeout=60_000)
        tag.scroll_into_view_if_needed()  # the tags table scrolls on its own: its last row (sorted by name) in view
        page.screenshot(path=str(shots / "registered-version.png"), full_page=True)
        version = page.inner_text("body")
        rows = {
            key: page.get_by_role("row").filter(has_text=key).first.inner_text() for key in (*expected, "flasync.value")
        }
        browser.close()
    assert re.search(r"Version 1\s.*@\s*champion", model, re.DOTALL), model
    for key, value in expected.items():
        assert key in model and value in model, key
        assert value in rows[key].split(key, 1)[1], (key, rows[key])
    assert round(float(rows["flasync.value"].split("flasync.value", 1)[1].split()[0]), 4) == float(best[2])
    assert re.search(r"Aliases\s*:\s*@\s*champion", version), version


@pytest.mark.slow
def test_the_best_model_page_lists_its_version_s_evaluation(registry: tuple[str, Path, str]) -> None:
    """The best model's page in the UI shows the evaluation of its version among its metrics (the metrics flasync
    linked to it); a screenshot is kept (``best-model-metrics.png``)."""
    import mlflow
    from playwright.sync_api import sync_playwright

    base, folder, summary = registry
    run_id = next(line.split()[2] for line in summary.splitlines() if line.strip().startswith("MLflow run"))
    client = mlflow.MlflowClient(f"sqlite:///{folder / 'mlruns' / 'mlflow.db'}")
    experiment = client.get_run(run_id).info.experiment_id
    (best,) = client.search_logged_models([experiment], filter_string="name = 'best_model'")
    accuracy = next(m.value for m in best.metrics if m.key == "server/eval/accuracy")
    shots = _shots(folder)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1440, "height": 1000})
        page.goto(f"{base}/#/experiments/{experiment}/models/{best.model_id}")
        page.get_by_text("server/eval/accuracy").first.wait_for(timeout=60_000)
        page.get_by_role("button", name="Close").first.click()  # the assistant's side panel: the page in full
        page.screenshot(path=str(shots / "best-model-metrics.png"), full_page=True)
        body = page.inner_text("body")
        browser.close()
    assert "best_model" in body and "server/eval/loss" in body and "Metrics (5)" in body  # one row a key
    assert f"{accuracy:.4f}"[:5] in body, body
