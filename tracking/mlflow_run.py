"""One MLflow run per federation, written through an explicit ``MlflowClient``.

Nothing here touches MLflow's global state (tracking URI, active run, experiment): every call goes
through ``MlflowClient(tracking_uri)`` with an explicit run id, so several trackers, on different
stores, can live in one process. All methods block on I/O except :meth:`Tracker.log_metrics`;
async callers run them in a thread. MLflow itself (over a second to import) is imported when a tracker
first needs it, so a run without tracking never loads it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Container, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args

import structlog
import yaml

from flasync.core.owner import owner_tags
from flasync.tracking import _files, _model
from flasync.tracking._child import IDLE, STORE_REPLACED, ChildLogBatch, IdleChild
from flasync.tracking._keys import safe_key
from flasync.tracking._runs import (
    _MAX_PARAMS_PER_CALL,
    _MAX_TAG_VALUE,
    RUNS_VIEW_KEY,
    RUNS_VIEW_TAG,
    SYSTEM_METRICS_INTERVAL_S,
    SYSTEM_METRICS_MIN_INTERVAL_S,
    _chunks,
    _context_tags,
    send_tags,
    start_monitor,
    stop_monitor,
)
from flasync.tracking.failover import Failover, RunIdentity
from flasync.tracking.metrics import MetricRow
from flasync.tracking.spool import SpoolWriter, dataset_input
from flasync.tracking.sqlite_metrics import SqliteMetrics
from flasync.tracking.store import (
    ExperimentDeletedError,
    artifact_location,
    bounded_http,
    ensure_experiment,
    http_env,
    is_remote,
    redact_uri,
    resolve_tracking_uri,
    sqlite_path,
)
from flasync.tracking.writer import MetricWriter

if TYPE_CHECKING:
    import mlflow
    import torch

__all__ = [
    "MlflowTracker",
    "NullTracker",
    "RunStatus",
    "Tracker",
    "artifact_bytes",
]


RunStatus = Literal["FINISHED", "FAILED", "KILLED"]

_MAX_PARAM_VALUE = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
_CHILD_START_TIMEOUT_S = 60.0
_MONITOR_STOP_TIMEOUT_S = 5.0
_NOTHING: Mapping[str, Any] = MappingProxyType({})


class Tracker(Protocol):
    """Where a federation records its run: parameters, tags, metrics and artifacts.

    ``run_id`` is None until :meth:`start`. Every method but :meth:`log_metrics` may block.
    """

    @property
    def run_id(self) -> str | None:
        """The run's id (None before :meth:`start`)."""
        ...

    def prepare(self) -> None:
        """Get ready for :meth:`start` without blocking, e.g. start helper processes; may do nothing.

        A federation calls it before it loads its data, so that work overlaps with the data's preparation.
        """
        ...

    def start(
        self,
        *,
        experiment: str,
        run_name: str | None = None,
        params: Mapping[str, Any] = _NOTHING,
        tags: Mapping[str, str] = _NOTHING,
    ) -> str:
        """Open the run and record its parameters and tags; return its id."""
        ...

    def resume(self, run_id: str) -> str:
        """Reopen an existing run (status back to ``RUNNING``) to log more to it; return its id."""
        ...

    def log_metrics(self, metrics: list[MetricRow]) -> None:
        """Queue metrics for the run without blocking."""
        ...

    def log_dict(self, data: Mapping[str, Any], artifact_file: str) -> None:
        """Store ``data`` as a JSON (or YAML, by suffix) artifact at ``artifact_file``."""
        ...

    def log_file(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Store a local file (or folder) as an artifact, in folder ``artifact_path``."""
        ...

    def log_bytes(self, data: bytes, artifact_file: str) -> None:
        """Store ``data`` as an artifact at ``artifact_file``."""
        ...

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set tags on the run."""
        ...

    def log_dataset(
        self, name: str, digest: str, source: str, profile: Mapping[str, Any], context: str = "training"
    ) -> None:
        """Record a data set the run used as an MLflow dataset input."""
        ...

    def flush(self) -> bool:
        """Block until queued metrics were written (or a bounded wait passed); True when all were."""
        ...

    def finish(self, status: RunStatus) -> None:
        """Write what is queued and close the run with ``status``; idempotent.

        Before :meth:`start`, it only stops what :meth:`prepare` started.
        """
        ...

    def ui_command(self) -> str | None:
        """Return the shell command that opens the store in the MLflow UI, if there is one."""
        ...


class NullTracker:
    """A :class:`Tracker` that records nothing (``--no-tracking``)."""

    def __init__(self) -> None:
        self.run_id: str | None = None

    def prepare(self) -> None:
        """Do nothing."""

    def start(
        self,
        *,
        experiment: str,
        run_name: str | None = None,
        params: Mapping[str, Any] = _NOTHING,
        tags: Mapping[str, str] = _NOTHING,
    ) -> str:
        """Do nothing; return an empty run id."""
        return ""

    def resume(self, run_id: str) -> str:
        """Do nothing; return an empty run id."""
        return ""

    def log_metrics(self, metrics: list[MetricRow]) -> None:
        """Drop the metrics."""

    def log_dict(self, data: Mapping[str, Any], artifact_file: str) -> None:
        """Drop the data."""

    def log_file(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Ignore the file."""

    def log_bytes(self, data: bytes, artifact_file: str) -> None:
        """Drop the bytes."""

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Drop the tags."""

    def log_dataset(
        self, name: str, digest: str, source: str, profile: Mapping[str, Any], context: str = "training"
    ) -> None:
        """Drop the dataset."""

    def flush(self) -> bool:
        """Return True at once."""
        return True

    def finish(self, status: RunStatus) -> None:
        """Do nothing."""

    def ui_command(self) -> str | None:
        """Return None: there is no store."""
        return None


class MlflowTracker:
    """A :class:`Tracker` writing one MLflow run through ``MlflowClient(tracking_uri)``.

    Metrics go through a :class:`~tracking.writer.MetricWriter` (batched ``log_batch`` calls from
    a background thread); everything else is a direct, blocking client call.

    Tracking never takes the run down: when the store cannot be reached or errors - at :meth:`start` or later -
    every record (params, tags, metrics, artifacts, the final status) goes to a JSON-lines spool (see
    :mod:`flasync.tracking.spool`), whose path is logged (``tracking.spooling``) and printed on stderr once. While
    spooling, the store is tried again at most every ``retry_interval_s`` (when there is something to write);
    once it answers, the spool is replayed in order and records go direct again. What is left at :meth:`finish`
    stays in the spool, and the ``flasync tracking replay PATH`` command that sends it is logged and printed.
    Calls to an HTTP(S) server are bounded to ``http_timeout_s`` per request and ``http_retries`` retries
    (:func:`flasync.tracking.spool.bounded_http`; the metric child process gets the same bounds in its environment).

    On a local store (SQLite or files) a new experiment gets the artifact location
    ``file://<artifact_root>/<experiment name>``; by default ``artifact_root`` is the ``artifacts``
    folder next to the SQLite file, i.e. ``mlruns/artifacts`` for the default store.

    Args:
        tracking_uri: The store; ``MLFLOW_TRACKING_URI`` if set, else
            :data:`DEFAULT_TRACKING_URI`, when None. A relative SQLite path is made absolute
            against the current directory now.
        artifact_root: Folder or URI under which new experiments keep their artifacts.
        system_metrics: Also run MLflow's ``SystemMetricsMonitor`` (CPU, memory, disk, network,
            GPU) for the run.
        system_metrics_interval_s: Seconds between two samples of the system monitor (at least
            :data:`~tracking._runs.SYSTEM_METRICS_MIN_INTERVAL_S`, 0.1).
        max_batch: Most metrics per ``log_batch`` call (MLflow accepts 1000).
        flush_interval_s: Longest time a metric waits before it is written, in seconds.
        flush_timeout_s: Longest wait of :meth:`flush` and of :meth:`finish` for a failing
            backend, in seconds.
        writer_process: Send metric batches from a spawned child process (see :mod:`flasync.tracking._child`), so
            MLflow's SQL work does not compete with training for this process's GIL.
        logger: Where warnings go; ``structlog.get_logger("tracking.mlflow")`` when None.
        spool_path: The spool file used if the store fails; a new file under ``spool_root`` when None.
        spool_root: Folder of default spool files, relative to the current directory now.
        retry_interval_s: Least time between two tries to reach a failed store, in seconds.
        http_timeout_s: Connect/read timeout of one request to an HTTP(S) server, in seconds.
        http_retries: Retries of one request to an HTTP(S) server.
        runs_view: A view of the experiment's runs table, e.g. ``{"selectedColumns": ["metrics.`accuracy`"]}``
            (the state MLflow's UI shares): saved on the experiment as the tag ``mlflow.sharedViewState.<name>``,
            where ``name`` is :data:`RUNS_VIEW_KEY`; :meth:`ui_url` opens it.
        preload: What the writer process imports (``package.module``) or calls (``package.module:function``) ahead,
            while the caller trains, for the model :meth:`log_model_from` will hand it, e.g.
            ``("flasync.tracking._model:warm_up",)``: on Linux, a helper process of the writer process's does
            that and the model's export on a core of its own (see :mod:`flasync.tracking._child`).
        idle_writers: Where an idle writer process is taken from and left for the next tracker: the process's
            holder :data:`flasync.tracking._child.IDLE` by default; a tracker given its own :class:`IdleChild` (a test,
            or
            an application that wants no process-wide sharing) shares only with trackers given the same one.
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        *,
        artifact_root: str | None = None,
        system_metrics: bool = False,
        system_metrics_interval_s: float = SYSTEM_METRICS_INTERVAL_S,
        max_batch: int = 1000,
        flush_interval_s: float = 0.5,
        flush_timeout_s: float = 30.0,
        writer_process: bool = True,
        logger: Any = None,
        spool_path: str | Path | None = None,
        spool_root: str | Path = "mlruns/spool",
        retry_interval_s: float = 5.0,
        http_timeout_s: int = 10,
        http_retries: int = 1,
        runs_view: Mapping[str, Any] | None = None,
        preload: Sequence[str] = (),
        idle_writers: IdleChild = IDLE,
    ) -> None:
        self.tracking_uri = resolve_tracking_uri(tracking_uri)
        self._idle_writers = idle_writers
        self._preload = tuple(preload)
        self._writer_reused = False
        self._deferred = itertools.count(1)
        """Numbers the writer process's deferred jobs (see :meth:`start_model_from`)."""
        self._run = RunIdentity(self.tracking_uri, probe_timeout_s=http_timeout_s)
        self._artifact_root = artifact_root
        least = SYSTEM_METRICS_MIN_INTERVAL_S
        if not system_metrics_interval_s >= least or not math.isfinite(system_metrics_interval_s):
            raise ValueError(
                f"system_metrics_interval_s must be a finite number >= {least}, got {system_metrics_interval_s}"
            )
        self._system_metrics = system_metrics
        self._system_metrics_interval = float(system_metrics_interval_s)
        self._max_batch = max_batch
        self._flush_interval = flush_interval_s
        self._flush_timeout = flush_timeout_s
        self._log = logger if logger is not None else structlog.get_logger("tracking.mlflow")
        self._writer: MetricWriter | None = None
        self._runs_view = None if runs_view is None else json.dumps(dict(runs_view))
        self._held_steps: dict[str, Container[int]] = {}
        """Metric key -> the steps the store held when this run was resumed (empty for a new run)."""
        self._monitor: Any = None
        self._monitor_in_child = False
        """MLflow's system monitor runs in the writer process (its samples are system-wide, not this process's)."""
        self._finished = False
        self._opening: threading.Thread | None = None
        """The thread opening the run of a ``start(wait=False)``."""
        self._opened = threading.Event()
        """Set while no run is being opened (the metric writer sends only then)."""
        self._opened.set()
        self._open_error: BaseException | None = None
        self._no_run = False
        """Opening the run failed: queued metrics have nowhere to go."""
        self._writer_process = writer_process
        self._child: ChildLogBatch | None = None
        self._child_run: int | None = None
        """The writer process's run number for this tracker's run (see :attr:`ChildLogBatch.run`)."""
        self._http_timeout = http_timeout_s
        self._http_retries = http_retries
        self._failover = Failover(
            self._run,
            log=self._log,
            http=self._http,
            experiment_id=self._experiment_id,
            retry_interval_s=retry_interval_s,
            spool_path=Path(spool_path).absolute() if spool_path is not None else None,
            spool_root=Path(spool_root).expanduser().absolute(),
        )

    @property
    def run_id(self) -> str | None:
        """The MLflow run (None before :meth:`start`, or while the store never answered)."""
        return self._run.run_id

    @property
    def experiment_id(self) -> str | None:
        """The experiment's id once known."""
        return self._run.experiment_id

    @property
    def _started_at(self) -> int | None:
        return self._run.started_at

    @property
    def spool_path(self) -> Path | None:
        """The spool file, if the store failed at some point of this run; else None."""
        spool = self._failover.spool
        return spool.path if spool is not None else None

    @property
    def offline(self) -> bool:
        """Whether records currently go to the spool (the store failed and has not answered since)."""
        return self._failover.offline

    def replay_command(self) -> str | None:
        """Return the command that sends what is left in the spool, or None when nothing is left."""
        return self._failover.replay_command()

    @property
    def writer(self) -> MetricWriter | None:
        """The metric writer of the run (for its statistics); None before :meth:`start`."""
        return self._writer

    def prepare(self) -> None:
        """Start the metric writer process now, if this tracker uses one; idempotent.

        The process imports MLflow (over a second) while the caller goes on, e.g. loads its data; :meth:`start`
        hands it the run once the run exists (and starts it itself if this was not called). The process an earlier
        tracker of this process left idle on the same store is taken instead, MLflow loaded and ``preload`` done
        (see :data:`flasync.tracking._child.IDLE`); only stopping a kept one for another store waits (tens of ms).
        :meth:`finish` leaves it idle for the next tracker once the run has ended, or stops it, also when
        :meth:`start` never came.
        """
        if not self._writer_process or self._child is not None or self._started_at is not None:
            return
        extra = self._child_env()
        child = self._idle_writers.take(self.tracking_uri, extra)
        if child is not None:
            try:
                child.preload(self._preload)
                self._writer_reused = True
            except (ConnectionError, ValueError):
                child.close()
                child = None
        self._child = child or self._new_child()

    def _new_child(self) -> ChildLogBatch:
        """Start a writer process, told what to preload."""
        return ChildLogBatch(self.tracking_uri, extra_env=self._child_env(), preload=self._preload)

    def _child_env(self) -> dict[str, str]:
        """Return the writer process's own environment variables: bounds on a server's HTTP timeout and retries."""
        if not is_remote(self.tracking_uri):
            return {}
        bounds = http_env(self._http_timeout, self._http_retries)
        return {k: v for k, v in bounds.items() if k not in os.environ}

    @property
    def writer_reused(self) -> bool:
        """Whether :meth:`prepare` took over a writer process an earlier run of this process left idle (MLflow
        imported, the store open, what it preloaded done) rather than starting one."""
        return self._writer_reused

    def start(
        self,
        *,
        experiment: str,
        run_name: str | None = None,
        params: Mapping[str, Any] = _NOTHING,
        tags: Mapping[str, str] = _NOTHING,
        wait: bool = True,
    ) -> str:
        """Create the run (and the experiment if needed), then record params and tags.

        Params are sent with ``log_batch`` in calls of at most 100, values stringified and cut to
        6000 characters; keys and tag keys that MLflow would refuse have their odd characters
        replaced by ``_``. If recording the params fails, the run is marked ``FAILED``.

        With ``wait=False`` the run is opened on a background thread and this returns ``""`` at once, so the caller
        can train while the writer process imports MLflow and creates the run (seconds on a busy machine): the
        run's start time is this call's; metrics logged meanwhile queue and are sent once the run exists; every
        other record (artifacts, tags, a model, :meth:`flush`, :meth:`finish`) waits for it; :meth:`opened` waits
        and returns the id, or raises what opening the run raised.

        Args:
            experiment: The experiment's name; created when missing.
            run_name: The run's display name; MLflow picks one when None.
            params: The run's parameters, e.g. the flattened configuration.
            tags: The run's tags.
            wait: Return only once the run exists (True), or at once (see above).

        Returns:
            The run id (``""`` with ``wait=False``, or when the store never answered).

        Raises:
            RuntimeError: The tracker was already started, or the experiment is deleted.
            mlflow.exceptions.MlflowException: The store refused a call.
        """
        if self._started_at is not None:
            raise RuntimeError(f"this tracker already started run {self.run_id or '(spooled)'}")
        self.prepare()  # the writer process imports MLflow while the caller prepares its data
        run = self._run
        run.started_at = int(time.time() * 1000)
        run.experiment, run.run_name = experiment, run_name
        given_tags = {safe_key(k): str(v)[:_MAX_TAG_VALUE] for k, v in {**tags, **owner_tags()}.items()}
        clean_params = {safe_key(k): _param_value(v) for k, v in params.items()}
        self._open_error = None
        self._opened.clear()
        # From now on metrics queue; the writer's thread sends them once the run is open (see _log_metric_batch).
        self._writer = self._metric_writer()
        if wait:
            self._open(experiment, run_name, given_tags, clean_params)
            return self.run_id or ""
        self._opening = threading.Thread(
            target=self._open_in_background,
            args=(experiment, run_name, given_tags, clean_params),
            name="tracking-open-run",
            daemon=True,
        )
        self._opening.start()
        return ""

    def opened(self, timeout: float | None = None) -> str:
        """Wait until the run a ``start(wait=False)`` began is open; return its id (``""`` while the store never
        answered: records go to the spool). Returns at once after a waiting :meth:`start`.

        Args:
            timeout: Longest wait in seconds; None waits as long as opening takes (it is bounded by the writer
                process's start timeout and the store's HTTP bounds).

        Raises:
            TimeoutError: The run was not open within ``timeout``.
            RuntimeError: The experiment is deleted (:class:`~tracking.store.ExperimentDeletedError`).
            mlflow.exceptions.MlflowException: The store refused a call.
        """
        opening = self._opening
        if opening is not None:
            opening.join(timeout)
            if opening.is_alive():
                raise TimeoutError(f"the MLflow run was not open after {timeout} s")
        if self._open_error is not None:
            raise self._open_error
        return self.run_id or ""

    def _open_in_background(
        self, experiment: str, run_name: str | None, given_tags: Mapping[str, str], clean_params: Mapping[str, str]
    ) -> None:
        try:
            self._open(experiment, run_name, given_tags, clean_params)
        except BaseException as exc:  # handed to opened(); nothing may escape a thread
            self._open_error = exc

    def _await_open(self) -> None:
        """Block until a run being opened in the background is open (or failed); not on the opening thread."""
        opening = self._opening
        if opening is not None and opening is not threading.current_thread():
            opening.join()

    def _open(
        self, experiment: str, run_name: str | None, given_tags: Mapping[str, str], clean_params: Mapping[str, str]
    ) -> None:
        """Create the run and record its params and tags (directly or through the writer process, else spooled),
        then start the writers. The metric writer waits for this to end; when it raises, queued metrics are dropped
        (there is no run to hold them)."""
        try:
            self._open_run(experiment, run_name, given_tags, clean_params)
        except BaseException:
            writer, self._writer = self._writer, None
            self._no_run = True
            self._opened.set()
            if writer is not None:
                writer.close(0)
            raise
        finally:
            self._opened.set()

    def _open_run(
        self, experiment: str, run_name: str | None, given_tags: Mapping[str, str], clean_params: Mapping[str, str]
    ) -> None:
        run = self._run
        db = sqlite_path(self.tracking_uri)
        if db is not None:
            db.parent.mkdir(parents=True, exist_ok=True)
        if self._start_in_child(experiment, run_name, given_tags, clean_params):
            assert self.run_id is not None
            self._start_writers(self.run_id)
            return
        clean_tags = given_tags
        with self._failover.lock:
            try:
                with self._http():
                    # Before MLflow's context tags: a server that does not answer costs no MLflow import here.
                    client = run.connect(self._log)
                    from mlflow.entities import Param

                    context = _context_tags()
                    clean_tags = {**{safe_key(k): str(v)[:_MAX_TAG_VALUE] for k, v in context.items()}, **given_tags}
                    experiment_id = self._experiment_id(client, experiment)
                    created = client.create_run(
                        experiment_id, run_name=run_name, tags=clean_tags, start_time=run.started_at
                    )
                    run.experiment_id = experiment_id
                    run.run_id = created.info.run_id
                    entries = [Param(k, v) for k, v in clean_params.items()]
                    for chunk in _chunks(entries, _MAX_PARAMS_PER_CALL):
                        client.log_batch(created.info.run_id, params=chunk, synchronous=True)
            except ExperimentDeletedError:
                run.started_at = None
                self._stop_child()
                raise
            except Exception as exc:
                spool = self._failover.go_offline(exc)
                if run.run_id is None:
                    spool.tags({**_basic_context_tags(), **clean_tags})
                spool.params(clean_params)
            except BaseException:
                # Interrupted while recording the params: leave no RUNNING run behind.
                self._finished = True
                self._stop_child()
                if run.run_id is not None and run.client is not None:
                    with contextlib.suppress(Exception), self._http():
                        run.client.set_terminated(run.run_id, "KILLED")
                raise
        if self.run_id is not None and not self.offline:
            self._start_writers(self.run_id)
        else:
            self._stop_child()
            if self._writer is None:
                self._writer = self._metric_writer()

    def _start_in_child(
        self, experiment: str, run_name: str | None, tags: Mapping[str, str], params: Mapping[str, str]
    ) -> bool:
        """Have the writer process create the run (see :func:`open_run`); False when there is no such process or
        it failed (then it is stopped, and :meth:`start` does the work itself: through the spool if need be)."""
        child = self._child
        if child is None:
            return False
        request = {
            "experiment": experiment,
            "artifact_location": self._artifact_location(experiment),
            "runs_view": self._runs_view,
            "run_name": run_name,
            "tags": dict(tags),
            "params": dict(params),
            "start_time": self._run.started_at,
            "source": sys.argv[0] if sys.argv and sys.argv[0] else None,
        }
        try:
            run_id, experiment_id = child.start(request, _CHILD_START_TIMEOUT_S)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            self._log.info("tracking.writer_process_start_failed", error=redact_uri(str(exc))[:300], metrics=False)
            died = not child.alive
            self._stop_child()
            if not self._writer_reused or not (died or STORE_REPLACED in str(exc)):
                return False
            # A kept process died idle, or its store's file was replaced since it opened it: a new one may succeed.
            self._writer_reused = False
            self._child = self._new_child()
            return self._start_in_child(experiment, run_name, tags, params)
        self._child_run = child.run
        self._run.run_id, self._run.experiment_id = run_id, experiment_id
        return True

    def _stop_child(self) -> None:
        if self._child is not None:
            self._child.close()
            self._child = None

    def _release_child(self, reusable: bool) -> None:
        """Leave the writer process idle for the next tracker of this process (see :data:`flasync.tracking._child.IDLE`)
        when ``reusable`` and it serves no run (it ended this one, or never had it); else stop it."""
        child, self._child = self._child, None
        if child is None:
            return
        if reusable and child.idle:
            self._idle_writers.keep(child)
        else:
            child.close()

    def _metric_writer(self) -> MetricWriter:
        return MetricWriter(
            self._log_metric_batch,
            max_batch=self._max_batch,
            flush_interval_s=self._flush_interval,
            close_timeout_s=self._flush_timeout,
            logger=self._log,
        )

    def resume(self, run_id: str) -> str:
        """Reopen an existing run: set its status back to ``RUNNING`` and log to it from now on.

        Unlike :meth:`start`, this needs the store: a run that cannot be reached cannot be continued.

        The run goes on from a checkpoint, so it logs again the steps its first life logged after that checkpoint
        (up to where it was stopped or killed). Each step is written once: for every metric key the store holds,
        values at the steps it holds for that key are dropped, and the steps it misses (per-update series, stepped
        by task, finish out of order) are written (MLflow's ``system/`` metrics excepted: their steps count
        samples and start again at 0).

        Args:
            run_id: The run to continue (e.g. one ended ``KILLED`` by an interrupt).

        Returns:
            ``run_id``.

        Raises:
            RuntimeError: The tracker was already started.
            mlflow.exceptions.MlflowException: The run does not exist, or the store refused a call.
        """
        if self._started_at is not None:
            raise RuntimeError(f"this tracker already started run {self.run_id or '(spooled)'}")
        self.prepare()
        identity = self._run
        client = identity.connect(self._log)
        with self._http():
            run = client.get_run(run_id)
            experiment = client.get_experiment(run.info.experiment_id)
            client.update_run(run_id, status="RUNNING")
            keys = [metric.key for metric in run.data.to_proto().metrics if not metric.key.startswith("system/")]
            self._held_steps = self._stored_steps(client, run_id, keys)
            for key, value in owner_tags().items():  # this process owns the run from now on
                client.set_tag(run_id, key, value)
        identity.started_at = int(time.time() * 1000)
        identity.experiment, identity.run_name = experiment.name, run.info.run_name
        identity.experiment_id = run.info.experiment_id
        identity.run_id = run_id
        self._start_writers(run_id)
        return run_id

    def _stored_steps(self, client: mlflow.MlflowClient, run_id: str, keys: Sequence[str]) -> dict[str, Container[int]]:
        """Return, per key of ``keys``, the steps the store holds for run ``run_id``.

        A SQLite store answers in one query; another store key by key, through the metric histories.
        """
        direct = SqliteMetrics.open(self.tracking_uri)
        if direct is not None:
            try:
                stored = direct.steps(run_id)
            finally:
                direct.close()
        else:
            stored = {key: sorted({int(m.step) for m in client.get_metric_history(run_id, key)}) for key in keys}
        return {key: _compact(stored.get(key, [])) for key in keys}

    def _http(self) -> contextlib.AbstractContextManager[None]:
        return bounded_http(self.tracking_uri, timeout_s=self._http_timeout, retries=self._http_retries)

    def _start_writers(self, run_id: str) -> None:
        """Hand the metric child process (if any) its run, then start the metric writer and the system monitor."""
        child = self._child
        if child is not None:
            # Not waited for: the child connects while training starts, and metrics queue until it is ready.
            try:
                if not child.bound:
                    child.bind(run_id)
                    self._child_run = child.run
            except ConnectionError as exc:
                self._writer_process_failed(exc)
        if self._writer is None:
            self._writer = self._metric_writer()
        interval_s = self._system_metrics_interval
        if self._system_metrics and self._child_job({"op": "monitor", "interval_s": interval_s}):
            self._monitor_in_child = True
        elif self._system_metrics:
            # Its samples go through this tracker's writer (batched, and spooled while the store fails).
            self._monitor = start_monitor(run_id, self.tracking_uri, self.log_metrics, interval_s)

    @property
    def system_metrics_interval_s(self) -> float:
        """Seconds between two samples of the system monitor (when ``system_metrics`` is on)."""
        return self._system_metrics_interval

    def log_metrics(self, metrics: list[MetricRow]) -> None:
        """Queue metrics for the run; never blocks (dropped before start and after finish).

        In a resumed run, a metric at a step the store already holds for its key is dropped (see :meth:`resume`).

        Args:
            metrics: The metrics; the list is handed over.
        """
        if self._writer is None:
            return
        held = self._held_steps
        if held:
            metrics = [row for row in metrics if row.step not in held.get(row.key, ())]
        self._writer.submit(metrics)

    def log_dict(self, data: Mapping[str, Any], artifact_file: str) -> None:
        """Store ``data`` as an artifact: YAML for ``.yaml``/``.yml``, JSON otherwise.

        JSON values it cannot encode (paths, NumPy scalars, ...) are written as their ``str``.

        Args:
            data: A JSON-like mapping.
            artifact_file: Path of the artifact inside the run, e.g. ``"config/run.json"``.
        """
        self.log_bytes(artifact_bytes(data, artifact_file), artifact_file)

    def log_file(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Store a local file or folder as an artifact.

        Args:
            path: The local file or folder.
            artifact_path: Folder inside the run's artifacts; the root when None.
        """
        self._check_started()
        local = os.fspath(path)
        if self._child_job({"op": "file", "path": os.path.abspath(local), "folder": artifact_path}):
            return

        def send(run_id: str, client: mlflow.MlflowClient) -> None:
            client.log_artifact(run_id, local, artifact_path)

        self._failover.deliver(send, lambda spool: spool.artifact_path(local, artifact_path))

    def log_bytes(self, data: bytes, artifact_file: str) -> None:
        """Store ``data`` as an artifact.

        Args:
            data: The file's content.
            artifact_file: Path of the artifact inside the run, e.g. ``"clients/table.csv"``.
        """
        self.log_artifacts({artifact_file: data})

    def log_artifacts(self, files: Mapping[str, bytes]) -> None:
        """Store several artifacts as :meth:`log_bytes` does one, with a writer process in one job (one round trip
        where a run's end would wait for one per file); without one, or when it fails, each from this process or
        into the spool.

        Args:
            files: Each artifact's content by its path inside the run, e.g. ``{"plots/a.svg": b"<svg ..."}``.

        Raises:
            ValueError: A path names no file (nothing is stored then).
        """
        self._check_started()
        names = {artifact_file: _artifact_name(artifact_file) for artifact_file in files}
        if not files:
            return
        if self._child is not None:
            with tempfile.TemporaryDirectory(prefix="tracking-") as tmp:
                entries = []
                for index, (artifact_file, data) in enumerate(files.items()):
                    folder, name = names[artifact_file]
                    local = Path(tmp, str(index), name)  # one folder each: two artifacts may share a name
                    local.parent.mkdir()
                    local.write_bytes(data)
                    entries.append([str(local), folder or None])
                if self._child_job({"op": "files", "files": entries}):
                    return
        for artifact_file, data in files.items():  # storing a file twice replaces it: those stored already are kept
            self._deliver_bytes(data, artifact_file, *names[artifact_file])

    def _deliver_bytes(self, data: bytes, artifact_file: str, folder: str, name: str) -> None:
        """Store ``data`` as the artifact ``artifact_file`` (``folder/name``) from this process, or spool it."""

        def send(run_id: str, client: mlflow.MlflowClient) -> None:
            with tempfile.TemporaryDirectory(prefix="tracking-") as tmp:
                local = Path(tmp, name)
                local.write_bytes(data)
                client.log_artifact(run_id, str(local), folder or None)

        self._failover.deliver(send, lambda spool: spool.artifact_bytes(data, artifact_file))

    def log_dataset(
        self, name: str, digest: str, source: str, profile: Mapping[str, Any], context: str = "training"
    ) -> None:
        """Record a data set as an MLflow dataset input of the run (shown in the run's page and the runs table).

        Args:
            name: The data set's name, e.g. ``digits``.
            digest: A short content hash telling versions of the data apart.
            source: Where the data came from (a description or a path).
            profile: Sizes and other figures, stored as JSON (e.g. rows, features, classes, clients, partition).
            context: What the run used it for (``training`` or ``evaluation``).
        """
        self._check_started()
        text = json.dumps(dict(profile), default=str)
        dataset = {"name": name, "digest": digest, "source": source, "profile": text, "context": context}
        if self._child_job({"op": "dataset", "dataset": dataset}):
            return

        def send(run_id: str, client: mlflow.MlflowClient) -> None:
            client.log_inputs(run_id, datasets=[dataset_input(name, digest, source, text, context)])

        self._failover.deliver(send, lambda spool: spool.dataset(name, digest, source, text, context))

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set tags on the run (values stringified and cut to 8000 characters).

        Args:
            tags: Tag names and values.
        """
        self._check_started()
        clean = {safe_key(k): str(v)[:_MAX_TAG_VALUE] for k, v in tags.items()}
        if self._child_job({"op": "tags", "tags": clean}):
            return

        def send(run_id: str, client: mlflow.MlflowClient) -> None:
            send_tags(client, run_id, clean)

        self._failover.deliver(send, lambda spool: spool.tags(clean))

    def send_soon(self) -> None:
        """Start writing the queued metrics now, without waiting for them (see :meth:`flush`, which waits)."""
        writer = self._writer
        if writer is not None:
            writer.send_soon()

    def flush(self) -> bool:
        """Block until queued metrics were written (or spooled), or ``flush_timeout_s`` passed (then warn).

        Returns:
            True when every metric queued before the call was written or spooled.
        """
        if self._writer is None:
            return True
        try:
            self._writer.flush(self._flush_timeout)
        except TimeoutError:
            self._log.warning(
                "tracker.flush_timeout",
                pending=self._writer.pending,
                timeout_s=self._flush_timeout,
                metrics=False,
            )
            return False
        return True

    def finish(self, status: RunStatus) -> None:
        """Write queued metrics, stop the system monitor and close the run; idempotent.

        Whatever the store does not take goes to the spool; the store is tried once more (whatever
        ``retry_interval_s`` says) before the spool is left for ``flasync tracking replay``, whose command is then
        logged (``tracking.spool_left``) and printed on stderr.

        Args:
            status: ``"FINISHED"``, ``"FAILED"`` or ``"KILLED"``.

        Raises:
            ValueError: ``status`` is not one of those.
        """
        if status not in get_args(RunStatus):
            raise ValueError(f"status must be one of {get_args(RunStatus)}, not {status!r}")
        self._await_open()
        if self._started_at is None or self._finished:
            self._release_child(True)  # prepared, never started (or stopped already)
            return
        self._finished = True
        try:
            if self._monitor is not None:
                self._stop_monitor(self._monitor)
                self._monitor = None
        finally:
            if self._writer is not None:
                self._writer.close(self._flush_timeout)
            end = int(time.time() * 1000)
            ended = self._child_job({"op": "end", "status": status, "end_time": end})
            self._release_child(ended)

            def send(run_id: str, client: mlflow.MlflowClient) -> None:
                client.set_terminated(run_id, status, end_time=end)

            failover = self._failover
            with failover.lock:
                if not ended:
                    if failover.offline:
                        failover.try_recover(force=True)
                    failover.deliver(send, lambda spool: spool.status(status, end))
                failover.close()

    def ui_command(self) -> str | None:
        """Return the shell command that opens this store in the MLflow UI.

        Artifacts under the experiments' ``file://`` locations are served by the UI as they are;
        it needs no artifact flag. None when the store is a server (open its URL instead).

        Returns:
            E.g. ``"mlflow ui --backend-store-uri sqlite:////home/me/proj/mlruns/mlflow.db"``.
        """
        scheme = self.tracking_uri.partition(":")[0].lower()
        if scheme in ("http", "https", "databricks", "databricks-uc", "uc"):
            return None
        return f"mlflow ui --backend-store-uri {shlex.quote(self.tracking_uri)}"

    def ui_url(self, base: str = "http://127.0.0.1:5000") -> str | None:
        """Return the address of this run's experiment in the MLflow UI: its training runs (not the GenAI pages the
        UI opens by default), with the runs view given to the tracker, if any. None before the experiment exists.

        Args:
            base: Where the UI is served (``mlflow ui`` serves ``http://127.0.0.1:5000``).
        """
        experiment_id = self.experiment_id
        if experiment_id is None:
            return None
        view = f"&viewStateShareKey={RUNS_VIEW_KEY}" if self._runs_view is not None else ""
        return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning{view}"

    def log_model(self, model: torch.nn.Module, *, name: str = "model", input_example: Any = None) -> float:
        """Store a PyTorch model as an MLflow logged model of this run; return the seconds taken.

        With an ``input_example`` (a small batch of inputs, a NumPy array) the model is saved in MLflow's ``pt2``
        format (``torch.export``: loading it runs no pickle, and its signature comes from the example); a model
        ``torch.export`` cannot trace, or no example, falls back to the ``pickle`` format (loading it unpickles the
        model class, which must be importable; MLflow warns about that).

        ``mlflow.pytorch.log_model`` accepts a ``run_id`` but always writes through the global
        tracking URI, so it is not used: the model is saved locally with
        ``mlflow.pytorch.save_model`` (explicit pip requirements, nothing inferred) and sent with
        this tracker's client as a logged model linked to the run (its output at step 0).
        While the store is failing, the saved model folder is spooled as the run artifact ``model/``
        instead (replayed as a plain artifact folder, not as a logged model).

        Args:
            model: The model.
            name: The logged model's name.
            input_example: A batch of inputs the model takes (e.g. two test samples).

        Returns:
            Wall-clock seconds spent.

        Raises:
            RuntimeError: :meth:`start` was not called.
        """
        began = time.perf_counter()
        self._check_started()

        send = self._model_sender(model, name, input_example)

        def spool(writer: SpoolWriter) -> None:
            with tempfile.TemporaryDirectory(prefix="tracking-model-") as tmp:
                local = os.path.join(tmp, name)
                _model.save_model(model, local, input_example=input_example, log=self._log)
                writer.artifact_path(local, None)

        self._failover.deliver(send, spool)
        return time.perf_counter() - began

    def _model_sender(
        self, model: torch.nn.Module, name: str, input_example: Any
    ) -> Callable[[str, mlflow.MlflowClient], None]:
        """Return what logs ``model`` to a run of the store as an MLflow logged model (see :meth:`log_model`)."""

        def send(run_id: str, client: mlflow.MlflowClient) -> None:
            _model.log_to_run(
                client,
                run_id,
                str(self.experiment_id),
                name,
                lambda local, description: _model.save_model(
                    model, local, description=description, input_example=input_example, log=self._log
                ),
            )

        return send

    def log_model_from(
        self,
        builder: str,
        kwargs: Mapping[str, Any],
        *,
        name: str = "model",
        input_example: Any = None,
    ) -> float:
        """Store the model ``builder(**kwargs)`` returns as an MLflow logged model; return the seconds waited.

        With a writer process, the process builds, exports and sends the model (``torch.export`` and MLflow's
        pytorch flavour are imported and the model traced there, on another core, ideally preloaded: see
        ``preload``); otherwise, or if that fails, this process sends it as :meth:`log_model` does, except while
        the store fails: then a one-shot process saves it for the spool (see
        :func:`flasync.tracking._model.save_built`).

        Args:
            builder: ``package.module:name`` of a callable returning the ``nn.Module``, final weights loaded
                (importable by a fresh interpreter: no ``__main__`` names).
            kwargs: Its keyword arguments, JSON values (e.g. a path to the weights).
            name: The logged model's name.
            input_example: A batch of inputs (a NumPy array) for the ``pt2`` format's tracing and signature.

        Returns:
            Wall-clock seconds spent.
        """
        began = time.perf_counter()
        self._check_started()
        arguments = _model_arguments(builder, kwargs, name, input_example)
        if not self._child_job(self._model_request(arguments)):
            self._model_here(arguments, input_example)
        return time.perf_counter() - began

    def start_model_from(
        self,
        builder: str,
        kwargs: Mapping[str, Any],
        *,
        name: str = "model",
        input_example: Any = None,
    ) -> Callable[[], float]:
        """Begin what :meth:`log_model_from` does and return at once; the function returned waits for it to end
        and returns the seconds since this call (raising what :meth:`log_model_from` would).

        The writer process does the model's job on a thread of its own, so what this process sends meanwhile (files,
        tags, metrics) is answered beside the export. Without a writer process the
        model is logged before this returns. Call the function before :meth:`finish` (which otherwise waits for the
        job without reporting it) and keep ``kwargs``' files until it returns.

        Args:
            builder: As for :meth:`log_model_from`.
            kwargs: As for :meth:`log_model_from`.
            name: As for :meth:`log_model_from`.
            input_example: As for :meth:`log_model_from`.
        """
        self._check_started()
        arguments = _model_arguments(builder, kwargs, name, input_example)
        return self._start_deferred(
            "model", self._model_request(arguments), lambda: self._model_here(arguments, input_example)
        )

    def prepare_model_from(self, builder: str, kwargs: Mapping[str, Any], *, input_example: Any) -> None:
        """Have the writer process export the model ``builder(**kwargs)`` returns now, in the background, for a
        later :meth:`log_model_from` or :meth:`start_model_from` of a model from ``builder`` with ``input_example``;
        return at once.

        The model's weights do not matter (e.g. the initial ones): that later save swaps the final weights into
        this export, which skips ``torch.export``'s trace at the run's end, if the model has the same structure (the
        same module classes, parameters and buffers, and then the same outputs on ``input_example``; see
        :class:`flasync.tracking._model.Exports`). Otherwise, or if this export fails, or without a writer process, that
        save exports the model itself, as it would have.

        Args:
            builder: ``package.module:name`` of a callable returning the ``nn.Module`` (see :meth:`log_model_from`).
            kwargs: Its keyword arguments, JSON values.
            input_example: The batch of inputs (a NumPy array) the later save will be given (None: nothing is
                exported, as that save pickles the model).
        """
        self._check_started()
        if input_example is None:
            return  # such a model is pickled: there is no export to make ahead
        arguments = _model_arguments(builder, kwargs, "model", input_example)
        del arguments["name"]
        # Deferred and detached: the writer process answers at once and exports on a thread of its own; the model's
        # job waits for it (in the helper), the end of a run stopped before its model does not.
        job = f"prepare-{next(self._deferred)}"
        self._child_job({"op": "prepare", "model": arguments, "defer": job, "detached": True})

    def _start_deferred(self, kind: str, request: Mapping[str, Any], here: Callable[[], None]) -> Callable[[], float]:
        """Have the writer process begin ``request`` as a deferred job and return what waits for it (see
        :meth:`start_model_from`); ``here`` does the job in this process instead, at once when there is no writer
        process, or when the settled job failed. The function returned gives the seconds since this call."""
        began = time.perf_counter()
        job = f"{kind}-{next(self._deferred)}"
        if not self._child_job({**request, "defer": job}):
            here()
            seconds = time.perf_counter() - began
            return lambda: seconds

        def settle() -> float:
            if not self._child_job({"op": "settle", "id": job}):
                here()
            return time.perf_counter() - began

        return settle

    def _model_request(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """Return the writer process's job logging the model :func:`_model_arguments` describes."""
        return {"op": "model", "model": {"experiment_id": str(self.experiment_id), **arguments}}

    def _model_here(self, arguments: Mapping[str, Any], input_example: Any) -> None:
        """Log the model :func:`_model_arguments` describes from this process (see :meth:`log_model_from`)."""
        name = str(arguments["name"])
        model = _model.build(arguments["builder"], arguments["kwargs"])  # a builder that fails is the caller's error

        send = self._model_sender(model, name, input_example)

        def spool(writer: SpoolWriter) -> None:
            # The store fails: a one-shot process saves the model, so this one never imports torch.export and
            # MLflow's pytorch flavour (their objects would set off full garbage collections here).
            with tempfile.TemporaryDirectory(prefix="tracking-model-") as tmp:
                try:
                    _files.write_elsewhere("flasync.tracking._model:save_built", tmp, arguments)
                except RuntimeError as exc:
                    self._log.info("tracking.model_saved_here", reason=str(exc)[:300], metrics=False)
                    shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
                    _model.save_model(model, os.path.join(tmp, name), input_example=input_example)
                writer.artifact_path(os.path.join(tmp, name), None)

        self._failover.deliver(send, spool)

    def _child_job(self, request: Mapping[str, Any]) -> bool:
        """Have the writer process do ``request``; False when there is none, the store is failing, or it failed
        (then the caller does the work itself, through the spool if need be)."""
        with self._failover.lock:
            if self._failover.offline:
                return False
            child = self._ready_child()
            if child is None:
                return False
            try:
                child.job(request, _CHILD_START_TIMEOUT_S, run=self._child_run)
            except ConnectionError as exc:
                self._log.warning("tracking.writer_process_lost", error=redact_uri(str(exc)), metrics=False)
                self._child = None
                return False
            except RuntimeError as exc:
                self._log.info(
                    "tracking.writer_process_job_failed",
                    op=request.get("op"),
                    error=redact_uri(str(exc))[:300],
                    metrics=False,
                )
                return False
            return True

    def _stop_monitor(self, monitor: Any) -> None:
        """Stop the system monitor, waiting a bounded time: its loop asks the store for the run's status."""
        if not stop_monitor(monitor):
            self._log.warning("tracking.system_monitor_stuck", timeout_s=_MONITOR_STOP_TIMEOUT_S, metrics=False)

    def _check_started(self) -> None:
        self._await_open()
        if self._started_at is None:
            raise RuntimeError("call start() before logging to the tracker")

    def _log_metric_batch(self, metrics: list[MetricRow]) -> None:
        """Write one batch (called by the metric writer's thread) once the run is open: direct, or to the spool;
        never raises."""
        self._opened.wait()
        if self._no_run:
            return
        self._failover.send_metrics(metrics, self._send_metrics)

    def _writer_process_failed(self, error: BaseException) -> None:
        """Warn that the writer process could not start or connect, and write from this process from now on."""
        self._log.warning("tracking.writer_process_failed", error=redact_uri(str(error)), metrics=False)
        self._stop_child()

    def _ready_child(self) -> ChildLogBatch | None:
        """Return the writer process once it is connected (waiting a bounded time); None when there is none."""
        child = self._child
        if child is None or child.ready:
            return child
        try:
            child.wait_ready(_CHILD_START_TIMEOUT_S)
        except (ConnectionError, RuntimeError) as exc:
            self._writer_process_failed(exc)
            return None
        return child

    def _send_metrics(self, metrics: list[MetricRow]) -> None:
        child = self._ready_child()
        if child is not None:
            try:
                child(metrics, run=self._child_run)
                return
            except ConnectionError as exc:
                # The child died: write from this process from now on rather than lose metrics.
                self._log.warning("tracking.writer_process_lost", error=redact_uri(str(exc)), metrics=False)
                self._child = None
        run_id, client = self._run.run_id, self._run.connect(self._log)
        from mlflow.entities import Metric

        assert run_id is not None
        entities = [Metric(m.key, m.value, m.timestamp, m.step) for m in metrics]
        with self._http():
            client.log_batch(run_id, metrics=entities, synchronous=True)

    def _experiment_id(self, client: mlflow.MlflowClient, name: str) -> str:
        experiment_id = ensure_experiment(client, name, self._artifact_location(name))
        if self._runs_view is not None:
            client.set_experiment_tag(experiment_id, RUNS_VIEW_TAG, self._runs_view)
        return experiment_id

    def _artifact_location(self, experiment: str) -> str | None:
        return artifact_location(self.tracking_uri, experiment, self._artifact_root)


# libyaml's emitter where PyYAML was built with it: the same text as the pure-Python SafeDumper, a fifth of its CPU
# (a run's config: 0.7 ms instead of 3.4 ms, on a thread beside training).
_YAML_DUMPER: type = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def yaml_text(data: Any, *, indent: int | None = None) -> str:
    """Return ``data`` (plain YAML types) as ``yaml.safe_dump`` writes it, keys in their order."""
    return yaml.dump(data, Dumper=_YAML_DUMPER, indent=indent, sort_keys=False)


def artifact_bytes(data: Mapping[str, Any], artifact_file: str) -> bytes:
    """Return ``data`` as the content :meth:`MlflowTracker.log_dict` stores: YAML for ``.yaml``/``.yml``, indented
    JSON otherwise (values JSON cannot encode written as their ``str``; NaN and infinities as JavaScript's)."""
    if artifact_file.endswith((".yaml", ".yml")):
        text = yaml_text(json.loads(json.dumps(dict(data), default=str)), indent=2)
    else:
        text = json.dumps(data, indent=2, default=str, allow_nan=True)
    return text.encode()


def _artifact_name(artifact_file: str) -> tuple[str, str]:
    """Return the folder (``""``: the root) and the file name of an artifact's path inside its run.

    Raises:
        ValueError: The path names no file.
    """
    folder, name = os.path.split(artifact_file.strip("/"))
    if not name:
        raise ValueError(f"artifact_file {artifact_file!r} names no file")
    return folder, name


def _model_arguments(builder: str, kwargs: Mapping[str, Any], name: str, input_example: Any) -> dict[str, Any]:
    """Return the JSON arguments of a model's job (see :func:`flasync.tracking._model.log_built_model`)."""
    return {
        "builder": builder,
        "kwargs": dict(kwargs),
        "name": name,
        "input_example": None if input_example is None else input_example.tolist(),
        "input_dtype": "float32" if input_example is None else str(input_example.dtype),
    }


def _basic_context_tags() -> dict[str, str]:
    """MLflow's user and source tags, found without importing MLflow (for a run spooled before MLflow was loaded:
    MLflow's own context tags, when it was, replace these)."""
    import getpass

    try:
        user = getpass.getuser()
    except Exception:  # no user name in this environment
        user = "unknown"
    source = sys.argv[0] if sys.argv and sys.argv[0] else "<console>"
    return {"mlflow.user": user, "mlflow.source.name": source, "mlflow.source.type": "LOCAL"}


def _param_value(value: Any) -> str:
    return str(value)[:_MAX_PARAM_VALUE]


def _compact(steps: Sequence[int]) -> Container[int]:
    """Return ascending distinct ``steps`` as a container: a ``range`` where they are evenly spaced (a series
    stepped by version or round), a frozenset otherwise."""
    if len(steps) > 1:
        stride = steps[1] - steps[0]
        if all(b - a == stride for a, b in itertools.pairwise(steps)):
            return range(steps[0], steps[-1] + 1, stride)
    elif len(steps) == 1:
        return range(steps[0], steps[0] + 1)
    return frozenset(steps)


if TYPE_CHECKING:
    # Both classes must satisfy the protocol; mypy checks this assignment.
    _TRACKERS: tuple[Tracker, Tracker] = (NullTracker(), MlflowTracker())
