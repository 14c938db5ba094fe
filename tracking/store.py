"""The MLflow store as a location: tracking URIs, artifact locations, HTTP bounds, experiments.

This is the one module of :mod:`tracking` that touches process-global state: :func:`bounded_http` sets MLflow's
HTTP environment variables for the calls made inside it (MLflow reads no other setting for them), and
:func:`resolve_tracking_uri` reads ``MLFLOW_TRACKING_URI``. Everything else in the package takes a URI and an
explicit ``MlflowClient``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shlex
import shutil
import sqlite3
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from flasync.tracking._schema_seed import SEEDS, seed_schema

if TYPE_CHECKING:
    import mlflow

__all__ = [
    "DEFAULT_ARTIFACT_ROOT",
    "DEFAULT_TRACKING_URI",
    "EXPERIMENT_KIND",
    "EXPERIMENT_KIND_TAG",
    "ExperimentDeletedError",
    "StoreNotWritableError",
    "absolute_tracking_uri",
    "artifact_location",
    "bounded_http",
    "check_local_store",
    "default_schema_cache",
    "ensure_experiment",
    "experiment_url",
    "http_env",
    "is_remote",
    "prepare_sqlite_store",
    "redact_uri",
    "resolve_tracking_uri",
    "sqlite_path",
    "ui_command",
]

DEFAULT_TRACKING_URI = "sqlite:///mlruns/mlflow.db"
"""The local store used when neither an argument nor ``MLFLOW_TRACKING_URI`` names one."""
DEFAULT_ARTIFACT_ROOT = "mlruns/artifacts"
"""Where the default store keeps artifacts (one folder per experiment), relative to the cwd."""

_UNSAFE_DIR_CHARS = re.compile(r"[^\w.\-]")

# Process-wide bookkeeping of bounded_http(): entered scopes and the values they replaced.
_HTTP_LOCK = threading.Lock()
_HTTP_DEPTH = 0
_HTTP_SAVED: dict[str, str | None] = {}


class ExperimentDeletedError(RuntimeError):
    """The run's MLflow experiment exists but is deleted (a user decision, never spooled around)."""


def resolve_tracking_uri(uri: str | None = None) -> str:
    """Return the store a tracker with ``tracking_uri=uri`` would use: ``uri``, else ``$MLFLOW_TRACKING_URI``, else
    :data:`DEFAULT_TRACKING_URI`; a relative SQLite path is made absolute against the current directory."""
    return absolute_tracking_uri(uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI)


