"""``log_batch`` in a child process, so MLflow's SQL work never holds the training process's GIL.

Writing a metric to MLflow's SQLAlchemy store costs about 90 microseconds of pure-Python work. Done on a thread of
the training process, that work competes with the event loop and the training threads for the GIL; a run that logs a
dozen figures per client update loses a large share of its throughput. :class:`ChildLogBatch` starts
``python -m tracking._child URI``, which imports MLflow at once (over a second, while the parent does other work),
opens the store (a new SQLite store's schema included), then reads the run id as the first line of its standard input
and answers ``ready``; or it reads the run to create (a JSON object), creates the run and answers
``ready RUN_ID EXPERIMENT_ID``, so the parent need not import MLflow at all. Each batch follows
as one line of JSON (``[[key, value, timestamp, step], ...]``), answered ``ok`` or ``error: ...``; in a SQLite store
at a schema revision it was written for, whose tables have the shape MLflow's ``log_batch`` writes, the child writes
those rows itself (:class:`flasync.tracking.sqlite_metrics.SqliteMetrics`: the same rows, a tenth of the CPU),
elsewhere it calls ``log_batch``. A plain subprocess, not ``multiprocessing``: it never re-imports the parent's
``__main__`` (a script without an ``if __name__ == "__main__"`` guard stays safe), and nothing is pickled.

The child also does the rest of a run's MLflow work a parent hands it, on its own core and with its own GIL. A job
is one JSON object, answered like a batch: ``file`` (log a local file as an artifact), ``files`` (several),
``tags``, ``dataset`` (an input), ``monitor`` (start MLflow's system monitor: its CPU, memory, disk, network and GPU
samples are the machine's, wherever it runs), ``end`` (the run's status), ``release`` (leave the run open, its status
as it is, to serve other runs: a sweep's parent run while its children run), ``model`` (build, export and log a model,
see :mod:`flasync.tracking._model`; or log one saved already, its ``saved`` folder), ``link`` (link a step's
evaluation points to the run's models, :mod:`flasync.tracking.model_metrics`: to the models the child logged to
the run without a search, in a SQLite store in one query and one transaction) or ``prepare`` (export a model of the
same structure ahead of its ``model`` job, see :class:`flasync.tracking._model.Exports`). What the child is
to import (or call) ahead for its ``model`` jobs (``torch.export`` and MLflow's pytorch flavour import in about two
seconds, and the first model they save takes one more: :func:`flasync.tracking._model.warm_up`) is named in its
environment when it starts, or later by a line ``preload KIND NAME,NAME`` (sent before a run, never answered; the
one kind is ``model``); a name is preloaded once per child. On Linux (:data:`FORKS_HELPER`), the child forks a
helper process right after MLflow's import (see :class:`_Helper`): it preloads on a core of its own, while the child
opens the store and writes metrics, and does the model jobs (the child sends their results to the store). Elsewhere,
or for names sent to a child without a helper, the child preloads on a background thread once the store is open, and
does the jobs itself.

A job that carries ``"defer": NAME`` is answered ``ok`` at once and done on a thread of its own while the child
answers what follows; ``{"op": "settle", "id": NAME}`` waits for it and answers as the job would have. The ``end``
job waits for those not settled, but for a job that also carries ``"detached": true``: nothing ever waits for that
one (a model exported ahead, which a later ``model`` job waits for in the helper anyway; a run stopped before its
model is logged does not).

Where this install's writer server listens (:mod:`flasync.tracking._server`, which the first tracked command's
child forks once MLflow is imported), the child is a fork of it rather than a new interpreter: MLflow imported
already, its start-up is a fork and the store's opening; it serves the same protocol.

After a run's ``end`` or ``release`` job (answered ``ok`` or ``error: ...``) the child has no run again: its system
monitor is stopped and it waits for the next run's first line, with MLflow, the open store and whatever it preloaded
still loaded. :data:`IDLE` keeps one such idle child per process, so consecutive tracked runs on the same store (a
sweep, a notebook, a service) skip the child's start-up (MLflow's import, the store's opening, the model export's
warm-up: several seconds of CPU each)."""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

from flasync.tracking import _server

if TYPE_CHECKING:
    from flasync.tracking.metrics import MetricRow
    from flasync.tracking.sqlite_metrics import SqliteMetrics

__all__ = ["FORKS_HELPER", "IDLE", "ChildLogBatch", "IdleChild", "close_idle_writer", "warm_idle_writer"]

_STOP = "stop"
_LEAVING = frozenset({"end", "release"})
"""The jobs after which the child serves no run (it waits for the next run's first line)."""
_EXIT_TIMEOUT_S = 10.0


_PRELOAD = "preload "
STORE_REPLACED = "the SQLite store was removed or replaced"
"""What a kept child's error says when its store's file is not the one it opened (a new child would open it)."""
_URI_VARIABLE = "FLASYNC_CHILD_TRACKING_URI"
_PRELOADS = {"model": "FLASYNC_CHILD_PRELOAD"}
"""The environment variable that names what a writer process preloads from its start, per kind of job."""
FORKS_HELPER = sys.platform.startswith("linux")
"""Whether a writer process started with something to preload forks a helper to do it and the jobs it is for
(see :class:`_Helper`): on Linux, where a fork after MLflow's import is safe and the kernel ends the helpers with
their writer. Elsewhere (macOS, where system frameworks may not survive a fork; Windows, which cannot fork) the
writer process preloads on a thread of its own."""


