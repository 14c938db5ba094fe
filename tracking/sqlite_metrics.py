"""Metric rows written straight into a SQLite store's tables, as MLflow's ``log_batch`` writes them.

MLflow's SQLAlchemy store spends 50-100 microseconds of Python per metric in ``log_batch`` (an ORM object per row,
a session, a query of the latest values); a short run's 6,500 rows cost its writer process more CPU than the rest of
its work together, on the cores that train. :class:`SqliteMetrics` writes the same rows with two ``executemany``
statements in one transaction, a few microseconds each, and leaves the store exactly as ``log_batch`` would:

* every row goes into ``metrics``; a row equal to one already stored (its whole primary key: key, timestamp,
  step, value, NaN flag) is skipped, as MLflow skips it;
* NaN is stored as 0 with ``is_nan`` set and infinities as the largest finite doubles (MLflow's
  ``sanitize_metric_value``);
* ``latest_metrics`` keeps, per key, the row that is greatest by ``(step, timestamp, value)``, the first of equals;
* the run must exist and be active, and keys, values, timestamps and steps pass MLflow's own ``_validate_metric``.

It is used only where it is known to be exact: :meth:`SqliteMetrics.open` checks first that the store's schema is at
a revision this module was written for (the Alembic revision in its ``alembic_version`` table, one of
:data:`SCHEMA_REVISIONS`; :func:`schema_mismatch` says which revision it found, and MLflow's newest one), then that
both tables have exactly the columns and primary keys it writes, and returns None otherwise (another MLflow schema, a
server URI, a database other than SQLite), so the caller goes on with MLflow's own ``MlflowClient.log_batch``.

A run's parameters (121 for a default config) and its tags cost MLflow's store a session, queries and an ORM object
each too, and its end a load of the whole run. :meth:`SqliteMetrics.write_params` and :meth:`SqliteMetrics.write_tags`
write them in one transaction, as ``log_batch`` would (:meth:`SqliteMetrics.end_run` sets the status and end time
as ``set_terminated`` does): keys and values checked (values cut to MLflow's length) by MLflow's own ``_validate_param``
and ``_validate_tag``, the run active, a tag's value replaced; they return False, writing nothing, wherever MLflow
would do more than that or refuse (a parameter given another value than the one stored, the tag
``mlflow.runName``, which renames the run, tables of another shape), and the caller then calls ``log_batch``.

At a run's end its evaluation is linked to its logged models (:mod:`flasync.tracking.model_metrics`):
:meth:`SqliteMetrics.points` reads the stored points of some series in one query, and :meth:`SqliteMetrics.link`
adds them to a model's metrics (``logged_model_metrics``) in one transaction, as ``log_batch`` of the same points
with the model's id leaves the store, without reading the run and writing each point again.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import re
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flasync.tracking.store import sqlite_path

__all__ = ["SCHEMA_REVISIONS", "SchemaMismatch", "SqliteMetrics", "mlflow_head_revision", "schema_mismatch"]

SCHEMA_REVISIONS: frozenset[str] = frozenset(
    {
        "dc11669786a5",  # MLflow 3.17's head
        # MLflow 3.18's migrations: skill registry tables, issue categories, case-sensitive MCP server versions (none
        # touches the runs, metrics, latest_metrics, params or tags tables)
        "e7d1f4b2a9c6",
        "8b6ad64cb8f5",
        "f4a9b2c7d1e6",  # MLflow 3.18's head
    }
)
"""The Alembic revisions of MLflow's store schema whose tables this module writes as ``log_batch`` does: a store at
another revision is left to ``log_batch``. A revision joins once ``tests/unit/tracking/test_sqlite_metrics.py`` passes
with the MLflow whose head it is."""

_LARGEST = 1.7976931348623157e308
_METRICS = {"key", "value", "timestamp", "run_uuid", "step", "is_nan"}
_METRICS_KEY = ("key", "timestamp", "step", "run_uuid", "value", "is_nan")
_LATEST = {"key", "value", "timestamp", "step", "is_nan", "run_uuid"}
_LATEST_KEY = ("key", "run_uuid")
_NAMED = {"key", "value", "run_uuid"}  # the columns of ``params`` and of ``tags``
_NAMED_KEY = ("key", "run_uuid")
_RUN_COLUMNS = {"run_uuid", "status", "end_time", "lifecycle_stage"}  # of ``runs``, that end_run reads and writes
_MODEL_METRICS = {
    "model_id",
    "metric_name",
    "metric_timestamp_ms",
    "metric_step",
    "metric_value",
    "experiment_id",
    "run_id",
    "dataset_uuid",
    "dataset_name",
    "dataset_digest",
}
_MODEL_METRICS_KEY = ("model_id", "metric_name", "metric_timestamp_ms", "metric_step", "run_id")
_LINK = (
    "INSERT OR IGNORE INTO logged_model_metrics (model_id, metric_name, metric_timestamp_ms, metric_step, "
    "metric_value, experiment_id, run_id) VALUES (?, ?, ?, ?, ?, ?, ?)"
)
_END_STATUSES = frozenset({"FINISHED", "FAILED", "KILLED"})
_RUN_NAME_TAG = "mlflow.runName"  # MLflow's ``set_tag`` renames the run too: left to it
_BUSY_TIMEOUT_S = 30.0  # as long as flasync's own schema work waits for the store's lock

_INSERT = "INSERT OR IGNORE INTO metrics (key, value, timestamp, run_uuid, step, is_nan) VALUES (?, ?, ?, ?, ?, ?)"
# Only a strictly greater (step, timestamp, value) replaces the latest value, as MLflow compares them.
_UPSERT = (
    "INSERT INTO latest_metrics (key, value, timestamp, step, is_nan, run_uuid) VALUES (?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (key, run_uuid) DO UPDATE SET "
    "value = excluded.value, timestamp = excluded.timestamp, step = excluded.step, is_nan = excluded.is_nan "
    "WHERE (excluded.step, excluded.timestamp, excluded.value) "
    "> (latest_metrics.step, latest_metrics.timestamp, latest_metrics.value)"
)

Row = tuple[str, float, int, int]
"""``(key, value, timestamp, step)``, as a :class:`flasync.tracking.metrics.MetricRow` or a batch line of the writer."""


class SqliteMetrics:
    """Write metric rows of runs of one SQLite store (see the module docstring).

    Build it with :meth:`open`. Not thread-safe: one writer uses it.

    Args:
        connection: An open connection to the store, in autocommit mode.
        validate: MLflow's ``_validate_metric(key, value, timestamp, step)``: raises for a row MLflow refuses.
    """

    def __init__(
        self,
        connection: sqlite3.Connection,
        validate: Callable[..., None],
        *,
        params_and_tags: bool = False,
        model_metrics: bool = False,
    ) -> None:
        """Take the connection; ``params_and_tags``: the ``params``, ``tags`` and ``runs`` tables have the shape
        :meth:`write_params`, :meth:`write_tags` and :meth:`end_run` write (else they write nothing);
        ``model_metrics``: the ``logged_model_metrics`` table has the shape :meth:`link` writes (else it writes
        nothing)."""
        self._connection = connection
        self._validate = validate
        self._keys: set[str] = set()  # keys MLflow's check accepted already (the check of a key is the dear part)
        self._named = params_and_tags
        self._models = model_metrics

    @classmethod
    def open(cls, tracking_uri: str, *, timeout_s: float = _BUSY_TIMEOUT_S) -> SqliteMetrics | None:
        """Return a writer for the SQLite store at ``tracking_uri``, or None where it cannot write exactly as MLflow
        does: not a SQLite file, a store without MLflow's tables yet, a schema revision not in
        :data:`SCHEMA_REVISIONS`, tables of another shape, or an MLflow whose metric check is not the one this module
        calls.

        Args:
            tracking_uri: The store's URI.
            timeout_s: How long a write waits for another connection's lock before it fails.
        """
        path = sqlite_path(tracking_uri)
        if path is None or not Path(path).is_file() or schema_mismatch(tracking_uri) is not None:
            return None
        try:
            from mlflow.utils.validation import _validate_metric

            validate: Callable[..., None] = _validate_metric
            validate("flasync/probe", 1.0, 0, 0)  # the check takes what this module gives it
        except Exception:  # an MLflow without that check, or with another one: its own log_batch validates
            return None
        try:
            connection = sqlite3.connect(path, timeout=timeout_s, isolation_level=None, check_same_thread=False)
        except sqlite3.Error:
            return None
        try:
            fits = _table_fits(connection, "metrics", _METRICS, _METRICS_KEY) and _table_fits(
                connection, "latest_metrics", _LATEST, _LATEST_KEY
            )
        except sqlite3.Error:
            fits = False
        if not fits:
            connection.close()
            return None
        try:
            named = (
                _table_fits(connection, "params", _NAMED, _NAMED_KEY)
                and _table_fits(connection, "tags", _NAMED, _NAMED_KEY)
                and {row[1] for row in connection.execute("PRAGMA table_info(runs)")} >= _RUN_COLUMNS
            )
        except sqlite3.Error:
            named = False
        try:
            models = named and _table_fits(connection, "logged_model_metrics", _MODEL_METRICS, _MODEL_METRICS_KEY)
        except sqlite3.Error:
            models = False
        return cls(connection, validate, params_and_tags=named, model_metrics=models)

    def write(self, run_id: str, rows: Iterable[Row]) -> None:
        """Store ``rows`` of run ``run_id`` in one transaction (all or nothing).

        Raises:
            LookupError: If the store has no run ``run_id``.
            ValueError: If the run is not active (deleted), or a row is one MLflow refuses (the message is
                MLflow's).
            sqlite3.Error: If the store cannot be written (locked past the timeout, read-only, full).
        """
        values = self._sanitized(run_id, rows)
        if not values:
            return
        latest: dict[str, tuple[Any, ...]] = {}
        for row in values:  # (key, value, timestamp, run, step, is_nan)
            held = latest.get(row[0])
            if held is None or (row[4], row[2], row[1]) > (held[2], held[1], held[0]):
                latest[row[0]] = (row[1], row[2], row[4], row[5])
        with self._transaction(run_id) as connection:
            connection.executemany(_INSERT, values)
            connection.executemany(_UPSERT, [(key, *held, run_id) for key, held in latest.items()])

    def write_params(self, run_id: str, params: Mapping[str, str]) -> bool:
        """Store the parameters ``params`` of run ``run_id`` in one transaction, as ``log_batch`` would; False,
        writing nothing, where it leaves them to MLflow (see the module docstring).

        Raises:
            LookupError: If the store has no run ``run_id``.
            ValueError: If the run is not active (deleted).
            sqlite3.Error: If the store cannot be written (locked past the timeout, read-only, full).
        """
        from mlflow.utils.validation import _validate_param

        checked = self._checked(_validate_param, params)
        if checked is None:
            return False
        if not checked:
            return True
        try:
            with self._transaction(run_id) as connection:
                keys = list(checked)
                held: dict[str, str] = {}
                for begin in range(0, len(keys), _SQL_VARIABLES):
                    chunk = keys[begin : begin + _SQL_VARIABLES]
                    marks = ",".join("?" * len(chunk))
                    query = f"SELECT key, value FROM params WHERE run_uuid = ? AND key IN ({marks})"
                    held.update(connection.execute(query, (run_id, *chunk)).fetchall())
                if any(held[key] != value for key, value in checked.items() if key in held):
                    raise _LeftToMlflow  # MLflow refuses to change a parameter, with its own message
                rows = [(key, value, run_id) for key, value in checked.items() if key not in held]
                connection.executemany("INSERT INTO params (key, value, run_uuid) VALUES (?, ?, ?)", rows)
        except _LeftToMlflow:
            return False
        return True

    def write_tags(self, run_id: str, tags: Mapping[str, str]) -> bool:
        """Set the tags ``tags`` of run ``run_id`` in one transaction, as ``log_batch`` would (a tag's new value
        replaces its old one); False, writing nothing, where it leaves them to MLflow (see the module docstring).

        Raises:
            LookupError: If the store has no run ``run_id``.
            ValueError: If the run is not active (deleted).
            sqlite3.Error: If the store cannot be written (locked past the timeout, read-only, full).
        """
        from mlflow.utils.validation import _validate_tag

        if _RUN_NAME_TAG in tags:
            return False
        checked = self._checked(_validate_tag, tags)
        if checked is None:
            return False
        if not checked:
            return True
        with self._transaction(run_id) as connection:
            connection.executemany(
                "INSERT INTO tags (key, value, run_uuid) VALUES (?, ?, ?) "
                "ON CONFLICT (key, run_uuid) DO UPDATE SET value = excluded.value",
                [(key, value, run_id) for key, value in checked.items()],
            )
        return True

    def end_run(self, run_id: str, status: str, end_time: int) -> bool:
        """Mark run ``run_id`` ended with ``status`` at ``end_time`` (ms), as MLflow's ``set_terminated`` does on a
        SQLite store; False, writing nothing, for a status that is not an end (left to MLflow).

        Raises:
            LookupError: If the store has no run ``run_id``.
            ValueError: If the run is not active (deleted).
            sqlite3.Error: If the store cannot be written (locked past the timeout, read-only, full).
        """
        if not self._named or status not in _END_STATUSES or type(end_time) is not int:
            return False
        with self._transaction(run_id) as connection:
            connection.execute(
                "UPDATE runs SET status = ?, end_time = ? WHERE run_uuid = ?", (status, end_time, run_id)
            )
        return True

    def _checked(self, validate: Callable[[str, str], Any], entries: Mapping[str, str]) -> dict[str, str] | None:
        """Return ``entries`` as MLflow's ``validate`` leaves them (values cut to its length), None where it refuses
        one or this store's tables are not the shape written here."""
        if not self._named:
            return None
        checked = {}
        for key, value in entries.items():
            try:
                entity = validate(key, value)
            except Exception:  # MLflow's log_batch raises it again, with its own message
                return None
            checked[str(entity.key)] = str(entity.value)
        return checked

    @contextlib.contextmanager
    def _transaction(self, run_id: str) -> Iterator[sqlite3.Connection]:
        """Open a write transaction on run ``run_id``, checked to exist and be active; commit it when the block
        ends, roll it back when it raises."""
        connection = self._connection
        connection.execute("BEGIN IMMEDIATE")
        try:
            _check_active(connection, run_id)
            yield connection
            connection.execute("COMMIT")
        except BaseException:
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            raise

    def steps(self, run_id: str) -> dict[str, list[int]]:
        """Return, per metric key of run ``run_id``, the steps the store holds for it (ascending, each once)."""
        held: dict[str, list[int]] = {}
        query = "SELECT DISTINCT key, step FROM metrics WHERE run_uuid = ? ORDER BY key, step"
        for key, step in self._connection.execute(query, (run_id,)):
            held.setdefault(key, []).append(step)
        return held

    def link(self, run_id: str, model_id: str, points: Sequence[Row]) -> bool:
        """Link ``points`` of run ``run_id`` (as :meth:`points` gives them: stored already) to its experiment's
        logged model ``model_id`` in one transaction, as ``log_batch`` of those points with the model's id does (the
        run's series hold them already: only the model's metrics gain rows, each point once; of points of one key,
        time and step but different values, which ``log_batch`` refuses together, the first is linked); False,
        writing nothing, where it leaves them to MLflow: a ``logged_model_metrics`` table of another shape, or no
        such model in the run's experiment.

        Raises:
            LookupError: If the store has no run ``run_id``.
            ValueError: If the run is not active (deleted).
            sqlite3.Error: If the store cannot be written (locked past the timeout, read-only, full).
        """
        if not self._models:
            return False
        try:
            with self._transaction(run_id) as connection:
                query = (
                    "SELECT runs.experiment_id FROM runs JOIN logged_models ON logged_models.experiment_id = "
                    "runs.experiment_id WHERE runs.run_uuid = ? AND logged_models.model_id = ?"
                )
                found = connection.execute(query, (run_id, model_id)).fetchone()
                if found is None:
                    raise _LeftToMlflow  # MLflow says what is wrong with the model
                rows = [(model_id, key, t, step, value, found[0], run_id) for key, value, t, step in points]
                connection.executemany(_LINK, rows)
        except _LeftToMlflow:
            return False
        return True

    def points(self, run_id: str, prefixes: Sequence[str], step: int | None = None) -> list[Row]:
        """Return the points of run ``run_id`` whose keys start with one of ``prefixes`` (of ``step`` only, unless
        None), NaN points left out, as ``(key, value, timestamp, step)`` ordered by key, timestamp, step and value:
        what ``MlflowClient.get_metric_history`` gives of those series, in one query (infinities as MLflow stores
        them)."""
        query = "SELECT key, value, timestamp, step FROM metrics WHERE run_uuid = ? AND is_nan = 0"
        arguments: tuple[object, ...] = (run_id,)
        if step is not None:
            query, arguments = f"{query} AND step = ?", (run_id, step)
        starts = tuple(prefixes)
        rows = self._connection.execute(f"{query} ORDER BY key, timestamp, step, value", arguments)
        return [(key, float(value), int(t), int(s)) for key, value, t, s in rows if key.startswith(starts)]

    def close(self) -> None:
        """Close the connection."""
        self._connection.close()

    def _sanitized(self, run_id: str, rows: Iterable[Row]) -> list[tuple[str, float, int, str, int, int]]:
        """Return the rows as ``metrics`` rows, NaN and infinities stored as MLflow stores them; check them first."""
        out = []
        keys = self._keys
        for key, value, timestamp, step in rows:
            if (
                key not in keys
                or type(value) is not float
                or type(timestamp) is not int
                or type(step) is not int
                or timestamp < 0
            ):
                try:
                    self._validate(key, value, timestamp, step)
                except Exception as exc:  # MLflow's MlflowException: its message names the row's problem
                    raise ValueError(str(exc)) from None
                keys.add(key)
            value = float(value)
            if math.isnan(value):
                out.append((key, 0.0, int(timestamp), run_id, int(step), 1))
            elif math.isinf(value):
                out.append((key, _LARGEST if value > 0 else -_LARGEST, int(timestamp), run_id, int(step), 0))
            else:
                out.append((key, value, int(timestamp), run_id, int(step), 0))
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class SchemaMismatch:
    """A SQLite store whose schema is not at a revision :class:`SqliteMetrics` was written for.

    Attributes:
        store: The revision in the store's ``alembic_version`` table (None: the table is missing or unreadable).
        expected: The revisions the direct writes were written for (:data:`SCHEMA_REVISIONS`), sorted.
        head: The newest revision of the installed MLflow's migrations (None when they cannot be read).
    """

    store: str | None
    expected: tuple[str, ...]
    head: str | None


def schema_mismatch(tracking_uri: str, revisions: frozenset[str] | None = None) -> SchemaMismatch | None:
    """Return how the SQLite store at ``tracking_uri`` differs from the schema the direct writes were written for,
    or None when its revision is one of ``revisions`` (:data:`SCHEMA_REVISIONS` when None), or when it is no SQLite
    file (nothing is written directly there). MLflow is not imported.
    """
    expected = SCHEMA_REVISIONS if revisions is None else revisions
    path = sqlite_path(tracking_uri)
    if path is None or not Path(path).is_file():
        return None
    revision = _store_revision(Path(path))
    if revision in expected:
        return None
    return SchemaMismatch(store=revision, expected=tuple(sorted(expected)), head=mlflow_head_revision())


def _store_revision(path: Path) -> str | None:
    """Return the Alembic revision in the store's ``alembic_version`` table (None: no table, or not one row)."""
    try:
        with contextlib.closing(sqlite3.connect(path, timeout=_BUSY_TIMEOUT_S)) as connection:
            rows = connection.execute("SELECT version_num FROM alembic_version").fetchall()
    except sqlite3.Error:
        return None
    return str(rows[0][0]) if len(rows) == 1 else None


_REVISION = re.compile(r"""^(down_)?revision\s*=\s*['"]([0-9a-z_]+)['"]""", re.MULTILINE)


def mlflow_head_revision() -> str | None:
    """Return the newest revision of the installed MLflow's store migrations (the one no other revises), read from
    its migration scripts without importing MLflow; None when they cannot be read or have no single head."""
    spec = importlib.util.find_spec("mlflow")
    if spec is None or spec.origin is None:
        return None
    versions = Path(spec.origin).parent / "store" / "db_migrations" / "versions"
    revised: set[str] = set()
    known: set[str] = set()
    try:
        for script in versions.glob("*.py"):
            for down, revision in _REVISION.findall(script.read_text(encoding="utf-8")):
                (revised if down else known).add(revision)
    except OSError:
        return None
    heads = known - revised
    return heads.pop() if len(heads) == 1 else None


class _LeftToMlflow(Exception):
    """Raised inside a transaction of :class:`SqliteMetrics` to roll it back and leave the write to MLflow."""


_SQL_VARIABLES = 500  # keys per query: well under SQLite's oldest limit of 999 bound variables


def _check_active(connection: sqlite3.Connection, run_id: str) -> None:
    """Raise LookupError if the store has no run ``run_id``, ValueError if the run is not active."""
    stage = connection.execute("SELECT lifecycle_stage FROM runs WHERE run_uuid = ?", (run_id,)).fetchone()
    if stage is None:
        raise LookupError(f"Run with id={run_id} not found")
    if stage[0] != "active":
        raise ValueError(f"The run {run_id} must be in the 'active' state. Current state is {stage[0]}.")


def _table_fits(connection: sqlite3.Connection, table: str, columns: set[str], key: Sequence[str]) -> bool:
    """Tell whether ``table`` has exactly ``columns`` and the primary key ``key`` (in that order)."""
    info = connection.execute(f"PRAGMA table_info({table})").fetchall()  # (cid, name, type, notnull, default, pk)
    if {row[1] for row in info} != columns:
        return False
    primary = sorted((row[5], row[1]) for row in info if row[5])
    return tuple(name for _, name in primary) == tuple(key)
