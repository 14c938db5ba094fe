"""The processes of a local Ray a run started: named among this process's children, waited for, killed if they stay."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from flasync.training.executors import ray_processes

# Ignores SIGTERM, starts a grandchild that does too, and prints its pid: a worker that will not end on its own.
_STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
child = subprocess.Popen([sys.executable, "-c", code])
print(child.pid, flush=True)
time.sleep(120)
"""


def test_the_children_started_from_the_package_are_named_and_others_are_not(tmp_path: Path) -> None:
    """Of two children started after the mark, only the one running a script under the package's folder is named;
    a child from before the mark is not either."""
    package, elsewhere = tmp_path / "ray", tmp_path / "other"
    for folder in (package, elsewhere):
        folder.mkdir()
        (folder / "monitor.py").write_text("import time\ntime.sleep(120)\n")
    earlier = subprocess.Popen([sys.executable, str(package / "monitor.py")])
    before = ray_processes.children()
    ours = subprocess.Popen([sys.executable, "-u", str(package / "monitor.py")])
    other = subprocess.Popen([sys.executable, str(elsewhere / "monitor.py")])
    try:
        assert earlier.pid in before
        deadline = time.monotonic() + 30
        found: list[int] = []
        while time.monotonic() < deadline and not found:  # until the interpreter's command line is readable
            found = [process.pid for process in ray_processes.started_since(before, str(package))]
            time.sleep(0.05)
        assert found == [ours.pid]
    finally:
        for process in (earlier, ours, other):
            process.kill()
            process.wait()


@pytest.mark.slow
def test_reap_waits_for_what_ends_and_kills_what_stays() -> None:
    """A process tree that ignores SIGTERM is killed after the grace, grandchild included; one that ends within
    the grace is waited for and not killed."""
    stubborn = subprocess.Popen([sys.executable, "-c", _STUBBORN], stdout=subprocess.PIPE, text=True)
    quick = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    assert stubborn.stdout is not None
    grandchild = int(stubborn.stdout.readline())
    tree = ray_processes.with_descendants([psutil.Process(stubborn.pid), psutil.Process(quick.pid)])
    assert {process.pid for process in tree} == {stubborn.pid, grandchild, quick.pid}
    killed = ray_processes.reap(tree, grace_s=3.0)
    assert {process.pid for process in killed} == {stubborn.pid, grandchild}
    for process in tree:  # reap waited for its children (their Popen objects then read the status 0)
        assert not psutil.pid_exists(process.pid) or psutil.Process(process.pid).status() == psutil.STATUS_ZOMBIE
    stubborn.wait(timeout=10), quick.wait(timeout=10)
    assert ray_processes.reap([], grace_s=1.0) == []
