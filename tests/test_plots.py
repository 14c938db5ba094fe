"""Plots of a run's profile: drawn alike whether one process draws them or forked copies draw them side by side."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import flasync
from flasync.plots import render_plots
from flasync.testing import MemoryTracker, small_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Return the profile of a short FedBuff run with top-k uploads, as JSON (every plot says something in it)."""
    tracker = MemoryTracker()
    config = small_config("stop.max_versions=8", "codec.upload=[{kind: topk, ratio: 0.05}]")
    flasync.run(config, tracker=tracker)
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    path.write_bytes(tracker.artifacts["profile.json"])
    return path


def _write_plots(profile: Path, folder: Path, prelude: str = "") -> list[str]:
    """Run write_plots in a fresh, single-threaded interpreter (``prelude`` first); return the forks it made."""
    script = textwrap.dedent(
        f"""
        import json, os, sys
        import flasync.plots as plots
        forks = []
        fork = os.fork
        def counted():
            pid = fork()
            if pid:
                forks.append(pid)
            return pid
        os.fork = counted
        {prelude}
        plots.write_plots(folder={str(folder)!r}, profile={str(profile)!r})
        print(json.dumps(forks))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=False, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout.splitlines()[-1]))


def test_forked_copies_draw_the_same_files(profile_file: Path, tmp_path: Path) -> None:
    """In a process with no other thread each plot but the first is drawn by a forked copy; the files are the bytes
    one process draws."""
    expected = render_plots(json.loads(profile_file.read_text(encoding="utf-8")))
    assert set(expected) == {f"{n}.png" for n in ("accuracy", "staleness", "time_breakdown", "bytes", "client_times")}
    forks = _write_plots(profile_file, tmp_path)
    assert len(forks) == len(expected) - 1
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == expected


def test_a_plot_whose_copy_failed_is_drawn_again(profile_file: Path, tmp_path: Path) -> None:
    """A forked copy that fails leaves its plot to the process that forked it: every file is still written."""
    prelude = textwrap.dedent(
        """
        parent = os.getpid()
        draw = plots.render_plots
        def failing(profile, names=None):
            if os.getpid() != parent:
                raise RuntimeError("a copy fails")
            return draw(profile, names)
        plots.render_plots = failing
        """
    ).replace("\n", "\n        ")
    expected = render_plots(json.loads(profile_file.read_text(encoding="utf-8")))
    forks = _write_plots(profile_file, tmp_path, prelude)
    assert len(forks) == len(expected) - 1
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == expected


def test_a_process_with_threads_draws_every_plot_itself(profile_file: Path, tmp_path: Path) -> None:
    """Forking a process with other threads running is unsafe: there, one process draws all the plots."""
    prelude = textwrap.dedent(
        """
        import threading
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
        """
    ).replace("\n", "\n        ")
    forks = _write_plots(profile_file, tmp_path, prelude)
    assert forks == []
    expected = render_plots(json.loads(profile_file.read_text(encoding="utf-8")))
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == expected


def test_only_plots_that_say_something_are_forked(profile_file: Path, tmp_path: Path) -> None:
    """A run whose updates all have one staleness and one size (FedAvg's dense rounds) draws three plots: one here,
    two in copies; no copy is forked for the two that would say nothing."""
    profile = json.loads(profile_file.read_text(encoding="utf-8"))
    profile["staleness"]["histogram"] = {"0": 100}
    for row in profile["time"]["per_version"]:
        row["upload_bytes"], row["download_bytes"] = 1_000.0 * row["updates"], 2_000.0 * row["updates"]
    dense = tmp_path / "dense.json"
    dense.write_text(json.dumps(profile), encoding="utf-8")
    folder = tmp_path / "plots"
    folder.mkdir()
    forks = _write_plots(dense, folder)
    assert len(forks) == 2
    assert sorted(path.name for path in folder.iterdir()) == ["accuracy.png", "client_times.png", "time_breakdown.png"]
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == render_plots(profile)
