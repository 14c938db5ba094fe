"""The embedding host's event loop never stalls: a 10 ms heartbeat beside a run, a cancel and a stop.

Each test measures the gaps between two ticks of a coroutine that sleeps 10 ms, from before the run starts until
it returned or raised, and bounds the worst by 100 ms. A blocking call on the loop (an executor's shutdown, an
MLflow call, a checkpoint upload) shows as a gap of its whole duration, and so does any pause of the whole process:
a thread holding the GIL, or a full collection of Python's garbage collector, which stops every thread for a time
that grows with the heap (0.15-0.5 s here, with torch and MLflow loaded). A run sets no full collection off, because
it creates few long-lived objects in its process: the digits are read without importing scikit-learn (SciPy,
pandas), and the plots are SVG text built in a millisecond or two (no matplotlib). Each window starts right after
a collection, so none falls due in it for what the process allocated before (the test's own MLflow clients make
tens of thousands of objects); the heartbeat counts the full collections during its window and names them in a
failure's message.

The one thing not held against the loop is time its thread was ready to run and the operating system gave the CPU
to another thread or process (its run-queue wait, from Linux's ``/proc/self/task/TID/schedstat``): on a 2-core
machine shared with other work that is the machine's load, not the run. A thread waiting for the GIL is not in the run
queue, though its wake-ups to ask for the GIL can be: so a gap is never counted as less than the full collections in
it. Both figures are printed; where the kernel gives no schedstat, the raw gap is asserted.

MLflow is imported by this module (for :func:`status_of`), so the in-process tests cannot tell whether a run imports
it; two tests in fresh processes do: a tracked run imports neither scikit-learn nor matplotlib where it runs, and one
tracked to a server that never answers imports neither MLflow (the tracker asks the server's ``/health`` before it
would import MLflow to write from its own process) nor matplotlib, its model being made by a one-shot process for
the spool.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pytest

from flasync import Federation, tracking
from flasync.core.errors import RunInterrupted
from flasync.core.events import ModelPublished
from flasync.observe.summary import RunSummary
from flasync.testing import small_config

MAX_GAP_S = 0.1
TICK_S = 0.01


def queued_s() -> float | None:
    """Return the seconds the calling thread has waited for a CPU while ready to run; None where Linux says not."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat", encoding="ascii") as stat:
            return int(stat.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


class Heartbeat:
    """Tick every 10 ms on the running loop, recording each tick's time, the loop thread's run-queue wait and each
    full garbage collection."""

    def __init__(self) -> None:
        """Start with no ticks."""
        self.loop_ticks: list[float] = []
        self.queued: list[float | None] = []
        """The loop thread's run-queue wait (seconds, cumulative) at each tick."""
        self.full_collections: list[tuple[float, float]] = []
        """When each full (generation 2) collection during :meth:`beat` began and ended."""
        self._stop = asyncio.Event()
        self._collecting: float | None = None

    @property
    def ticks(self) -> int:
        """Ticks of the loop."""
        return len(self.loop_ticks)

    @property
    def worst_s(self) -> float:
        """The longest gap between two ticks of the loop."""
        return float(np.diff(self.loop_ticks).max()) if len(self.loop_ticks) > 1 else 0.0

    @property
    def held_s(self) -> float:
        """The longest gap less the time the loop thread waited for a CPU meanwhile, but never less than the full
        collections in it (the raw gap without schedstat)."""
        if len(self.loop_ticks) < 2:
            return 0.0
        gaps = np.diff(self.loop_ticks)
        if any(q is None for q in self.queued):
            return float(gaps.max())
        own = gaps - np.diff(np.asarray(self.queued, dtype=float))
        for i, (start, end) in enumerate(itertools.pairwise(self.loop_ticks)):
            collecting = sum(max(0.0, min(end, stop) - max(start, begin)) for begin, stop in self.full_collections)
            own[i] = max(own[i], collecting)
        return float(own.max())

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._collecting = time.perf_counter()
        elif self._collecting is not None:
            self.full_collections.append((self._collecting, time.perf_counter()))

    async def beat(self) -> None:
        """Tick until :meth:`stop`."""
        gc.callbacks.append(self._on_collection)
        try:
            while not self._stop.is_set():
                self.loop_ticks.append(time.perf_counter())
                self.queued.append(queued_s())
                await asyncio.sleep(TICK_S)
        finally:
            gc.callbacks.remove(self._on_collection)

    def stop(self) -> None:
        """End :meth:`beat` at its next tick."""
        self._stop.set()

    def check(self, what: str) -> None:
        """Print the worst gap, the loop's own and the full collections; assert the loop's own is within the bound."""
        pauses = ", ".join(f"{(end - start) * 1000:.0f} ms" for start, end in self.full_collections) or "none"
        print(
            f"{what}: worst loop gap {self.worst_s * 1000:.0f} ms, less its wait for a CPU {self.held_s * 1000:.0f} ms;"
            f" full collections: {pauses}"
        )
        assert self.ticks > 10
        assert self.held_s <= MAX_GAP_S, (
            f"{what}: the loop was held {self.held_s:.3f} s (full garbage collections meanwhile: {pauses})"
        )


async def beside(work: Callable[[], Awaitable[Any]]) -> tuple[Any, Heartbeat]:
    """Await ``work()`` with a heartbeat beside it; return its result (or the exception it raised) and the beat."""
    # Start with no full collection owed by what this process did before (the test's own MLflow clients, earlier
    # tests): one falling due in the window would be theirs. What the run allocates is left to set one off.
    gc.collect()
    heart = Heartbeat()
    beat = asyncio.create_task(heart.beat())
    await asyncio.sleep(3 * TICK_S)  # the beat is going before the run starts
    try:
        result: Any = await work()
    except BaseException as exc:  # the test inspects what the run raised
        result = exc
    heart.stop()
    await beat
    return result, heart


@pytest.fixture
def silent_server() -> Iterator[str]:
    """Yield the URL of an HTTP server that accepts connections, reads requests and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.2)
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            held.append(conn)  # read nothing back, answer nothing: the client waits for its timeout

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    done.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


def tracked(uri: str, *overrides: str) -> Any:
    """Return a small wall-clock config tracked to ``uri``."""
    return small_config(
        "clock=wall",
        "tracking.enabled=true",
        f"tracking.uri={uri}",
        "tracking.experiment=loop",
        "checkpoint.every_versions=2",
        *overrides,
    )


def status_of(store: str) -> str:
    """Return the status of the only run in ``store``."""
    client = mlflow.MlflowClient(store)
    experiment = client.get_experiment_by_name("loop")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    return str(run.info.status)


async def cancelled_after(federation: Federation, versions: int) -> BaseException | RunSummary:
    """Run ``federation``, cancel its task once ``versions`` models were published, return what awaiting it gave."""
    published = federation.bus.subscribe(ModelPublished, policy="drop_oldest")
    task = asyncio.create_task(federation.run())
    for _ in range(versions):
        await published.receive()
    task.cancel()
    try:
        return await task
    except BaseException as exc:  # returned for the test to inspect
        return exc


async def stopped_after(federation: Federation, versions: int) -> BaseException | RunSummary:
    """Run ``federation``, call ``request_stop`` once ``versions`` models were published, return its outcome."""
    published = federation.bus.subscribe(ModelPublished, policy="drop_oldest")
    task = asyncio.create_task(federation.run())
    for _ in range(versions):
        await published.receive()
    federation.request_stop("test")
    try:
        return await task
    except BaseException as exc:  # returned for the test to inspect
        return exc


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_whole_tracked_run_keeps_the_loop_responsive(store: str) -> None:
    """A run tracked to SQLite, from its start to its summary, never holds the loop for 100 ms."""
    summary, heart = await beside(lambda: Federation(tracked(store, "stop.max_versions=8")).run())
    assert isinstance(summary, RunSummary) and summary.versions == 8
    assert status_of(store) == "FINISHED"
    heart.check("run")


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_cancelled_run_keeps_the_loop_responsive(store: str) -> None:
    """Cancelling a tracked run's task ends it KILLED without holding the loop."""
    federation = Federation(tracked(store, "stop.max_versions=100000"))
    outcome, heart = await beside(lambda: cancelled_after(federation, 3))
    assert isinstance(outcome, asyncio.CancelledError)
    assert status_of(store) == "KILLED"
    assert federation.summary is not None and federation.summary.versions >= 2
    heart.check("cancel")


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_stopped_run_keeps_the_loop_responsive(store: str) -> None:
    """request_stop checkpoints and ends the run KILLED without holding the loop; the error has a partial summary."""
    federation = Federation(tracked(store, "stop.max_versions=100000"))
    outcome, heart = await beside(lambda: stopped_after(federation, 3))
    assert isinstance(outcome, RunInterrupted)
    assert outcome.checkpoint is not None
    assert outcome.summary is not None and outcome.summary["versions"] >= 2
    assert federation.summary is not None and federation.summary.versions == outcome.summary["versions"]
    assert status_of(store) == "KILLED"
    heart.check("stop")


def silent_tracker(url: str, spool: Path) -> tracking.MlflowTracker:
    """Return a tracker for ``url`` whose requests give up after 0.5 s (the defaults wait 10 s and retry)."""
    return tracking.MlflowTracker(url, http_timeout_s=0.5, http_retries=0, spool_root=spool, flush_timeout_s=1.0)


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_silent_mlflow_server_never_holds_the_loop(silent_server: str, tmp_path: Path) -> None:
    """With a store that accepts connections and never answers, a run, a cancel and a stop keep the loop free."""
    config = small_config("clock=wall", "tracking.enabled=true", "stop.max_versions=4")
    summary, heart = await beside(
        lambda: Federation(config, tracker=silent_tracker(silent_server, tmp_path / "a")).run()
    )
    assert isinstance(summary, RunSummary) and summary.versions == 4
    heart.check("silent store, run")
    endless = small_config("clock=wall", "tracking.enabled=true", "stop.max_versions=100000")
    federation = Federation(endless, tracker=silent_tracker(silent_server, tmp_path / "b"))
    outcome, heart = await beside(lambda: cancelled_after(federation, 2))
    assert isinstance(outcome, asyncio.CancelledError)
    heart.check("silent store, cancel")
    federation = Federation(endless, tracker=silent_tracker(silent_server, tmp_path / "c"))
    outcome, heart = await beside(lambda: stopped_after(federation, 2))
    assert isinstance(outcome, RunInterrupted)
    heart.check("silent store, stop")


async def test_clean_up_completes_through_one_cancellation_and_a_second_stops_the_wait() -> None:
    """The first cancellation of a run's clean-up is held until the clean-up is done; a second one ends the wait."""
    from flasync.runtime.closing import off_loop

    release = threading.Event()
    done: list[str] = []

    def clean_up(name: str) -> None:
        release.wait(10.0)
        done.append(name)

    once = asyncio.create_task(off_loop(clean_up, "once"))
    await asyncio.sleep(0.05)
    once.cancel()
    await asyncio.sleep(0.05)
    assert not once.done()  # still waiting for the clean-up
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await once
    assert done == ["once"]

    release.clear()
    twice = asyncio.create_task(off_loop(clean_up, "twice"))
    await asyncio.sleep(0.05)
    twice.cancel()
    await asyncio.sleep(0.05)
    twice.cancel()
    with pytest.raises(asyncio.CancelledError):
        await twice
    assert done == ["once"]  # the wait ended before the clean-up did
    release.set()
    await asyncio.sleep(0.1)
    assert done == ["once", "twice"]  # which still completed in its thread


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_tracked_run_leaves_matplotlib_and_scikit_learn_out_of_its_process(tmp_path: Path) -> None:
    """A tracked run of digits imports neither scikit-learn nor matplotlib where it runs (their objects would set
    off full collections), yet its plots reach the store."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code = (
        "import sys, flasync, flasync.testing as t; "
        f"flasync.run(t.small_config('tracking.enabled=true', 'tracking.uri={store}', 'tracking.experiment=loop')); "
        "print(sorted(m for m in ('sklearn', 'scipy', 'pandas', 'matplotlib') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=150, check=True, cwd=tmp_path
    )
    assert done.stdout.strip().splitlines()[-1] == "[]"
    client = mlflow.MlflowClient(store)
    experiment = client.get_experiment_by_name("loop")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    plots = {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {"accuracy.svg", "staleness.svg", "time_breakdown.svg", "client_times.svg"} <= plots


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_run_tracked_to_a_silent_server_never_imports_mlflow_in_its_process(
    silent_server: str, tmp_path: Path
) -> None:
    """With a server that never answers, a tracked run (model and plots included) imports neither MLflow nor
    matplotlib where it runs: the spool gets everything, the model made by another process."""
    code = (
        "import sys, flasync, flasync.testing as t; from flasync import tracking; "
        f"tracker = tracking.MlflowTracker({silent_server!r}, http_timeout_s=0.5, http_retries=0, "
        "spool_root='spool', flush_timeout_s=1.0); "
        "flasync.run(t.small_config('tracking.enabled=true', 'tracking.log_model=true'), tracker=tracker); "
        "print(sorted(m for m in ('mlflow', 'matplotlib', 'sklearn') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=150, check=True, cwd=tmp_path
    )
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert len(list((tmp_path / "spool").glob("*.jsonl"))) == 1
    spooled = {path.name for path in (tmp_path / "spool").rglob("*")}
    assert {"accuracy.svg", "MLmodel"} <= spooled  # the plots and the model were made and spooled
