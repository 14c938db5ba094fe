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
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

pytestmark = [
    pytest.mark.skipif(os.environ.get("FLASYNC_UI_TESTS") != "1", reason="set FLASYNC_UI_TESTS=1 (a browser)"),
    pytest.mark.timeout(600),
]


@pytest.fixture(scope="module")
def ui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, str]]:
    """Two flasync runs (FedBuff, FedAsync) into a new store in a fresh folder, and ``mlflow server`` on it."""
    pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip("no chromium (apt-get install chromium)")
    folder = tmp_path_factory.mktemp("ui")
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
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
    port = free_port()
    store = f"sqlite:///{folder / 'mlruns' / 'mlflow.db'}"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            store,
        ],
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
        yield url.replace("http://127.0.0.1:5000", f"http://127.0.0.1:{port}"), folder, summary
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
