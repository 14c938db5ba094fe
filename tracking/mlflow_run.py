"""One MLflow run per federation, written through an explicit ``MlflowClient``.

Nothing here touches MLflow's global state (tracking URI, active run, experiment): every call goes
through ``MlflowClient(tracking_uri)`` with an explicit run id, so several trackers, on different
stores, can live in one process. All methods block on I/O except :meth:`Tracker.log_metrics`;
async callers run them in a thread. MLflow itself (over a second to import) is imported when a tracker
first needs it, so a run without tracking never loads it.

:class:`MlflowTracker` is made of parts with one job each: the run's lifecycle
(:class:`~flasync.tracking._lifecycle.RunLifecycle`), its artifacts and models
(:class:`~flasync.tracking._artifacts.RunArtifacts`), its metric writers and writer process
(:class:`~flasync.tracking._writers.RunWriters`) and the failover to a spool
(:class:`~flasync.tracking.failover.Failover`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

from flasync.tracking import journal
from flasync.tracking._artifacts import RunArtifacts, artifact_bytes, yaml_text
from flasync.tracking._child import IDLE, IdleChild
from flasync.tracking._early import EarlyRecords
from flasync.tracking._lifecycle import Experiments, RunLifecycle, RunStatus
from flasync.tracking._runs import SYSTEM_METRICS_INTERVAL_S
from flasync.tracking._writers import RunWriters
from flasync.tracking.failover import Failover, RunIdentity
from flasync.tracking.logs import LibraryLogger
from flasync.tracking.metrics import MetricRow
from flasync.tracking.store import bounded_http, resolve_tracking_uri, ui_command
from flasync.tracking.writer import MetricWriter

if TYPE_CHECKING:
    import torch

__all__ = [
    "MlflowTracker",
    "NullTracker",
    "RunStatus",
    "Tracker",
    "artifact_bytes",
    "yaml_text",
]


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

    Tracking never takes the run down: while the store cannot be reached or errors, every record goes to a
    JSON-lines spool, replayed once the store answers (see :class:`flasync.tracking.failover.Failover`).

    On a local store (SQLite or files) a new experiment gets the artifact location
    ``file://<artifact_root>/<experiment name>``; by default ``artifact_root`` is the ``artifacts``
    folder next to the SQLite file, i.e. ``mlruns/artifacts`` for the default store.

    Args:
        tracking_uri: The store; ``MLFLOW_TRACKING_URI`` if set, else :data:`DEFAULT_TRACKING_URI`, when None. A
            relative SQLite path is made absolute against the current directory now.
        artifact_root: Folder or URI under which new experiments keep their artifacts.
        system_metrics: Also run MLflow's ``SystemMetricsMonitor`` (CPU, memory, disk, network, GPU) for the run.
        system_metrics_interval_s: Seconds between two samples of the system monitor (at least
            :data:`~tracking._runs.SYSTEM_METRICS_MIN_INTERVAL_S`, 0.1).
        max_batch: Most metrics per ``log_batch`` call (MLflow accepts 1000).
        flush_interval_s: Longest time a metric waits before it is written, in seconds.
        flush_timeout_s: Longest wait of :meth:`flush` and of :meth:`finish` for a failing backend, in seconds.
        writer_process: Send metric batches from a spawned child process (see :mod:`flasync.tracking._child`), so
            MLflow's SQL work does not compete with training for this process's GIL.
        logger: Where warnings go; a :class:`~flasync.tracking.logs.LibraryLogger` named ``tracking.mlflow`` when
            None (no debug lines unless structlog is configured).
        spool_path: The spool file used if the store fails; a new file under ``spool_root`` when None.
        spool_root: Folder of journals and spools, made absolute now; ``journal.SPOOL_ROOT`` (mlruns/spool) if None.
        retry_interval_s: Least time between two tries to reach a failed store, in seconds.
        http_timeout_s: Connect/read timeout of one request to an HTTP(S) server, in seconds.
        http_retries: Retries of one request to an HTTP(S) server.
        runs_view: A view of the experiment's runs table, e.g. ``{"selectedColumns": ["metrics.`accuracy`"]}`` (the
            state MLflow's UI shares): saved on the experiment as the tag ``mlflow.sharedViewState.<name>``, where
            ``name`` is :data:`~flasync.tracking._runs.RUNS_VIEW_KEY`; :meth:`ui_url` opens it.
        preload: What the writer process imports (``package.module``) or calls (``package.module:function``) ahead,
            while the caller trains, for the model :meth:`log_model_from` will hand it, e.g.
            ``("flasync.tracking._model:warm_up",)``: on Linux, a helper process of the writer process's does that and
            the model's export on a core of its own (see :mod:`flasync.tracking._child`).
        idle_writers: Where an idle writer process is taken from and left for the next tracker: the process's holder
            :data:`flasync.tracking._child.IDLE` by default; a tracker given its own :class:`IdleChild` (a test, or an
            application that wants no process-wide sharing) shares only with trackers given the same one.
        nest_under: Returns the MLflow run the new run is nested under (tag ``mlflow.parentRunId``), asked on the
            thread that opens it, before it takes a writer process: a sweep's parent run may still be opening as its
            first child starts, and hands its writer process on once open (:meth:`release_writer`).
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
        spool_root: str | Path | None = None,
        retry_interval_s: float = 5.0,
        http_timeout_s: int = 10,
        http_retries: int = 1,
        runs_view: Mapping[str, Any] | None = None,
        preload: Sequence[str] = (),
        idle_writers: IdleChild = IDLE,
        nest_under: Callable[[], str] | None = None,
    ) -> None:
        self.tracking_uri = resolve_tracking_uri(tracking_uri)
        self._log = logger if logger is not None else LibraryLogger("tracking.mlflow")
        self._run = RunIdentity(self.tracking_uri, probe_timeout_s=http_timeout_s)
        http = functools.partial(bounded_http, self.tracking_uri, timeout_s=http_timeout_s, retries=http_retries)
        view = None if runs_view is None else json.dumps(dict(runs_view))
        experiments = Experiments(self.tracking_uri, artifact_root, view)
        self._failover = Failover(
            self._run,
            log=self._log,
            http=http,
            experiment_id=experiments.experiment_id,
            retry_interval_s=retry_interval_s,
            spool_path=Path(spool_path).absolute() if spool_path is not None else None,
            spool_root=Path(spool_root or journal.SPOOL_ROOT).expanduser().absolute(),
        )
        self._writers = RunWriters(
            self._run,
            self._failover,
            log=self._log,
            http=http,
            idle_writers=idle_writers,
            preload=preload,
            writer_process=writer_process,
            system_metrics=system_metrics,
            system_metrics_interval_s=system_metrics_interval_s,
            max_batch=max_batch,
            flush_interval_s=flush_interval_s,
            flush_timeout_s=flush_timeout_s,
            http_timeout_s=http_timeout_s,
            http_retries=http_retries,
        )
        self._lifecycle = RunLifecycle(
            self._run, self._writers, self._failover, experiments, log=self._log, http=http, nest_under=nest_under
        )
        self._artifacts = RunArtifacts(
            self._run, self._writers, self._failover, check_started=self._lifecycle.check_started, log=self._log
        )
        self._experiments = experiments
        self.journal = EarlyRecords(self._failover, self._writers, self._lifecycle, self.log_artifacts, self._log)
        """The run's journal while its MLflow run is being opened (see :class:`EarlyRecords`)."""

    @property
    def run_id(self) -> str | None:
        """The MLflow run (None before :meth:`start`, or while the store never answered)."""
        return self._run.run_id

    @property
    def experiment_id(self) -> str | None:
        """The experiment's id once known."""
        return self._run.experiment_id

    @property
    def spool_path(self) -> Path | None:
        """The spool file, if the store failed at some point of this run; else None."""
        spool = self._failover.spool
        return spool.path if spool is not None else None

    @property
    def metric_rows_lost(self) -> int:
        """Metric rows neither written nor kept in the journal (:meth:`~tracking._lifecycle.RunLifecycle.lost`)."""
        return self._lifecycle.lost()

    @property
    def metric_rows_spilled(self) -> int:
        """Metric rows the writer's backlog could not hold, kept in the journal and sent to the run at its end."""
        return self._failover.spilled

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
        return self._writers.writer

    def prepare(self) -> None:
        """Start the metric writer process now, if this tracker uses one; idempotent (see
        :meth:`flasync.tracking._writers.RunWriters.prepare`)."""
        self._lifecycle.prepare()

    @property
    def writer_reused(self) -> bool:
        """Whether :meth:`prepare` took over a writer process an earlier run of this process left idle (MLflow
        imported, the store open, what it preloaded done) rather than starting one."""
        return self._writers.reused

    def start(
        self,
        *,
        experiment: str,
        run_name: str | None = None,
        params: Mapping[str, Any] = _NOTHING,
        tags: Mapping[str, str] = _NOTHING,
        wait: bool = True,
    ) -> str:
        """Create the run (and the experiment if needed), then record params and tags (how, and what ``wait=False``
        does: :meth:`flasync.tracking._lifecycle.RunLifecycle.start`).

        Args:
            experiment: The experiment's name; created when missing.
            run_name: The run's display name; MLflow picks one when None.
            params: The run's parameters, e.g. the flattened configuration.
            tags: The run's tags.
            wait: Return only once the run exists (True), or at once.

        Returns:
            The run id (``""`` with ``wait=False``, or when the store never answered).

        Raises:
            RuntimeError: The tracker was already started, or the experiment is deleted.
            mlflow.exceptions.MlflowException: The store refused a call.
        """
        return self._lifecycle.start(experiment, run_name, params, tags, wait)

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
        return self._lifecycle.opened(timeout)

    def resume(self, run_id: str, *, recomputed: Collection[str] = ()) -> str:
        """Reopen an existing run: set its status back to ``RUNNING`` and log to it from now on; each step once
        (see :meth:`flasync.tracking._lifecycle.RunLifecycle.resume`).

        Args:
            run_id: The run to continue (e.g. one ended ``KILLED`` by an interrupt).
            recomputed: Metric keys this life computes again from the whole (a sweep's table, whose interrupted
                life logged it from the points it had): written at every step, the new value the latest of its step.

        Returns:
            ``run_id``.

        Raises:
            RuntimeError: The tracker was already started.
            mlflow.exceptions.MlflowException: The run does not exist, or the store refused a call.
        """
        return self._lifecycle.resume(run_id, recomputed)

    @property
    def system_metrics_interval_s(self) -> float:
        """Seconds between two samples of the system monitor (when ``system_metrics`` is on)."""
        return self._writers.system_metrics_interval

    def log_metrics(self, metrics: list[MetricRow]) -> None:
        """Queue ``metrics`` (the list is handed over) for the run; never blocks (dropped before start and after
        finish; in a resumed run, those at a step the store already holds for their key, see :meth:`resume`)."""
        self._writers.log_metrics(metrics)

    def link_models(self, models: Mapping[str, int]) -> int:
        """Link each named logged model to the run's evaluation at its step (:meth:`RunArtifacts.link_models`)."""
        return self._artifacts.link_models(models)

    def log_dict(self, data: Mapping[str, Any], artifact_file: str) -> None:
        """Store ``data``, a JSON-like mapping, as the artifact ``artifact_file`` (its path inside the run, e.g.
        ``"config/run.json"``): YAML for ``.yaml``/``.yml``, JSON otherwise, where values JSON cannot encode (paths,
        NumPy scalars, ...) are written as their ``str``."""
        self.log_bytes(artifact_bytes(data, artifact_file), artifact_file)

    def log_file(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Store the local file or folder ``path`` as an artifact, in the folder ``artifact_path`` inside the run's
        artifacts (the root when None)."""
        self._artifacts.log_file(path, artifact_path)

    def log_bytes(self, data: bytes, artifact_file: str) -> None:
        """Store ``data`` (the file's content) as an artifact at ``artifact_file``, its path inside the run (e.g.
        ``"clients/table.csv"``)."""
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
        self._artifacts.log_artifacts(files)

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
        self._artifacts.log_dataset(name, digest, source, profile, context)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set tags on the run: ``tags``' names and values (stringified and cut to 8000 characters)."""
        self._lifecycle.set_tags(tags)

    def release_writer(self) -> bool:
        """Hand the writer process to this process's other runs while this run stays open (a sweep's parent run while
        its children run), queued metrics written first; the run's next record takes one again. False when there
        was none to hand (see :meth:`flasync.tracking._writers.RunWriters.release`)."""
        self._lifecycle.await_open()
        run_id = self._run.run_id
        return run_id is not None and self._writers.release(run_id)

    def send_soon(self) -> None:
        """Start writing the queued metrics now, without waiting for them (see :meth:`flush`, which waits)."""
        self._writers.send_soon()

    def flush(self) -> bool:
        """Block until queued metrics were written (or spooled), or ``flush_timeout_s`` passed (then warn).

        Returns:
            True when every metric queued before the call was written or spooled.
        """
        return self._writers.flush()

    def finish(self, status: RunStatus) -> None:
        """Write queued metrics, stop the system monitor and close the run; idempotent (what the store does not
        take: :meth:`flasync.tracking._lifecycle.RunLifecycle.finish`).

        Args:
            status: ``"FINISHED"``, ``"FAILED"`` or ``"KILLED"``.

        Raises:
            ValueError: ``status`` is not one of those.
        """
        self.journal.send_kept()
        self._lifecycle.finish(status)

    def ui_command(self) -> str | None:
        """Return the shell command that opens this store in the MLflow UI (:func:`~tracking.store.ui_command`)."""
        return ui_command(self.tracking_uri)

    def ui_url(self, base: str = "http://127.0.0.1:5000") -> str | None:
        """Return the address of this run's experiment in the MLflow UI: its training runs (not the GenAI pages the
        UI opens by default), with the runs view given to the tracker, if any. None before the experiment exists.

        Args:
            base: Where the UI is served (``mlflow ui`` serves ``http://127.0.0.1:5000``).
        """
        return self._experiments.ui_url(self.experiment_id, base)

    def log_model(
        self,
        model: torch.nn.Module,
        *,
        name: str = "model",
        input_example: Any = None,
        tags: Mapping[str, str] | None = None,
    ) -> float:
        """Store a PyTorch model as an MLflow logged model of this run; return the seconds taken (its formats, and
        the spool: :meth:`flasync.tracking._artifacts.RunArtifacts.log_model`).

        Args:
            model: The model.
            name: The logged model's name.
            input_example: A batch of inputs the model takes (e.g. two test samples).
            tags: The logged model's tags.

        Returns:
            Wall-clock seconds spent.

        Raises:
            RuntimeError: :meth:`start` was not called.
        """
        return self._artifacts.log_model(model, name, input_example, tags)

    def log_model_from(
        self,
        builder: str,
        kwargs: Mapping[str, Any],
        *,
        name: str = "model",
        input_example: Any = None,
    ) -> float:
        """Store the model ``builder(**kwargs)`` returns as an MLflow logged model; return the seconds waited
        (which process does it: :meth:`flasync.tracking._artifacts.RunArtifacts.log_model_from`).

        Args:
            builder: ``package.module:name`` of a callable returning the ``nn.Module``, final weights loaded
                (importable by a fresh interpreter: no ``__main__`` names).
            kwargs: Its keyword arguments, JSON values (e.g. a path to the weights).
            name: The logged model's name.
            input_example: A batch of inputs (a NumPy array) for the ``pt2`` format's tracing and signature.

        Returns:
            Wall-clock seconds spent.
        """
        return self._artifacts.log_model_from(builder, kwargs, name, input_example)

    def start_model_from(
        self,
        builder: str,
        kwargs: Mapping[str, Any],
        *,
        name: str = "model",
        input_example: Any = None,
        tags: Mapping[str, str] | None = None,
    ) -> Callable[[], float]:
        """Begin what :meth:`log_model_from` does and return at once; the function returned waits for it to end
        and returns the seconds since this call (raising what :meth:`log_model_from` would). Its arguments are those
        of :meth:`log_model_from`, and ``tags`` the logged model's. Call the function before :meth:`finish` (which
        otherwise waits for the job without reporting it) and keep ``kwargs``' files until it returns (see
        :meth:`flasync.tracking._artifacts.RunArtifacts.start_model_from`).
        """
        return self._artifacts.start_model_from(builder, kwargs, name, input_example, tags)

    def prepare_model_from(self, builder: str, kwargs: Mapping[str, Any], *, input_example: Any) -> None:
        """Have the writer process export the model ``builder(**kwargs)`` returns now, in the background, for a later
        :meth:`log_model_from` or :meth:`start_model_from` with the same arguments; return at once (its arguments and
        when the export is used: :meth:`flasync.tracking._artifacts.RunArtifacts.prepare_model_from`)."""
        self._artifacts.prepare_model_from(builder, kwargs, input_example)


if TYPE_CHECKING:
    # Both classes must satisfy the protocol; mypy checks this assignment.
    _TRACKERS: tuple[Tracker, Tracker] = (NullTracker(), MlflowTracker())