def sqlite_path(uri: str) -> Path | None:
    """Return the database file of a ``sqlite:///`` URI, None for other or in-memory stores."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///") :].partition("?")[0]
    if not path or path == ":memory:":
        return None
    return Path(path)


def absolute_tracking_uri(uri: str) -> str:
    """Anchor a relative SQLite path to the current directory, so a later chdir cannot move it."""
    path = sqlite_path(uri)
    if path is None or path.is_absolute():
        return uri
    query = uri.partition("?")[2]
    absolute = "sqlite:///" + path.expanduser().absolute().as_posix()
    return f"{absolute}?{query}" if query else absolute


def is_remote(tracking_uri: str) -> bool:
    """Tell whether a tracking URI names an MLflow server reached over HTTP(S)."""
    return tracking_uri.partition(":")[0].lower() in ("http", "https")


def check_answers(tracking_uri: str, timeout_s: float) -> None:
    """Raise ``ConnectionError`` when an MLflow server does not answer within ``timeout_s``, without MLflow.

    A tracker asks this before it imports MLflow in its own process (some 80,000 objects, whose creation sets off
    full garbage collections that stop every thread, an embedding service's event loop too): a server that is down
    or hangs costs no import. Any HTTP answer to ``GET /health`` (even an error status) counts as answering, and so
    does a TLS failure (MLflow has its own TLS settings); only a refused, reset or timed-out connection does not.
    Stores other than HTTP(S) servers pass.

    Args:
        tracking_uri: The store.
        timeout_s: Longest wait for the connection and the answer, in seconds.

    Raises:
        ConnectionError: The server refused the connection, reset it, or did not answer in time.
    """
    if not is_remote(tracking_uri):
        return
    import socket
    import urllib.error
    import urllib.parse
    import urllib.request

    parts = urllib.parse.urlsplit(tracking_uri)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    # Without the credentials a URI may carry: an answer of 401 is an answer.
    url = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/") + "/health", "", ""))
    try:
        urllib.request.urlopen(url, timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError | ConnectionError | socket.gaierror):
            raise ConnectionError(f"MLflow at {redact_uri(tracking_uri)} does not answer: {exc.reason}") from None
    except (TimeoutError, ConnectionError) as exc:
        raise ConnectionError(f"MLflow at {redact_uri(tracking_uri)} does not answer: {exc}") from None


def http_env(timeout_s: int, retries: int) -> dict[str, str]:
    """Return the MLflow environment variables that bound one HTTP request's connect/read time and retries."""
    return {
        "MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, int(timeout_s))),
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(max(0, int(retries))),
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
        "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0",
    }


@contextlib.contextmanager
def bounded_http(tracking_uri: str, *, timeout_s: int = 10, retries: int = 1) -> Iterator[None]:
    """Bound MLflow's HTTP timeout and retries for the calls made inside the block, for a server URI only.

    MLflow reads ``MLFLOW_HTTP_REQUEST_TIMEOUT`` / ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` (default 120 s and 7 retries
    with exponential backoff, minutes in all) from the environment on every request; nothing else bounds a call to
    a server that does not answer. Inside this block those variables the user has not set are set to the given
    bounds, and restored when the last such block (of any thread) exits. Variables the user set are left alone.
    Local stores (SQLite, files) are not affected at all.
    """
    if not is_remote(tracking_uri):
        yield
        return
    global _HTTP_DEPTH
    with _HTTP_LOCK:
        if _HTTP_DEPTH == 0:
            _HTTP_SAVED.clear()
            for name, value in http_env(timeout_s, retries).items():
                if name not in os.environ:
                    _HTTP_SAVED[name] = None
                    os.environ[name] = value
        _HTTP_DEPTH += 1
    try:
        yield
    finally:
        with _HTTP_LOCK:
            _HTTP_DEPTH -= 1
            if _HTTP_DEPTH == 0:
                for name in _HTTP_SAVED:
                    os.environ.pop(name, None)
                _HTTP_SAVED.clear()


def artifact_location(tracking_uri: str, experiment: str, artifact_root: str | None = None) -> str | None:
    """Return where a new experiment of a store keeps its artifacts (see :class:`MlflowTracker`).

    Args:
        tracking_uri: The store.
        experiment: The experiment's name (made a safe folder name).
        artifact_root: Folder or URI of experiments' artifact folders; next to a SQLite file when None.

    Returns:
        A URI, or None to let the store choose (file stores, servers).
    """
    folder = _UNSAFE_DIR_CHARS.sub("_", experiment).strip(".") or "experiment"
    if artifact_root is None:
        db = sqlite_path(tracking_uri)
        if db is None:
            return None  # a file store or a server picks its own location
        return (db.parent / "artifacts" / folder).as_uri()
    if "://" in artifact_root:
        return f"{artifact_root.rstrip('/')}/{folder}"
    return (Path(artifact_root).expanduser().absolute() / folder).as_uri()


EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
"""What MLflow's UI calls an experiment of training runs (without it the UI opens on its GenAI pages)."""


def ensure_experiment(client: mlflow.MlflowClient, name: str, artifact_location: str | None = None) -> str:
    """Return the id of the active experiment ``name``, creating it (with ``artifact_location``) if it is missing.

    Another process may create it at the same moment: a failed creation looks the experiment up again. The
    experiment is tagged ``mlflow.experimentKind = custom_model_development`` (training runs) unless it already says
    what kind it is.

    Raises:
        ExperimentDeletedError: The experiment exists but is deleted.
        mlflow.exceptions.MlflowException: The store refused a call.
    """
    import mlflow

    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            created: str = client.create_experiment(
                name, artifact_location=artifact_location, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
            )
            return created
        except mlflow.exceptions.MlflowException:
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
    if experiment.lifecycle_stage != "active":
        raise ExperimentDeletedError(
            f"MLflow experiment {name!r} is deleted; restore it with "
            f"`mlflow experiments restore --experiment-id {experiment.experiment_id}` "
            "or choose another name"
        )
    found: str = experiment.experiment_id
    if EXPERIMENT_KIND_TAG not in experiment.tags:
        client.set_experiment_tag(found, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return found


def redact_uri(uri: str) -> str:
    """Return ``uri`` with the password of its user info replaced by ``***`` (``http://me:***@host``).

    Everything flasync writes or shows (logs, params, spools, config files, a child's command line) takes this form;
    the credentials themselves only go to MLflow's client (or to ``MLFLOW_TRACKING_USERNAME`` / ``_PASSWORD``).
    """
    return re.sub(r"(?<=://)([^/@:]*):[^/@]*@", r"\1:***@", uri)


class StoreNotWritableError(OSError):
    """A local store's folder cannot be created or written (a read-only or foreign working directory)."""


def check_local_store(uri: str) -> None:
    """Fail at once, in one line, when a local SQLite store could not be written.

    The folder of the database is created if missing, then a probe file is created in it and removed, so a
    read-only file system, missing permissions or a path through a file are found before a run starts rather than
    as a traceback (or a silent fall back to the spool) after it did.

    Args:
        uri: The tracking URI (other stores are not checked).

    Raises:
        StoreNotWritableError: The folder cannot be created or written.
    """
    db = sqlite_path(uri)
    if db is None:
        return
    folder = db.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise StoreNotWritableError(
            f"cannot write the MLflow store's folder {folder} ({reason}): run from a writable folder, or pass "
            "--tracking-uri with a writable store, or --no-tracking"
        ) from None


def default_schema_cache() -> Path:
    """Return the folder where new SQLite stores' empty schemas are kept for reuse: ``$XDG_CACHE_HOME/flasync/
    mlflow-schema``, or ``~/.cache/flasync/mlflow-schema``."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "flasync" / "mlflow-schema"


def prepare_sqlite_store(
    uri: str,
    log: Any = None,
    *,
    schema_cache: Path | Literal[False] | None = None,
    seeds: Path | Literal[False] | None = None,
) -> None:
    """Make a SQLite store ready for several processes: schema created once, WAL journal, repaired if half-built.

    MLflow creates a new SQLite store's schema (some 70 migrations, about a second of CPU) in the first process that
    opens it; processes that open it at the same moment run the migrations concurrently and leave it half-built for
    good (``table _alembic_tmp_tags already exists``). Here the first process takes an exclusive lock on ``<db>.lock``
    and creates the schema while the others wait; then the database is put in WAL mode, so runs write while others
    read. A store a crash or an older flasync left half-built (migration tables left over, no schema version) and that
    holds no run is moved aside (``<db>.broken-<time>``) and built afresh; one that holds runs is an error naming the
    repair.

    The first schema built for an MLflow version is kept, empty, in ``schema_cache`` (one file per MLflow version, its
    migration scripts and SQLite's version); a new store of the same versions is a copy of it, which MLflow opens as
    a store it built (its ``Default`` experiment, whose artifact location depends on the working directory, is made
    when the store is first opened, as for any new store). When none is kept yet, the schema is replayed from the
    seed flasync ships for the installed MLflow's migrations, if it has one (:mod:`flasync.tracking._schema_seed`),
    rather
    than built by them.

    Args:
        uri: The tracking URI (nothing is done for other stores).
        log: Where the repair is reported.
        schema_cache: Folder of the kept schemas; :func:`default_schema_cache` when None; False: keep nothing.
        seeds: Folder of the seeds; the ones flasync ships when None; False: none. With ``schema_cache=False`` and
            ``seeds=False``, every new store's schema is built by MLflow's migrations.

    Raises:
        RuntimeError: The store is half-built and holds runs (``mlflow db upgrade URI`` repairs it).
    """
    db = sqlite_path(uri)
    if db is None:
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as lock:
        _lock(lock, exclusive=True)
        try:
            state = _schema_state(db)
            if state == "half-built":
                if _has_runs(db):
                    raise RuntimeError(
                        f"the MLflow store {db} was left half-built (an interrupted schema migration) and holds runs; "
                        f"repair it with: mlflow db upgrade {uri}"
                    )
                aside = db.with_name(f"{db.name}.broken-{time.strftime('%Y%m%dT%H%M%S')}")
                db.rename(aside)
                if log is not None:
                    log.warning("tracking.store_repaired", path=str(db), moved_to=str(aside), metrics=False)
                state = "missing"
            if state == "missing":
                cache = default_schema_cache() if schema_cache is None else schema_cache or None
                _build_schema(db, cache, SEEDS if seeds is None else seeds or None)
            with contextlib.closing(sqlite3.connect(db, timeout=30)) as connection:
                connection.execute("PRAGMA journal_mode=WAL")
        finally:
            _lock(lock, exclusive=False)


_BUILDING = ".building-"


def _build_schema(db: Path, cache: Path | None, seeds: Path | None) -> None:
    """Create a new store's schema in a file of its own, then move that file into place (under the store's lock).

    A process killed while MLflow runs the migrations (a run that fails fast stops its writer process; SIGKILL; out
    of memory) so leaves no half-built store behind, only a ``<db>.building-*`` file that the next build removes.
    The file is a copy of the schema kept in ``cache`` when there is one (see :func:`prepare_sqlite_store`), else
    replayed from the installed MLflow's seed in ``seeds`` (see :mod:`flasync.tracking._schema_seed`), else built by
    MLflow's migrations; then it is kept in ``cache``.
    """
    import mlflow

    for stale in db.parent.glob(db.name + _BUILDING + "*"):  # no other process builds: the lock is ours
        stale.unlink(missing_ok=True)
    # A name of its own for each build: MLflow keeps one store object per URI for the life of the process.
    building = db.with_name(f"{db.name}{_BUILDING}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    template = cache / _schema_name() if cache is not None else None
    try:
        if template is None or not _copy_schema(template, building):
            # A seed that replays but leaves no whole schema (a truncated file rolls back to nothing) is no store.
            if seeds is None or not seed_schema(building, seeds) or _schema_state(building) != "ready":
                building.unlink(missing_ok=True)
                mlflow.MlflowClient(tracking_uri=f"sqlite:///{building}").search_experiments(max_results=1)
            if template is not None:
                _keep_schema(building, template)
        os.replace(building, db)
    finally:
        building.unlink(missing_ok=True)


def _schema_name() -> str:
    """Return the file name of the kept schema of this MLflow: its version, migration scripts and SQLite version."""
    import mlflow

    migrations = Path(mlflow.__file__).parent / "store" / "db_migrations" / "versions"
    scripts = sorted(path.name for path in migrations.glob("*.py"))
    key = "\n".join([mlflow.__version__, sqlite3.sqlite_version, *scripts])
    return f"mlflow-{mlflow.__version__}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.db"


def _copy_schema(template: Path, target: Path) -> bool:
    """Copy a kept schema to ``target``; False (and no ``target``) when there is none or it is not a whole schema."""
    try:
        shutil.copyfile(template, target)
        if _schema_state(target) == "ready" and not _has_experiments(target):
            return True
    except (OSError, sqlite3.Error):
        pass
    target.unlink(missing_ok=True)
    return False


def _keep_schema(built: Path, template: Path) -> None:
    """Keep an empty copy of a schema MLflow just built (without its ``Default`` experiment, whose artifact location
    is the building process's working directory); a cache that cannot be written is left alone."""
    partial = template.with_name(f"{template.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.partial")
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, partial)
        with contextlib.closing(sqlite3.connect(partial, timeout=30)) as connection, connection:
            connection.execute("DELETE FROM experiment_tags WHERE experiment_id = 0")
            connection.execute("DELETE FROM experiments WHERE experiment_id = 0")
        os.replace(partial, template)  # whole or not at all, also for processes copying it meanwhile
    except (OSError, sqlite3.Error):
        pass
    finally:
        partial.unlink(missing_ok=True)


def _has_experiments(db: Path) -> bool:
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as connection:
        return bool(connection.execute("SELECT COUNT(*) FROM experiments").fetchone()[0])


def _lock(file: Any, *, exclusive: bool) -> None:
    """Take (or release) an exclusive lock on an open file; a platform without ``fcntl`` goes without."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        return
    fcntl.flock(file, fcntl.LOCK_EX if exclusive else fcntl.LOCK_UN)


def _schema_state(db: Path) -> str:
    """Return ``missing`` (no schema yet), ``ready`` or ``half-built`` for a SQLite database file."""
    if not db.exists() or db.stat().st_size == 0:
        return "missing"
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as connection:
        tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            return "missing"
        if any(name.startswith("_alembic_tmp_") for name in tables) or "alembic_version" not in tables:
            return "half-built"
        if connection.execute("SELECT COUNT(*) FROM alembic_version").fetchone()[0] != 1:
            return "half-built"
    return "ready"


def _has_runs(db: Path) -> bool:
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as connection:
        try:
            return bool(connection.execute("SELECT COUNT(*) FROM runs").fetchone()[0])
        except sqlite3.OperationalError:  # no runs table: nothing to lose
            return False


def experiment_url(base: str, experiment_id: str, view: str | None = None) -> str:
    """Return the address of an experiment's training runs in the MLflow UI served at ``base``.

    MLflow 3's UI opens an experiment on its GenAI pages unless the address asks for ``workflowType=machine_learning``
    (the *Training runs* table); ``viewStateShareKey`` opens the runs view saved on the experiment under ``view``.

    Args:
        base: Where the UI is served, e.g. ``http://127.0.0.1:5000``.
        experiment_id: The experiment's id.
        view: The key of a runs view saved on the experiment, or None.
    """
    shared = f"&viewStateShareKey={view}" if view is not None else ""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning{shared}"


def ui_command(tracking_uri: str) -> str | None:
    """Return the shell command that opens the store ``tracking_uri`` in the MLflow UI.

    Artifacts under the experiments' ``file://`` locations are served by the UI as they are; it needs no artifact
    flag. None when the store is a server (open its URL instead).

    Returns:
        E.g. ``"mlflow ui --backend-store-uri sqlite:////home/me/proj/mlruns/mlflow.db"``.
    """
    scheme = tracking_uri.partition(":")[0].lower()
    if scheme in ("http", "https", "databricks", "databricks-uc", "uc"):
        return None
    return f"mlflow ui --backend-store-uri {shlex.quote(tracking_uri)}"
