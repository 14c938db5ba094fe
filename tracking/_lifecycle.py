"""A tracked run's lifecycle: open it (or resume it) with its params and tags, set tags, end it with a status."""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import time
from collections.abc import Callable, Collection, Container, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, get_args

from flasync.core.owner import owner_tags
from flasync.tracking._child import STORE_REPLACED
from flasync.tracking._keys import safe_key
from flasync.tracking._runs import (
    _MAX_PARAMS_PER_CALL,
    _MAX_TAG_VALUE,
    RUNS_VIEW_KEY,
    RUNS_VIEW_TAG,
    _chunks,
    _context_tags,
    send_tags,
)
from flasync.tracking._writers import CHILD_START_TIMEOUT_S, RunWriters
from flasync.tracking.failover import Failover, RunIdentity
from flasync.tracking.journal import JOURNAL_TAG
from flasync.tracking.sqlite_metrics import SqliteMetrics
from flasync.tracking.store import (
    ExperimentDeletedError,
    artifact_location,
    ensure_experiment,
    experiment_url,
    redact_uri,
    sqlite_path,
)

if TYPE_CHECKING:
    import mlflow

__all__ = ["LOST_TAG", "PARENT_RUN_TAG", "Experiments", "RunLifecycle", "RunStatus"]

RunStatus = Literal["FINISHED", "FAILED", "KILLED"]

PARENT_RUN_TAG = "mlflow.parentRunId"
"""The tag by which MLflow nests a run under another (the UI shows them as one expandable row)."""

_MAX_PARAM_VALUE = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
LOST_TAG = "flasync.metric_rows_lost"
"""The tag a run gets when some of its metric rows were neither written nor kept in its journal: their count."""


class Experiments:
    """Find or create a run's experiment by name, with its artifact location and runs view.

    Args:
        tracking_uri: The store.
        artifact_root: Folder or URI under which new experiments keep their artifacts.
        runs_view: The runs-table view's JSON saved on the experiment (None: none).
    """

    def __init__(self, tracking_uri: str, artifact_root: str | None, runs_view: str | None) -> None:
        """Hold the settings."""
        self._tracking_uri = tracking_uri
        self._artifact_root = artifact_root
        self.runs_view = runs_view

    def experiment_id(self, client: mlflow.MlflowClient, name: str) -> str:
        """Return the id of experiment ``name``, created when missing, its runs view set."""
        experiment_id = ensure_experiment(client, name, self.artifact_location(name))
        if self.runs_view is not None:
            client.set_experiment_tag(experiment_id, RUNS_VIEW_TAG, self.runs_view)
        return experiment_id

    def ui_url(self, experiment_id: str | None, base: str) -> str | None:
        """Return the address of experiment ``experiment_id``'s training runs in the MLflow UI served at ``base``,
        with the runs view, if any; None when there is no experiment yet."""
        if experiment_id is None:
            return None
        return experiment_url(base, experiment_id, RUNS_VIEW_KEY if self.runs_view is not None else None)

    def artifact_location(self, experiment: str) -> str | None:
        """Return the artifact location a new experiment ``experiment`` gets (None: MLflow's default)."""
        return artifact_location(self._tracking_uri, experiment, self._artifact_root)