def _preload(names: Sequence[str]) -> None:
    """Import each of ``names`` (``package.module``) or call it (``package.module:function``, no arguments), in
    order; one that fails is left to the job that needs it (which reports the error)."""
    for name in names:
        module, _, function = name.partition(":")
        try:
            loaded = importlib.import_module(module)
            if function:
                getattr(loaded, function)()
        except Exception:  # the job that needs it says what went wrong
            continue


class _Helper:
    """A forked copy of the writer process that makes what its model and artifact jobs need, beside it.

    Forked right after MLflow's import (so it has MLflow without paying for it again, and no store, thread or
    connection yet), it imports and warms up what it is told to preload (``torch.export``) on a core of its own while
    the writer process opens the store, creates the run and writes metrics, where one process would do it all on one
    GIL, one thing after the other. It then saves models into folders the writer process gives it, which the writer
    process sends to the store: it never opens the store itself. Jobs go
    one at a time over a pipe, one JSON line each, answered ``ok`` or ``error: ...``; it dies with the writer
    process (its input ends; on Linux, the kernel also kills it at once).
    """

    def __init__(self, pid: int, requests: IO[str], replies: IO[str]) -> None:
        self.pid = pid
        self._requests = requests
        self._replies = replies
        self._lock = threading.Lock()
        """One job at a time: a deferred job's thread and the writer's main thread may both have one."""

    @classmethod
    def fork(cls) -> _Helper | None:
        """Fork the helper; None where the platform cannot fork, or threads run (forking them would be unsafe)."""
        if not FORKS_HELPER or threading.active_count() != 1:
            return None
        down_read, down_write = os.pipe()
        up_read, up_write = os.pipe()
        for stream in (sys.stdout, sys.__stdout__):  # the protocol's stream too: a fork must not copy its buffer
            if stream is not None:
                stream.flush()
        writer = os.getpid()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the helper process (its work is tested through the writer's jobs)
            try:
                os.close(down_write)
                os.close(up_read)
                _die_with_parent(writer)
                # The writer process's pipes to the tracker stay the writer's: the tracker sees them end with it.
                null = os.open(os.devnull, os.O_RDWR)
                os.dup2(null, 0)
                os.dup2(null, 1)
                with open(down_read, encoding="utf-8") as jobs, open(up_write, "w", encoding="utf-8") as answers:
                    _help(jobs, answers)
            finally:
                os._exit(0)
        os.close(down_read)
        os.close(up_write)
        return cls(pid, open(down_write, "w", encoding="utf-8"), open(up_read, encoding="utf-8"))

    def preload(self, names: Sequence[str]) -> None:
        """Have the helper import or call ``names`` (see :func:`_preload`) before its next job; never blocks.

        Raises:
            ConnectionError: The helper is gone.
        """
        with self._lock:
            self._send(_PRELOAD + ",".join(names))

    def do(self, request: Mapping[str, Any]) -> None:
        """Have the helper do ``request`` (see :func:`_help`) and wait for it.

        Raises:
            RuntimeError: The job failed (its message).
            ConnectionError: The helper is gone.
        """
        with self._lock:
            self._send(json.dumps(dict(request)))
            answer = self._replies.readline().strip()
        if not answer:
            raise ConnectionError("the writer's helper process is gone")
        if answer != "ok":
            raise RuntimeError(answer.removeprefix("error: "))

    def _send(self, line: str) -> None:
        try:
            self._requests.write(line + "\n")
            self._requests.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise ConnectionError("the writer's helper process is gone") from None

    def close(self) -> None:
        """Stop the helper (between runs it holds nothing worth finishing) and reap it."""
        for stream in (self._requests, self._replies):
            with contextlib.suppress(OSError):
                stream.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


def _die_with_parent(parent: int) -> None:
    """Have the kernel kill this process when its parent (``parent``) dies (Linux; elsewhere its input ending stops
    it)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)


def _help(requests: IO[str], replies: IO[str]) -> None:
    """Serve a writer process's helper jobs until its pipe ends (runs in the helper, see :class:`_Helper`).

    A line ``preload NAME,...`` is done at once (never answered). A job is a JSON object: ``model`` builds a model
    with ``builder(**kwargs)`` and saves it at ``folder`` for the logged model ``description`` (see
    :func:`flasync.tracking._model.save_for`); ``prepare`` exports a model of that structure ahead of it (see
    :class:`flasync.tracking._model.Exports`).
    """
    from flasync.tracking._model import Exports, save_for, skip_package_scan

    skip_package_scan()  # it saves flasync's models only, whose requirements are stated
    exports = Exports()
    for line in requests:
        if line.startswith(_PRELOAD):
            # As in the writer process (forked with the collector off): what the imports and the warm-up leave is
            # nearly all alive (their garbage, frozen with it, is made once per name and helper); the jobs collect.
            gc.disable()
            _preload([n for n in line.strip().removeprefix(_PRELOAD).split(",") if n])
            gc.freeze()
            gc.enable()
            continue
        gc.enable()
        try:
            request = json.loads(line)
            op = request.pop("op")
            if op == "model":
                save_for(**request, exports=exports)
            elif op == "prepare":
                exports.prepare(**request)
            else:
                raise ValueError(f"unknown job {op!r}")
            answer = "ok"
        except Exception as exc:
            answer = f"error: {type(exc).__name__}: {exc}"
        replies.write(answer.replace("\n", " ") + "\n")
        replies.flush()


class _Monitor:
    """MLflow's system monitor of the run, when the parent asked for it (its samples are system-wide)."""

    def __init__(self) -> None:
        self.running: Any = None

    def start(self, client: Any, run_id: str, tracking_uri: str, interval_s: float) -> None:
        from mlflow.entities import Metric

        from flasync.tracking._runs import start_monitor

        def sink(rows: list[MetricRow]) -> None:
            # A failing store raises here: the monitor's sink holds the rows and hands them again with its next
            # sample (flasync.tracking._runs.MonitorSink), as the parent's spool would replay them.
            metrics = [Metric(m.key, m.value, m.timestamp, m.step) for m in rows]
            client.log_batch(run_id, metrics=metrics, synchronous=True)

        if self.running is None:
            self.running = start_monitor(run_id, tracking_uri, sink, interval_s)

    def stop(self) -> int | None:
        """Stop the monitor; return how many of its rows the store never took (counted lost, see
        :class:`flasync.tracking._runs.MonitorSink`), None when none was running."""
        from flasync.tracking._runs import stop_monitor

        running, self.running = self.running, None
        if running is None:
            return None
        stop_monitor(running)
        return int(running.sink.lost)


class _Aside:
    """The writer process's helpers (see :class:`_Helper`) while they live, by the kind of job they do (``model``),
    and the models the writer process exported ahead itself, for those it saves without a helper."""

    def __init__(self, helpers: Mapping[str, _Helper | None]) -> None:
        from flasync.tracking._model import Exports

        self.helpers = {kind: helper for kind, helper in helpers.items() if helper is not None}
        self.exports = Exports()

    def preload(self, kind: str, names: Sequence[str]) -> bool:
        """Have the helper for ``kind`` jobs (``model``) preload ``names``; False when there is none
        (then the writer process does)."""
        return self._use(kind, lambda helper: helper.preload(names))

    def __call__(self, kind: str, request: dict[str, Any]) -> bool:
        """Have the helper for ``kind`` jobs do ``request``; False when there is none or it died (then the writer
        process does it).

        Raises:
            RuntimeError: The job failed there (it would here too).
        """
        return self._use(kind, lambda helper: helper.do(request))

    def _use(self, kind: str, action: Callable[[_Helper], None]) -> bool:
        """Call ``action`` with the helper for ``kind`` jobs; False when there is none or it died (it is dropped)."""
        helper = self.helpers.get(kind)
        if helper is None:
            return False
        try:
            action(helper)
        except ConnectionError:
            self._drop(kind)
            return False
        return True

    def _drop(self, kind: str) -> None:
        helper = self.helpers.pop(kind, None)
        if helper is not None:
            helper.close()

    def close(self) -> None:
        """Stop the helpers."""
        for kind in list(self.helpers):
            self._drop(kind)


class _Deferred:
    """A run's deferred jobs: each done on a thread of its own while the writer process answers what comes next
    (e.g. the model exported by its helper while the run's other artifacts are logged), until settled."""

    def __init__(self, do: Callable[[dict[str, Any]], str]) -> None:
        self._do = do
        self._jobs: dict[str, tuple[threading.Thread, list[str]]] = {}

    def start(self, name: str, request: dict[str, Any]) -> None:
        """Start ``request`` as the deferred job ``name``.

        Raises:
            ValueError: A job of that name is not settled yet.
        """
        if name in self._jobs:
            raise ValueError(f"a deferred job {name!r} is not settled yet")
        answer: list[str] = []
        detached = bool(request.get("detached"))

        def work() -> None:
            try:
                answer.append(f"ok {self._do(request)}")
            except Exception as exc:
                answer.append(f"error: {type(exc).__name__}: {exc}")

        thread = threading.Thread(target=work, name=f"tracking-job-{name}", daemon=True)
        if not detached:  # a detached job is never settled: nothing waits for it, its answer is dropped
            self._jobs[name] = (thread, answer)
        thread.start()

    def settle(self, name: str) -> str:
        """Wait for the deferred job ``name``; return its answer (``ok ...`` or ``error: ...``)."""
        job = self._jobs.pop(name, None)
        if job is None:
            return f"error: KeyError: no deferred job {name!r}"
        thread, answer = job
        thread.join()
        return answer[0] if answer else "error: RuntimeError: the job ended without an answer"

    def settle_all(self) -> None:
        """Wait for every job not settled yet (their answers are dropped: nobody asked for them)."""
        for name in list(self._jobs):
            self.settle(name)


def _job(
    client: Any,
    run_id: str,
    request: dict[str, Any],
    monitor: _Monitor,
    tracking_uri: str,
    aside: _Aside,
    logged: dict[str, str],
    direct: SqliteMetrics | None = None,
) -> str:
    """Do one job of the parent's (see the module docstring); return the reply's words after ``ok``. ``logged``: the
    id of the latest model of each name this process logged to the run (its ``model`` jobs keep it, its ``link``
    jobs read it). ``direct``: a SQLite store's writer, for the tags, the run's end and a link's points."""
    op = request.get("op")
    if op == "monitor":
        monitor.start(client, run_id, tracking_uri, float(request["interval_s"]))
        return ""
    if op == "file":
        client.log_artifact(run_id, request["path"], request.get("folder") or None)
        return ""
    if op == "files":
        for path, folder in request["files"]:
            client.log_artifact(run_id, path, folder or None)
        return ""
    if op == "tags":
        from flasync.tracking._runs import send_tags

        send_tags(client, run_id, request["tags"], direct)
        return ""
    if op == "dataset":
        from flasync.tracking.spool import dataset_input

        client.log_inputs(run_id, datasets=[dataset_input(**request["dataset"])])
        return ""
    if op == "release":
        return str(monitor.stop() or 0)  # the run stays open; the system metric rows lost, for the parent to count
    if op == "end":
        lost = monitor.stop()  # its last samples before the run's end
        end_time = int(request["end_time"])
        if lost is not None:  # the monitor's last samples were taken just now: the run does not end before them
            end_time = max(end_time, int(time.time() * 1000))
        if direct is None or not direct.end_run(run_id, request["status"], end_time):
            client.set_terminated(run_id, request["status"], end_time=end_time)
        return str(lost or 0)  # the system metric rows lost, for the parent to count
    if op == "model":
        from flasync.tracking._model import log_built_model, log_saved_model

        name = str(request["model"].get("name", "model"))
        logged.pop(name, None)  # one that fails leaves the store to say which model of the name is the latest ready
        if "saved" in request["model"]:
            done = log_saved_model(client, run_id, **request["model"])
        else:
            done = log_built_model(
                client,
                run_id,
                **request["model"],
                aside=lambda job: aside("model", {"op": "model", **job}),
                exports=aside.exports,
            )
        logged[name] = done.model_id
        return f"{done.seconds:.3f}"
    if op == "link":
        from flasync.tracking.model_metrics import link_models

        return str(link_models(client, run_id, request["models"], logged=logged, direct=direct))
    if op == "prepare":
        if not aside("model", {"op": "prepare", **request["model"]}):
            aside.exports.prepare(**request["model"])
        return ""
    raise ValueError(f"unknown job {op!r}")


def _serve(tracking_uri: str, requests: IO[str], replies: IO[str], *, fork_server: bool = False) -> None:
    """Serve runs one after the other: for each, read its id (or the run to create), then answer batches and jobs
    read from ``requests`` until its ``end`` job; until told to stop or the parent is gone (runs in the child).
    ``fork_server``: a child started on its own forks this install's writer server where the command line asked for
    one and none listens (:func:`flasync.tracking._server.fork_server`), once its helpers have started."""
    # No cyclic collections until the run is ready (see _serve_runs): what MLflow's import and the store's opening make
    # (some 300,000 objects) is nearly all alive for good, and the collections its allocations set off, walking it
    # again and again, took a fifth of this process's CPU on the way to the run's creation.
    gc.disable()
    import mlflow  # noqa: F401  (before the helper's fork: it inherits MLflow imported)

    # Ctrl-C in a terminal signals the whole process group: the parent stops the child itself (it closes the
    # child's input, flushing first), so the child must not die of the key press and look lost.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Normal priority, not nice 19: on a machine whose cores are all busy a starved writer let the store fall 6-17 s
    # behind the run (benchmarks/checkpoint_lag.py with two busy loops beside it), and checkpoints wait for the
    # metrics they cover. Its CPU is the same either way (a default run took as long); at normal priority the store
    # stayed within 0.3 s.

    def reply(word: str) -> None:
        replies.write(word.replace("\n", " ") + "\n")
        replies.flush()

    # What the parent said to preload when it started this process: helpers forked now, before the store opens a
    # connection or any thread starts, do it on cores of their own while this process opens the store.
    names = {kind: [n for n in os.environ.get(variable, "").split(",") if n] for kind, variable in _PRELOADS.items()}
    aside = _Aside({kind: _Helper.fork() if names[kind] else None for kind in names})
    for kind in list(aside.helpers):
        aside.preload(kind, names[kind])  # a helper already gone is dropped: the writer preloads instead
    if fork_server:
        # A speed-up for later commands, never this writer's failure (a fork the system refuses, a socket it cannot
        # bind). After the helpers: they start on the run's model at once, while this process imports the rest of
        # what a writer needs (it needs it too) and then forks the server.
        with contextlib.suppress(Exception):
            _server.fork_server(_serve_forked)
    try:
        _serve_runs(tracking_uri, requests, reply, aside, names)
    finally:
        aside.close()


def _serve_runs(
    tracking_uri: str,
    requests: IO[str],
    reply: Callable[[str], None],
    aside: _Aside,
    names: Mapping[str, list[str]],
) -> None:
    """:func:`_serve`'s loop over runs, MLflow imported and the helpers, if any, forked; ``names``: what the parent
    said to preload for each kind of job when it started this process (what a helper preloads already)."""
    import mlflow

    # Open the store before the parent says what to do: that (SQLAlchemy's set-up, a new store's schema) overlaps with
    # the parent's own start-up, and only the run itself is left to create when the request comes.
    from flasync.tracking.sqlite_metrics import SqliteMetrics
    from flasync.tracking.store import prepare_sqlite_store

    client: Any = None
    direct: SqliteMetrics | None = None
    failure: Exception | None = None
    store: tuple[int, int] | None = None
    try:
        prepare_sqlite_store(tracking_uri)
        client = mlflow.MlflowClient(tracking_uri=tracking_uri)
        store = _store_file(tracking_uri)
        # Metrics straight into a SQLite store's tables where they fit (a tenth of log_batch's CPU); else log_batch.
        direct = SqliteMetrics.open(tracking_uri)
    except Exception as exc:
        failure = exc
    preloaded: dict[str, set[str]] = {kind: set(names[kind]) if kind in aside.helpers else set() for kind in names}

    def preload(kind: str, names: Sequence[str]) -> None:
        # Now, not once the run exists: the time until the parent asks for its run (it loads its data) is idle.
        fresh = [n for n in names if n and n not in preloaded[kind]]
        preloaded[kind].update(fresh)
        if fresh and failure is None and not aside.preload(kind, fresh):
            threading.Thread(target=_preload, args=(fresh,), name="tracking-preload", daemon=True).start()

    for kind, initial in names.items():
        preload(kind, initial)
    served = False
    while True:
        first = requests.readline().strip()
        if not first or first == _STOP:
            return
        if first.startswith(_PRELOAD):
            kind, _, asked = first.removeprefix(_PRELOAD).partition(" ")
            if kind in preloaded:
                preload(kind, asked.split(","))
            continue
        try:
            if failure is not None:
                raise failure
            if served and _store_file(tracking_uri) != store:
                # Its open connections would go on writing to the deleted file: a new child opens the new one.
                raise FileNotFoundError(f"{STORE_REPLACED} since this process opened it")
            served = True
            if first.startswith("{"):  # the run to create (see tracking._runs.open_run)
                from flasync.tracking._runs import open_run

                run_id, experiment_id = open_run(client, **json.loads(first), direct=direct)
                started = f" {run_id} {experiment_id}"
            else:
                run_id, started = first, ""
                client.get_run(run_id)  # connect now: a store the child cannot reach is known before training starts
        except Exception as exc:
            reply(f"error: {type(exc).__name__}: {exc}")
            return
        # Everything alive now (MLflow, SQLAlchemy: some 300,000 objects) lives as long as the process. Frozen, the
        # full collections that the store's object churn triggers skip it: a quarter less CPU per metric, and no walk
        # over tens of MB of heap that would evict the training process's data from the shared cache.
        gc.freeze()
        gc.enable()
        reply(f"ready{started}")
        monitor = _Monitor()  # per run: a new run starts with none
        try:
            ended = _answer(client, run_id, requests, reply, monitor, tracking_uri, aside, direct)
        finally:
            monitor.stop()
        if not ended:
            return


def _store_file(tracking_uri: str) -> tuple[int, int] | None:
    """Return the device and inode of a SQLite store's file (``(0, 0)`` while it is missing), None for other stores."""
    from flasync.tracking.store import sqlite_path

    path = sqlite_path(tracking_uri)
    if path is None:
        return None
    try:
        stat = path.stat()
    except FileNotFoundError:
        return (0, 0)
    return (stat.st_dev, stat.st_ino)


def _answer(
    client: Any,
    run_id: str,
    requests: IO[str],
    reply: Callable[[str], None],
    monitor: _Monitor,
    tracking_uri: str,
    aside: _Aside,
    direct: SqliteMetrics | None = None,
) -> bool:
    """Answer batches and jobs of run ``run_id``; return True after its ``end`` or ``release`` job (whether it
    succeeded or not: the child serves no run then), False when told to stop (or the parent is gone). Batches go to
    ``direct`` when it is given, else to MLflow's ``log_batch``."""
    from mlflow.entities import Metric

    # Deferred jobs run on threads of their own: the store's direct writer (one connection) stays with this one.
    logged: dict[str, str] = {}  # the run's models this process logged, by name (see _job)
    deferred = _Deferred(lambda request: _job(client, run_id, request, monitor, tracking_uri, aside, logged))
    for line in requests:
        if line.strip() == _STOP:
            deferred.settle_all()
            return False
        ending = False
        try:
            request = json.loads(line)
            if isinstance(request, dict):
                op = request.get("op")
                ending = op in _LEAVING
                if request.get("defer"):
                    deferred.start(str(request["defer"]), request)
                    reply("ok")
                elif op == "settle":
                    reply(deferred.settle(str(request["id"])))
                else:
                    if ending:
                        deferred.settle_all()  # a job left unsettled still ends before its run
                    reply(f"ok {_job(client, run_id, request, monitor, tracking_uri, aside, logged, direct)}")
            elif direct is not None:
                direct.write(run_id, request)
                reply("ok")
            else:
                metrics = [Metric(str(k), float(v), int(t), int(s)) for k, v, t, s in request]
                client.log_batch(run_id, metrics=metrics, synchronous=True)
                reply("ok")
        except Exception as exc:
            reply(f"error: {type(exc).__name__}: {exc}")
        if ending:
            return True
    return False


class ChildLogBatch:
    """A ``log_batch(metrics)`` callable whose MLflow calls run in a child process.

    The child starts at once; it connects to the store when it learns the run (``run_id`` here, or :meth:`bind`
    later), so a tracker can start it before it creates its run and let both import MLflow at the same time. Once a
    run's ``end`` job is answered (see :meth:`job`) the child is :attr:`idle`: it can serve another run of the same
    store (:meth:`bind` or :meth:`start` again), which is how :data:`IDLE` lets consecutive runs share one child.

    Args:
        tracking_uri: The store the child writes to (absolute: the child does not share relative paths' meaning).
        run_id: The run the metrics belong to; None: given later with :meth:`bind`.
        extra_env: Environment variables set for the child only, e.g. bounds on MLflow's HTTP timeout and retries.
        preload: Modules the child imports (``package.module``) or functions it calls (``package.module:function``)
            ahead for the ``model`` jobs it will be given (see :meth:`job`): on Linux, a helper process
            the child forks at its start does that and those jobs (see :class:`_Helper`); elsewhere the child
            does, on a thread, once the store is open.

    ``__call__`` raises ``RuntimeError`` with the child's error message, or ``ConnectionError`` when the child is
    gone; the caller (a :class:`~tracking.writer.MetricWriter`) keeps the batch and retries or falls back.
    """

    def __init__(
        self,
        tracking_uri: str,
        run_id: str | None = None,
        *,
        extra_env: Mapping[str, str] | None = None,
        preload: Sequence[str] = (),
    ) -> None:
        """Start the child (it imports MLflow in the background, and connects once it has the run id)."""
        lists = {"model": list(dict.fromkeys(preload))}
        for names in lists.values():
            _check_names(names)
        self._env = _child_env(tracking_uri, extra_env)
        self._preloaded: dict[str, set[str]] = {kind: set(names) for kind, names in lists.items()}
        # Known at its start, what to preload goes to helpers the child forks at once (see _Helper).
        initial = {_PRELOADS[kind]: ",".join(names) for kind, names in lists.items() if names}
        self._process = _launch({**self._env, **initial})
        self._ready = False
        self._bound = False
        self._run = 0
        self._lock = threading.Lock()
        self.told: set[str] = set()
        """What the trackers this child served warned of once for all of them (a later run it serves, such as a
        sweep's next child run, does not say it again)."""
        if run_id is not None:
            self.bind(run_id)

    def serves(self, tracking_uri: str, extra_env: Mapping[str, str] | None = None) -> bool:
        """Tell whether this child writes where a new one made with these arguments would, in the same environment
        (this process's, as it is now; variables that change between runs and mean nothing to the child, such as
        pytest's ``PYTEST_CURRENT_TEST``, aside)."""
        return _lasting(self._env) == _lasting(_child_env(tracking_uri, extra_env))

    def preload(self, names: Sequence[str]) -> None:
        """Have the child import or call ``names`` (see ``preload`` above) in the background, those it was not given
        before; never blocks.

        Raises:
            ValueError: The child serves a run now (preload before :meth:`bind` or :meth:`start`), or a name holds a
                comma or spans lines.
            ConnectionError: The child is gone.
        """
        _check_names(names)
        kind = "model"
        with self._lock:
            fresh = [name for name in dict.fromkeys(names) if name not in self._preloaded[kind]]
            if not fresh:
                return
            if self._bound:
                raise ValueError("the writer process serves a run: preload before its next one")
            self._preloaded[kind].update(fresh)
            self._write(f"{_PRELOAD}{kind} {','.join(fresh)}")

    def bind(self, run_id: str) -> None:
        """Tell the child which run its metrics belong to (once); it connects to the store then.

        Raises:
            ValueError: A run id was already given, or ``run_id`` is empty or spans lines.
            ConnectionError: The child is gone.
        """
        if not run_id or "\n" in run_id:
            raise ValueError(f"not a run id: {run_id!r}")
        with self._lock:
            if self._bound:
                raise ValueError("the writer process already has its run")
            self._bound = True
            self._run += 1
            self._write(run_id)

    def start(self, run: Mapping[str, Any], timeout: float) -> tuple[str, str]:
        """Have the child create the run (instead of :meth:`bind`): the experiment if needed, the run, its tags
        and params, as :func:`flasync.tracking._runs.open_run` does; return its ``(run_id, experiment_id)``.

        Args:
            run: :func:`~tracking._runs.open_run`'s keyword arguments (JSON values).
            timeout: Longest wait, in seconds, for the child to import MLflow, connect and create the run.

        Raises:
            ValueError: The child already has its run.
            ConnectionError: The child died or did not answer in time.
            RuntimeError: The store failed or refused (its message); the child has stopped.
        """
        with self._lock:
            if self._bound:
                raise ValueError("the writer process already has its run")
            self._bound = True
            self._run += 1
            self._write(json.dumps(dict(run)))
            assert self._process.stdout is not None
            readable, _, _ = select.select([self._process.stdout], [], [], timeout)
            if not readable:
                raise ConnectionError(f"the MLflow writer process did not open the run within {timeout:.0f} s")
            run_id, _, experiment_id = self._expect("ready").partition(" ")
            self._ready = True
            return run_id, experiment_id

    def _write(self, line: str) -> None:
        assert self._process.stdin is not None
        try:
            self._process.stdin.write(line + "\n")
            self._process.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise ConnectionError("the MLflow writer process is gone") from None

    @property
    def alive(self) -> bool:
        """Tell whether the child process is running."""
        return self._process.poll() is None

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._process.pid

    @property
    def run(self) -> int:
        """Which run the child serves or served last, counted from 1 (0 before its first)."""
        return self._run

    @property
    def idle(self) -> bool:
        """Tell whether the child is running and serves no run (none yet, or its last one ended)."""
        return not self._bound and self.alive

    def _expect(self, word: str) -> str:
        """Read one answer: ``word`` (then return what follows it on the line) or an error (raised)."""
        assert self._process.stdout is not None
        answer = self._process.stdout.readline().strip()
        if not answer:
            raise ConnectionError("the MLflow writer process is gone")
        if answer.startswith("error: "):
            raise RuntimeError(answer.removeprefix("error: "))
        head, _, rest = answer.partition(" ")
        if head != word:  # pragma: no cover - protocol violation
            raise ConnectionError(f"unexpected answer {answer!r} from the MLflow writer process")
        return rest

    def wait_ready(self, timeout: float) -> None:
        """Block until the child has connected to the store.

        Raises:
            ConnectionError: If the child died or did not answer within ``timeout`` seconds.
            RuntimeError: If the child could not reach the store (its message), or has no run yet (:meth:`bind`).
        """
        with self._lock:
            self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        if self._ready:
            return
        if not self._bound:
            raise RuntimeError("the writer process has no run yet: call bind(run_id) first")
        assert self._process.stdout is not None
        readable, _, _ = select.select([self._process.stdout], [], [], timeout)
        if not readable:
            raise ConnectionError(f"the MLflow writer process did not start within {timeout:.0f} s")
        self._expect("ready")
        self._ready = True

    @property
    def bound(self) -> bool:
        """Tell whether the child has its run (from :meth:`bind` or :meth:`start`)."""
        return self._bound

    @property
    def ready(self) -> bool:
        """Tell whether the child said it is connected (it may be by now without this knowing)."""
        return self._ready

    def _check_run(self, run: int | None) -> None:
        if run is not None and run != self._run:
            raise ConnectionError(f"the MLflow writer process has left run {run} (it serves run {self._run} now)")
        if not self._bound:
            raise RuntimeError("the writer process has no run yet: call bind(run_id) first")

    def __call__(self, metrics: Sequence[MetricRow], *, run: int | None = None) -> None:
        """Write one batch through the child; return when the store has it.

        Args:
            metrics: The batch.
            run: The caller's run (:attr:`run` when it began): the batch is refused once the child left it.

        Raises:
            ConnectionError: The child is gone, or has left ``run``.
            RuntimeError: The store refused the batch (its message), or the child has no run.
        """
        line = json.dumps([[m.key, m.value, m.timestamp, m.step] for m in metrics])
        with self._lock:
            self._check_run(run)
            if not self._ready:
                self._expect("ready")
                self._ready = True
            self._write(line)
            self._expect("ok")

    def job(self, request: Mapping[str, Any], timeout: float, *, run: int | None = None) -> str:
        """Have the child do one job (see the module docstring); return what its ``ok`` answer says.

        After an ``end`` or ``release`` job the child serves no run, whatever the answer (:attr:`idle`).

        Args:
            request: The job, e.g. ``{"op": "file", "path": "/tmp/x/summary.json", "folder": None}``;
                JSON-encodable.
            timeout: Longest wait for the child to connect, in seconds (the job itself is not bounded).
            run: The caller's run (:attr:`run` when it began): the job is refused once the child left it.

        Raises:
            ConnectionError: The child is gone, or has left ``run``.
            RuntimeError: The job failed (its message), or the child has no run.
        """
        line = json.dumps(dict(request))
        ending = request.get("op") in _LEAVING
        with self._lock:
            self._check_run(run)
            self._wait_ready(timeout)
            self._write(line)
            try:
                return self._expect("ok")
            except ConnectionError:
                ending = False  # no answer: the child is gone, not idle
                raise
            finally:
                if ending:
                    self._bound = self._ready = False

    def close(self) -> None:
        """Stop the child (after the batches already sent) and reap it; idempotent.

        A child that never got a run has nothing to write and is killed at once, rather than left to finish
        importing MLflow.
        """
        with self._lock:
            if not self._run and self._process.poll() is None:
                self._process.kill()
            stdin = self._process.stdin
            if stdin is not None and not stdin.closed:
                try:
                    stdin.write(_STOP + "\n")
                    stdin.close()
                except (BrokenPipeError, OSError):
                    pass
            try:
                self._process.wait(_EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:  # pragma: no cover - a child stuck in the store
                self._process.kill()
                self._process.wait(_EXIT_TIMEOUT_S)
            if self._process.stdout is not None:
                self._process.stdout.close()


class IdleChild:
    """The one idle writer process a process keeps for its next tracked run (see :data:`IDLE`); thread-safe.

    A tracker takes it (:meth:`take`) when it needs a child and hands it back (:meth:`keep`) once its run has ended.
    One child at most is kept: two runs at once each have their own (only an idle child is handed out), and the
    later to end replaces the other, which is stopped. A child kept is stopped when a run needs one for another store
    or environment, when this process exits, or by :meth:`clear`; a process forked from this one does not inherit it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._child: ChildLogBatch | None = None

    def take(self, tracking_uri: str, extra_env: Mapping[str, str] | None = None) -> ChildLogBatch | None:
        """Hand over the kept child if it is alive, idle and serves ``tracking_uri`` with ``extra_env`` (see
        :meth:`ChildLogBatch.serves`); else stop it (if any) and return None."""
        with self._lock:
            child, self._child = self._child, None
        if child is None:
            return None
        if child.idle and child.serves(tracking_uri, extra_env):
            return child
        child.close()
        return None

    def keep(self, child: ChildLogBatch) -> None:
        """Keep ``child`` for the next run if it is idle (stop the one kept before); else stop it."""
        if not child.idle:
            child.close()
            return
        with self._lock:
            earlier, self._child = self._child, child
        if earlier is not None:
            earlier.close()

    def warm(self, tracking_uri: str) -> None:
        """Start a writer process for ``tracking_uri`` (a local store: SQLite or files) and keep it for the next
        tracker, unless one that serves it is kept already: its start-up (MLflow's import, the store's opening) then
        overlaps with what this process does meanwhile, e.g. start another run. A remote store's is not started
        (its process's environment bounds HTTP as the tracker's settings say)."""
        from flasync.tracking.store import is_remote

        if is_remote(tracking_uri):
            return
        with self._lock:
            kept = self._child
        if kept is not None and kept.idle and kept.serves(tracking_uri, None):
            return
        self.keep(ChildLogBatch(tracking_uri))

    @property
    def child(self) -> ChildLogBatch | None:
        """The child kept now, if any (for inspection)."""
        return self._child

    def clear(self) -> None:
        """Stop the kept child, if any (at exit, and for tests that want a fresh one)."""
        with self._lock:
            child, self._child = self._child, None
        if child is not None:
            child.close()

    def _forget(self) -> None:
        """In a forked process: drop the parent's child (its pipes are the parent's) without stopping it."""
        self._lock = threading.Lock()
        self._child = None


IDLE = IdleChild()
"""This process's idle writer process (the library's only state across runs): used by
:meth:`tracking.MlflowTracker.prepare` and :meth:`~tracking.MlflowTracker.finish`; :func:`close_idle_writer` stops
it."""
atexit.register(IDLE.clear)
os.register_at_fork(after_in_child=IDLE._forget)


def warm_idle_writer(tracking_uri: str) -> None:
    """Start the MLflow writer process the next tracked run of this process on ``tracking_uri`` (a local store) will
    take, unless one is kept already, so that its start-up overlaps with what this process does first (see
    :meth:`IdleChild.warm`)."""
    IDLE.warm(tracking_uri)


def close_idle_writer() -> None:
    """Stop the MLflow writer process this process keeps between tracked runs, if any (it is stopped at exit too).

    Its memory (MLflow, and torch when it logged a model) is freed; the next tracked run starts a new one.
    """
    IDLE.clear()


def _check_names(names: Sequence[str]) -> None:
    """Raise ValueError if one of ``names`` could not travel as a preload name (a comma, a space, a line break)."""
    if any(not name or any(c in name for c in ", \n") for name in names):
        raise ValueError(f"not a module or function name: {list(names)!r}")


_VOLATILE = frozenset({"PYTEST_CURRENT_TEST", "COLUMNS", "LINES"})
"""Variables that change from one run to the next in one process (the test running, the terminal's size) and that
neither MLflow nor Python reads: a kept child serves on whatever they say."""


def _lasting(env: Mapping[str, str]) -> dict[str, str]:
    """Return ``env`` without the :data:`_VOLATILE` variables."""
    return {key: value for key, value in env.items() if key not in _VOLATILE}


def _child_env(tracking_uri: str, extra_env: Mapping[str, str] | None) -> dict[str, str]:
    """Return the environment of a child writing to ``tracking_uri``: this process's, with ``extra_env``."""
    env = dict(os.environ)
    env.update(extra_env or {})
    # The child imports this package from wherever the parent did, installed or not.
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    # The URI may carry credentials: through the environment, never on the command line (`ps` shows that).
    env[_URI_VARIABLE] = tracking_uri
    for variable in _PRELOADS.values():  # a writer process's own, when it starts with something to preload
        env.pop(variable, None)
    return env


class _Process(Protocol):
    """A writer process as its parent sees it: a :class:`subprocess.Popen`, or one a writer server forked
    (:class:`flasync.tracking._server.Forked`)."""

    pid: int
    stdin: IO[str] | None
    stdout: IO[str] | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


def _launch(env: Mapping[str, str]) -> _Process:
    """Start a writer process with the environment ``env``: a fork of this install's writer server where one
    answers (MLflow imported already, see :mod:`flasync.tracking._server`), else ``python -m
    flasync.tracking._child``."""
    if _server.enabled(env):
        down_read, down_write = os.pipe()
        up_read, up_write = os.pipe()
        try:
            forked = _server.fork_writer(env, down_read, up_write)
        finally:  # the writer holds its own ends now, or there is none
            os.close(down_read)
            os.close(up_write)
        if forked is not None:
            pid, pidfd = forked
            requests = open(down_write, "w", encoding="utf-8")  # noqa: SIM115 - the process's pipes, closed with it
            return _server.Forked(pid, pidfd, requests, open(up_read, encoding="utf-8"))
        os.close(down_write)
        os.close(up_read)
    return subprocess.Popen(
        [sys.executable, "-m", "flasync.tracking._child"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        encoding="utf-8",
        env=dict(env),
    )


def protocol_replies() -> IO[str]:
    """Return the stream the child answers its parent on (its standard output), and point ``sys.stdout`` at its
    standard error: what a library writes on stdout (MLflow's "View run ... at" lines when a run on a tracking
    server ends) must not enter the protocol, where the parent would take it for a broken child."""
    replies = sys.stdout
    sys.stdout = sys.stderr
    return replies


def _serve_forked(request: _server.Request, requests_fd: int, replies_fd: int) -> None:  # pragma: no cover
    """Serve as the writer process of a request's parent, in a fork of the writer server (see
    :mod:`flasync.tracking._server`): its pipes as standard input and output, its environment, working folder,
    import path and file mode mask; end when it is done."""
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(requests_fd, 0)
    os.dup2(replies_fd, 1)
    os.dup2(null, 2)
    for fd in (requests_fd, replies_fd, null):
        os.close(fd)
    os.environ.clear()
    os.environ.update(request.env)
    os.chdir(request.cwd)
    os.umask(request.umask)
    sys.path[:] = request.path
    requests = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 - the process's own streams, to its end
    replies = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stdin, sys.stdout = requests, open(2, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = sys.stdout
    _serve(request.env[_URI_VARIABLE], requests, replies)
    replies.flush()
    os._exit(0)


if __name__ == "__main__" and sys.argv[1:2] == ["--server"]:
    _server.serve(Path(sys.argv[2]), _serve_forked, float(sys.argv[3]) if len(sys.argv) > 3 else _server.IDLE_S)
elif __name__ == "__main__":
    _replies = protocol_replies()
    _serve(os.environ[_URI_VARIABLE], sys.stdin, _replies, fork_server=True)
    # Everything was written and answered: end without the interpreter's teardown (freeing MLflow, SQLAlchemy and
    # torch object by object took a second, which the parent's close() waited for).
    _replies.flush()
    os._exit(0)
