"""The built documentation site in a real browser (opt-in: FLASYNC_UI_TESTS=1).

Needs Playwright (``pip install -e '.[browser]'``) and Debian's ``chromium`` package (``apt-get install chromium``):
Playwright drives ``/usr/bin/chromium`` headless, so no browser is downloaded. The site is built with
``mkdocs build --strict`` into a temporary folder and served over HTTP on 127.0.0.1 (as ``mkdocs serve`` would: its
links are folders); the screenshots go to ``$FLASYNC_UI_SCREENSHOTS`` when set, else
beside the site.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

pytestmark = [
    pytest.mark.skipif(os.environ.get("FLASYNC_UI_TESTS") != "1", reason="set FLASYNC_UI_TESTS=1 (a browser)"),
    pytest.mark.slow,
    pytest.mark.timeout(900),
]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """Build the site strictly and serve it; yield its address and the folder for screenshots."""
    pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip("no chromium (apt-get install chromium)")
    folder = tmp_path_factory.mktemp("site")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    shots = Path(os.environ.get("FLASYNC_UI_SCREENSHOTS") or folder / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    handler = functools.partial(_QuietHandler, directory=str(folder / "site"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", shots
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    """Serve files without a log line per request."""

    def log_message(self, format: str, *args: object) -> None:
        """Log nothing."""


def test_index_and_a_guide_open_in_a_browser(site: tuple[str, Path]) -> None:
    """The built index shows flasync's home with the navigation; the getting-started guide opens from it and shows
    its first command; the performance page shows a stored result's machine."""
    from playwright.sync_api import sync_playwright

    address, shots = site
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{address}/")
        assert page.title() == "flasync"
        navigation = page.locator("nav.md-nav--primary").inner_text()
        for entry in ("Getting started", "How-to guides", "Concepts", "Reference", "Performance"):
            assert entry in navigation, entry
        page.screenshot(path=str(shots / "docs-index.png"), full_page=True)
        page.locator("nav.md-nav--primary a", has_text="Getting started").first.click()
        page.wait_for_load_state()
        assert page.url == f"{address}/getting-started/", page.url
        assert page.locator("h1").first.inner_text().startswith("Getting started")  # then its permalink
        assert "python -m flasync run" in page.locator("article").inner_text()
        page.screenshot(path=str(shots / "docs-getting-started.png"), full_page=True)
        page.goto(f"{address}/performance/")
        assert "Stored results" in page.locator("article").inner_text()
        assert "-core" in page.locator("article").inner_text()
        page.screenshot(path=str(shots / "docs-performance.png"))
        browser.close()