class RunLifecycle:
    """Open a run (at once, or on a background thread), resume one, set its tags and end it.

    Args:
        run: The run's identity, filled in here.
        writers: The metric side (and the writer process, which may create the run).
        failover: Routes records to the store or the spool.
        experiments: Finds or creates the experiment.
        log: Where warnings go.
        http: Bounds one block of calls to a server.
        nest_under: Returns the run a new run is nested under (:data:`PARENT_RUN_TAG`); called on the thread that
            opens the run, so it may wait for that run to be opened (None: not nested).
    """

    def __init__(
        self,
        run: RunIdentity,
        writers: RunWriters,
        failover: Failover,
        experiments: Experiments,
        *,
        log: Any,
        http: Callable[[], contextlib.AbstractContextManager[None]],
        nest_under: Callable[[], str] | None = None,
    ) -> None:
        """Start with no run."""
        self._nest_under = nest_under
        self._run = run
        self._writers = writers
        self._failover = failover
        self._experiments = experiments
        self._log = log
        self._http = http
        self._finished = False
        self.rows_lost: int | None = None
        """Metric rows neither written nor kept in the journal, counted when the run ended (None before)."""
        self._opening: threading.Thread | None = None
        """The thread opening the run of a ``start(wait=False)``."""
        self._open_error: BaseException | None = None

    def prepare(self) -> None:
        """Start the writer process now, or take an idle one (see :meth:`RunWriters.prepare`); a nested run takes it
        as it opens, once the run it nests under is open: that run's opening may hand one back to take."""
        if self._nest_under is None:
            self._writers.prepare(self.started)

    @property
    def started(self) -> bool:
        """Whether the run started (its start time is set)."""
        return self._run.started_at is not None

    def start(
        self,
        experiment: str,
        run_name: str | None,
        params: Mapping[str, Any],
        tags: Mapping[str, str],
        wait: bool,
    ) -> str:
        """Create the run (and the experiment if needed), then record params and tags.

        Params are sent with ``log_batch`` in calls of at most 100, values stringified and cut to
        6000 characters; keys and tag keys that MLflow would refuse have their odd characters
        replaced by ``_``. If recording the params fails, the run is marked ``FAILED``.

        With ``wait=False`` the run is opened on a background thread and this returns ``""`` at once, so the caller
        can train while the writer process imports MLflow and creates the run (seconds on a busy machine): the
        run's start time is this call's; metrics logged meanwhile queue and are sent once the run exists; every
        other record (artifacts, tags, a model, ``flush``, ``finish``) waits for it; :meth:`opened` waits
        and returns the id, or raises what opening the run raised.
        """
        if self.started:
            raise RuntimeError(f"this tracker already started run {self._run.run_id or '(spooled)'}")
        self.prepare()  # the writer process imports MLflow while the caller prepares its data
        run = self._run
        run.started_at = int(time.time() * 1000)
        run.experiment, run.run_name = experiment, run_name
        given_tags = {safe_key(k): str(v)[:_MAX_TAG_VALUE] for k, v in {**tags, **owner_tags()}.items()}
        clean_params = {safe_key(k): _param_value(v) for k, v in params.items()}
        self._open_error = None
        if not wait:
            # Durable from now on: what is logged before the run opens goes to the journal too.
            journal = self._failover.open_journal(given_tags, clean_params)
            given_tags = {**given_tags, JOURNAL_TAG: journal.id}
        # From now on metrics queue; the writer's thread sends them once the run is open.
        self._writers.begin_open()
        if wait:
            self._open(experiment, run_name, given_tags, clean_params)
            return self._run.run_id or ""
        self._opening = threading.Thread(
            target=self._open_in_background,
            args=(experiment, run_name, given_tags, clean_params),
            name="tracking-open-run",
            daemon=True,
        )
        self._opening.start()
        return ""

    def opened(self, timeout: float | None) -> str:
        """Wait until the run a ``start(wait=False)`` began is open; return its id (see
        :meth:`flasync.tracking.MlflowTracker.opened`)."""
        opening = self._opening
        if opening is not None:
            opening.join(timeout)
            if opening.is_alive():
                raise TimeoutError(f"the MLflow run was not open after {timeout} s")
        if self._open_error is not None:
            raise self._open_error
        return self._run.run_id or ""

    def _open_in_background(
        self, experiment: str, run_name: str | None, given_tags: Mapping[str, str], clean_params: Mapping[str, str]
    ) -> None:
        try:
            self._open(experiment, run_name, given_tags, clean_params)
        except BaseException as exc:  # handed to opened(); nothing may escape a thread
            self._open_error = exc

    def await_open(self) -> None:
        """Block until a run being opened in the background is open (or failed); not on the opening thread."""
        opening = self._opening
        if opening is not None and opening is not threading.current_thread():
            opening.join()

    def check_started(self) -> None:
        """Wait for a run being opened; raise RuntimeError when there is none."""
        self.await_open()
        if not self.started:
            raise RuntimeError("call start() before logging to the tracker")

    def _open(
        self, experiment: str, run_name: str | None, given_tags: Mapping[str, str], clean_params: Mapping[str, str]
    ) -> None:
        """Create the run and record its params and tags (directly or through the writer process, else spooled),
        then start the writers. The metric writer waits for this to end; when it raises, queued metrics are dropped
        (there is no run to hold them)."""
        try:
            if self._nest_under is not None:
                given_tags = {**given_tags, PARENT_RUN_TAG: self._nested_in()}
                self._writers.prepare(False)
            self._open_run(experiment, run_name, given_tags, clean_params)
        except BaseException:
            self._writers.end_open(failed=True)
            raise
        finally:
            self._writers.end_open(failed=False)
        if not self._failover.offline:
            self._failover.journal_opened()
            self._failover.room.hold()

    def _nested_in(self) -> str:
        """Return the run to nest the new one under; when that raises, the new run is not opened either (its journal
        is retired, the writer process stopped)."""
        assert self._nest_under is not None
        try:
            return self._nest_under()
        except BaseException:
            self._run.started_at = None
            self._writers.stop_child()
            self._failover.retire_journal()
            raise

    def _open_run(
        self, experiment: str, run_name: str | None, given_tags: Mapping[str, str], clean_params: Mapping[str, str]
    ) -> None:
        run, writers = self._run, self._writers
        db = sqlite_path(run.tracking_uri)
        if db is not None:
            db.parent.mkdir(parents=True, exist_ok=True)
        if self._start_in_child(experiment, run_name, given_tags, clean_params):
            assert run.run_id is not None
            writers.start_writers(run.run_id)
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
                    experiment_id = self._experiments.experiment_id(client, experiment)
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
                writers.stop_child()
                self._failover.retire_journal()  # the run has nowhere to go: the error says so
                raise
            except Exception as exc:
                self._failover.spool_opening(exc, clean_tags, clean_params)
            except BaseException:
                # Interrupted while recording the params: leave no RUNNING run behind.
                self._finished = True
                writers.stop_child()
                if run.run_id is not None and run.client is not None:
                    with contextlib.suppress(Exception), self._http():
                        run.client.set_terminated(run.run_id, "KILLED")
                raise
        if run.run_id is not None and not self._failover.offline:
            writers.start_writers(run.run_id)
        else:
            writers.stop_child()
            if writers.writer is None:
                writers.writer = writers.metric_writer()

    def _start_in_child(
        self, experiment: str, run_name: str | None, tags: Mapping[str, str], params: Mapping[str, str]
    ) -> bool:
        """Have the writer process create the run (see :func:`open_run`); False when there is no such process or
        it failed (then it is stopped, and :meth:`start` does the work itself: through the spool if need be)."""
        writers = self._writers
        child = writers.child
        if child is None:
            return False
        request = {
            "experiment": experiment,
            "artifact_location": self._experiments.artifact_location(experiment),
            "runs_view": self._experiments.runs_view,
            "run_name": run_name,
            "tags": dict(tags),
            "params": dict(params),
            "start_time": self._run.started_at,
            "source": sys.argv[0] if sys.argv and sys.argv[0] else None,
        }
        try:
            run_id, experiment_id = child.start(request, CHILD_START_TIMEOUT_S)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            self._log.info("tracking.writer_process_start_failed", error=redact_uri(str(exc))[:300], metrics=False)
            died = not child.alive
            writers.stop_child()
            if not writers.reused or not (died or STORE_REPLACED in str(exc)):
                return False
            # A kept process died idle, or its store's file was replaced since it opened it: a new one may succeed.
            writers.reused = False
            writers.child = writers.new_child()
            return self._start_in_child(experiment, run_name, tags, params)
        writers.child_run = child.run
        self._run.run_id, self._run.experiment_id = run_id, experiment_id
        return True

    def resume(self, run_id: str, recomputed: Collection[str] = ()) -> str:
        """Reopen an existing run: set its status back to ``RUNNING`` and log to it from now on.

        Unlike :meth:`start`, this needs the store: a run that cannot be reached cannot be continued.

        The run goes on from a checkpoint, so it logs again the steps its first life logged after that checkpoint
        (up to where it was stopped or killed). Each step is written once: for every metric key the store holds,
        values at the steps it holds for that key are dropped, and the steps it misses (per-update series, stepped
        by task, finish out of order) are written (MLflow's ``system/`` metrics excepted: their steps count
        samples and start again at 0). The keys in ``recomputed`` are figures this life computes again from the
        whole (a sweep's table): written at every step, the new value the latest of its step.
        """
        if self.started:
            raise RuntimeError(f"this tracker already started run {self._run.run_id or '(spooled)'}")
        self._writers.prepare(False)
        identity = self._run
        client = identity.connect(self._log)
        with self._http():
            run = client.get_run(run_id)
            experiment = client.get_experiment(run.info.experiment_id)
            client.update_run(run_id, status="RUNNING")
            keys = [
                metric.key
                for metric in run.data.to_proto().metrics
                if not metric.key.startswith("system/") and metric.key not in recomputed
            ]
            self._writers.held_steps = self._stored_steps(client, run_id, keys)
            for key, value in owner_tags().items():  # this process owns the run from now on
                client.set_tag(run_id, key, value)
        identity.started_at = int(time.time() * 1000)
        identity.experiment, identity.run_name = experiment.name, run.info.run_name
        identity.experiment_id = run.info.experiment_id
        identity.run_id = run_id
        self._failover.room.hold()
        self._writers.start_writers(run_id)
        return run_id

    def _stored_steps(self, client: mlflow.MlflowClient, run_id: str, keys: Sequence[str]) -> dict[str, Container[int]]:
        """Return, per key of ``keys``, the steps the store holds for run ``run_id``.

        A SQLite store whose schema fits answers in one query; another store key by key, through the metric
        histories.
        """
        direct = SqliteMetrics.open(self._run.tracking_uri)
        if direct is not None:
            try:
                stored = direct.steps(run_id)
            finally:
                direct.close()
        else:
            self._writers.tell_schema_mismatch()
            stored = {key: sorted({int(m.step) for m in client.get_metric_history(run_id, key)}) for key in keys}
        return {key: _compact(stored.get(key, [])) for key in keys}

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set tags on the run (values stringified and cut to 8000 characters)."""
        self.check_started()
        clean = {safe_key(k): str(v)[:_MAX_TAG_VALUE] for k, v in tags.items()}
        if self._writers.child_job({"op": "tags", "tags": clean}):
            return

        def send(run_id: str, client: mlflow.MlflowClient) -> None:
            send_tags(client, run_id, clean)

        self._failover.deliver(send, lambda spool: spool.tags(clean))

    def finish(self, status: RunStatus) -> None:
        """Write queued metrics, stop the system monitor and close the run; idempotent.

        Whatever the store does not take goes to the spool; the store is tried once more (whatever
        ``retry_interval_s`` says) before the spool is left for ``flasync tracking replay``, whose command is then
        logged (``tracking.spool_left``) and printed on stderr.
        """
        if status not in get_args(RunStatus):
            raise ValueError(f"status must be one of {get_args(RunStatus)}, not {status!r}")
        writers = self._writers
        self.await_open()
        if not self.started or self._finished:
            writers.release_child(True)  # prepared, never started (or stopped already)
            return
        self._finished = True
        try:
            writers.take_back()  # a run that handed its writer process on ends through one again
            writers.stop_monitor()
        finally:
            lost = self.rows_lost = writers.close_writer()
            self._failover.replay_spilled()  # what the backlog could not hold, while the run is still open
            if lost:
                self._log.warning(
                    "tracking.metric_rows_lost",
                    message=f"{lost} metric rows of this run were neither written nor kept in its journal",
                    lost=lost,
                    metrics=False,
                )
                with contextlib.suppress(Exception):  # the count is in the warning whatever the store does
                    self.set_tags({LOST_TAG: str(lost)})
            if status == "FINISHED" and self._failover.records_lost:
                status = "FAILED"  # records lost for good (a full disk under the store and the spool): not a whole run
            end = int(time.time() * 1000)
            self._failover.room.give_back()  # a disk that the store and the spool filled has room for the status
            answer = writers.child_reply({"op": "end", "status": status, "end_time": end})
            ended = answer is not None
            writers.release_child(ended)
            self._count_system_lost(answer)

            def send(run_id: str, client: mlflow.MlflowClient) -> None:
                client.set_terminated(run_id, status, end_time=end)

            failover = self._failover
            with failover.lock:
                if not ended:
                    failover.deliver_status(send, status, end)
                failover.close()
                if not lost and not failover.offline:
                    failover.retire_journal()  # the run holds all it kept

    def lost(self) -> int:
        """Return the metric rows of the run neither written to the store nor kept in its journal: all of them once
        the run ended, those dropped so far before (a backlog full with nowhere to spill)."""
        if self.rows_lost is not None:
            return self.rows_lost
        writer = self._writers.writer
        return writer.dropped if writer is not None else 0

    def _count_system_lost(self, answer: str | None) -> None:
        """Count the system metric rows the writer process's monitor lost (its ``end`` answer) with the run's lost
        rows, in one warning and the tag."""
        lost = int(answer) if answer and answer.strip().isdigit() else 0
        if not lost:
            return
        self.rows_lost = (self.rows_lost or 0) + lost
        self._log.warning(
            "tracking.system_metrics_lost",
            message=f"{lost} system metric rows of this run never reached the store",
            rows=lost,
            metrics=False,
        )
        with contextlib.suppress(Exception):
            self.set_tags({LOST_TAG: str(self.rows_lost)})


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
