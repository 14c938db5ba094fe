"""A local JSON-lines spool for what an MLflow run could not send, and its replay.

When the MLflow backend cannot be reached (or errors), :class:`~tracking.mlflow_run.MlflowTracker` writes every
record it would have sent - params, tags, metrics with their steps and timestamps, artifacts, the final status - to a
spool file, one JSON object per line, and replays the file in order once the backend answers again. What is still in
the spool when the run ends is replayed later with ``flasync tracking replay SPOOL`` (or :func:`replay`).

The file starts with a header record::

    {"type": "header", "format": "flasync-tracking-spool", "version": 1, "tracking_uri": "...",
     "experiment": "...", "run_name": null, "run_id": null, "start_time": 1763782000000, "created": "..."}

followed by records of these types::

    {"type": "params", "params": {"seed": "0", ...}}
    {"type": "tags", "tags": {"mode": "async", ...}}
    {"type": "metrics", "metrics": [["server.loss", 0.31, 1763782001234, 4], ...]}   # key, value, ms, step
    {"type": "artifact", "file": "run.artifacts/3/summary.json", "artifact_path": null}
    {"type": "dataset", "name": "digits", "digest": "3f1c...", "source": "...", "profile": "{...}", "context": "..."}
    {"type": "status", "status": "FINISHED", "end_time": 1763782009876}

Artifact files are copied into the folder ``<spool stem>.artifacts/`` next to the spool; ``file`` is relative to the
spool's folder. Replay progress (per target store: the run written to, the records and bytes done) is kept in
``<spool>.progress.json``, so a replay that stops half-way continues where it stopped and a finished one is not
repeated.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from flasync.tracking.metrics import MetricRow
from flasync.tracking.store import (
    ExperimentDeletedError,
    absolute_tracking_uri,
    artifact_location,
    bounded_http,
    ensure_experiment,
    redact_uri,
    sqlite_path,
)

__all__ = [
    "SPOOL_FORMAT",
    "SPOOL_VERSION",
    "ReplayResult",
    "Replayer",
    "SpoolError",
    "SpoolWriter",
    "artifact_file",
    "default_spool_path",
    "iter_records",
    "load_progress",
    "read_header",
    "replay",
    "save_progress",
]

SPOOL_FORMAT = "flasync-tracking-spool"
SPOOL_VERSION = 1
RECORD_TYPES = frozenset({"params", "tags", "metrics", "artifact", "dataset", "status"})
STATUSES = frozenset({"FINISHED", "FAILED", "KILLED"})

_MAX_METRICS_PER_CALL = 1000
_MAX_ENTRIES_PER_CALL = 100
_UNSAFE = re.compile(r"[^\w.\-]")


class SpoolError(ValueError):
    """A spool file cannot be read: missing, not JSON lines, no valid header, or a malformed record."""


def default_spool_path(experiment: str, root: str | Path = "mlruns/spool") -> Path:
    """Return a new spool path ``<root>/<UTC time>-<experiment>-<pid>.jsonl``, absolute against the cwd."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
    name = _UNSAFE.sub("_", experiment).strip(".") or "experiment"
    return Path(root).expanduser().absolute() / f"{stamp}-{name}-{os.getpid()}.jsonl"


def _json_line(record: Mapping[str, Any]) -> str:
    # NaN and infinities are legal metric values; Python's json reads back what it writes.
    return json.dumps(record, separators=(",", ":"), allow_nan=True, default=str) + "\n"


def _create(path: Path, tries: int = 3) -> int:
    """Create the file ``path`` for writing, readable by the owner only (the records may hold what the run logged:
    params, artifacts), and its folder; return its descriptor. A folder another run's tracker removed meanwhile (an
    empty spool folder is removed with its last journal, see :meth:`flasync.tracking.journal.RunJournal.retire`) is
    made again.

    Raises:
        FileExistsError: The file exists.
        OSError: It cannot be created.
    """
    for attempt in range(tries):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileNotFoundError:
            if attempt == tries - 1:
                raise
    raise FileNotFoundError(path)


class SpoolWriter:
    """Append records to a spool file; thread-safe, each record flushed to the OS as it is written.

    Args:
        path: The spool file; its folder is created. An existing file is refused.
        tracking_uri: The store the records were meant for.
        experiment: The experiment's name.
        run_name: The run's name, if any.
        run_id: The run's id if it was created before the backend failed, else None.
        start_time: The run's start, in ms since the epoch.
        on_failure: Told once, with the path and the reason, when a write fails (e.g. the disk is full); the spool
            takes no record after that and counts them in :attr:`lost` (a record is written whole or not at all).

    Raises:
        FileExistsError: ``path`` exists.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        tracking_uri: str,
        experiment: str,
        run_name: str | None,
        run_id: str | None,
        start_time: int,
        on_failure: Callable[[Path, str], None] | None = None,
    ) -> None:
        self.path = Path(path).absolute()
        self._on_failure = on_failure
        self.artifacts_dir = self.path.with_suffix(".artifacts")
        self._lock = threading.Lock()
        self._offset = 0
        self.failure: str | None = None
        """Why the spool stopped taking records (e.g. ``No space left on device``); None while it takes them."""
        self._fd: int | None = None
        try:
            self._fd = _create(self.path)
        except FileExistsError:
            raise
        except OSError as exc:
            self.failure = exc.strerror or str(exc)
            if on_failure is not None:
                on_failure(self.path, self.failure)
        self.lost: Counter[str] = Counter()
        """Records refused since the failure, by type (metrics records count their rows)."""
        self._artifacts = 0
        self.latest: set[str] = set()
        """The artifacts :meth:`artifact_latest` keeps, by their path inside the run."""
        self.records = 0
        self.header: dict[str, Any] = {
            "type": "header",
            "format": SPOOL_FORMAT,
            "version": SPOOL_VERSION,
            "tracking_uri": redact_uri(tracking_uri),
            "experiment": experiment,
            "run_name": run_name,
            "run_id": run_id,
            "start_time": int(start_time),
            "created": datetime.now(UTC).isoformat(),
            "artifacts": self.artifacts_dir.name,
        }
        self._write(self.header)
        self.records = 0

    @property
    def size(self) -> int:
        """Bytes written so far (the offset just past the last record)."""
        with self._lock:
            return self._offset

    def _write(self, record: Mapping[str, Any]) -> None:
        """Append one record whole, or not at all: a failed write is cut back, and the spool takes no more."""
        line = _json_line(record).encode("utf-8")
        with self._lock:
            if self.failure is not None or self._fd is None:
                self._count_lost(record)
                return
            try:
                written = 0
                while written < len(line):
                    written += os.write(self._fd, line[written:])
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, self._offset)  # no torn record: the file ends at the last whole one
                self.failure = exc.strerror or str(exc)
                self._count_lost(record)
                if self._on_failure is not None:
                    self._on_failure(self.path, self.failure)
                return
            self._offset += len(line)
            self.records += 1

    def _count_lost(self, record: Mapping[str, Any]) -> None:
        kind = str(record.get("type"))
        self.lost[kind] += len(record["metrics"]) if kind == "metrics" else 1

    def params(self, params: Mapping[str, Any]) -> None:
        """Spool run parameters (values as strings)."""
        if params:
            self._write({"type": "params", "params": {str(k): str(v) for k, v in params.items()}})

    def tags(self, tags: Mapping[str, Any]) -> None:
        """Spool run tags (values as strings)."""
        if tags:
            self._write({"type": "tags", "tags": {str(k): str(v) for k, v in tags.items()}})

    def metrics(self, metrics: list[MetricRow]) -> None:
        """Spool metrics with their values, timestamps and steps."""
        if metrics:
            rows = [[m.key, float(m.value), int(m.timestamp), int(m.step)] for m in metrics]
            self._write({"type": "metrics", "metrics": rows})

    def dataset(self, name: str, digest: str, source: str, profile: str, context: str) -> None:
        """Spool one dataset input of the run (its fields as :meth:`tracking.MlflowTracker.log_dataset` takes them)."""
        self._write(
            {
                "type": "dataset",
                "name": name,
                "digest": digest,
                "source": source,
                "profile": profile,
                "context": context,
            }
        )

    def status(self, status: str, end_time: int | None = None) -> None:
        """Spool the run's final status and end time (ms since the epoch; now when None)."""
        end = int(time.time() * 1000) if end_time is None else int(end_time)
        self._write({"type": "status", "status": status, "end_time": end})

    def artifact_bytes(self, data: bytes, artifact_file: str) -> None:
        """Keep ``data`` in the spool's artifact folder and spool a record placing it at ``artifact_file``."""
        folder, name = os.path.split(artifact_file.strip("/"))
        if not name:
            raise ValueError(f"artifact_file {artifact_file!r} names no file")
        local = self._copy(artifact_file, lambda local: local.write_bytes(data), name)
        if local is not None:
            self._artifact_record(local, folder or None)

    def artifact_latest(self, data: bytes, artifact_file: str) -> bool:
        """Keep ``data`` as the newest version of ``artifact_file``: one file in the spool's artifact folder, replaced
        whole (a new version is written beside it, then renamed over it), whose record is spooled the first time only;
        a replay uploads the version there then. False (the spool failed, the artifact counted lost) on an error."""
        folder, name = os.path.split(artifact_file.strip("/"))
        if not name or any(part in ("", ".", "..") for part in Path(artifact_file.strip("/")).parts):
            raise ValueError(f"artifact_file {artifact_file!r} names no file")
        with self._lock:
            known = artifact_file in self.latest
            local = self.artifacts_dir / "latest" / artifact_file.strip("/")
        if self.failure is not None:
            self.lost["artifact"] += 1
            return False
        try:
            local.parent.mkdir(parents=True, exist_ok=True)
            temporary = local.with_name(local.name + ".tmp")
            temporary.write_bytes(data)
            os.replace(temporary, local)
        except OSError as exc:
            self._artifact_failed(exc)
            return False
        if not known:
            with self._lock:
                self.latest.add(artifact_file)
            self._artifact_record(local, folder or None)
        return self.failure is None

    def artifact_path(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Copy a local file or folder into the spool's artifact folder and spool a record for it."""
        source = Path(path)

        def copy(local: Path) -> None:
            if source.is_dir():
                shutil.copytree(source, local)
            else:
                shutil.copyfile(source, local)

        local = self._copy(source.name, copy, source.name)
        if local is not None:
            self._artifact_record(local, artifact_path)

    def _copy(self, what: str, write: Callable[[Path], object], name: str) -> Path | None:
        """Write an artifact into a new slot; None (and the spool failed, the artifact counted lost) on an error."""
        if self.failure is not None:
            self.lost["artifact"] += 1
            return None
        try:
            local = self._new_slot() / name
            write(local)
        except OSError as exc:
            self._artifact_failed(exc)
            return None
        return local

    def _artifact_failed(self, error: OSError) -> None:
        """An artifact could not be kept: the spool takes nothing more, the artifact counts as lost, and it is told."""
        with self._lock:
            self.failure = error.strerror or str(error)
            self.lost["artifact"] += 1
        if self._on_failure is not None:
            self._on_failure(self.path, self.failure)

    def _new_slot(self) -> Path:
        with self._lock:
            self._artifacts += 1
            slot = self.artifacts_dir / str(self._artifacts)
        slot.mkdir(parents=True, exist_ok=True)
        return slot

    def _artifact_record(self, local: Path, artifact_path: str | None) -> None:
        relative = local.relative_to(self.path.parent).as_posix()
        self._write({"type": "artifact", "file": relative, "artifact_path": artifact_path})

    def close(self) -> None:
        """Close the file; idempotent."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _check_record(record: Any, where: str) -> dict[str, Any]:
    """Return ``record`` if it is a well-formed spool record, else raise :class:`SpoolError`."""
    if not isinstance(record, dict) or record.get("type") not in RECORD_TYPES:
        kind = record.get("type") if isinstance(record, dict) else type(record).__name__
        raise SpoolError(f"{where}: not a spool record (type {kind!r})")
    kind = record["type"]
    ok = True
    if kind in ("params", "tags"):
        entries = record.get(kind)
        ok = isinstance(entries, dict) and all(isinstance(v, str) for v in entries.values())
    elif kind == "metrics":
        rows = record.get("metrics")
        ok = isinstance(rows, list) and all(
            isinstance(r, list)
            and len(r) == 4
            and isinstance(r[0], str)
            and isinstance(r[1], int | float)
            and not isinstance(r[1], bool)
            and _int64(r[2])
            and _int64(r[3])
            for r in rows
        )
    elif kind == "artifact":
        file = record.get("file")
        ok = (
            isinstance(file, str)
            and isinstance(record.get("artifact_path"), str | None)
            and not Path(file).is_absolute()
            and ".." not in Path(file).parts
        )
    elif kind == "dataset":
        ok = all(isinstance(record.get(f), str) for f in ("name", "digest", "source", "profile", "context"))
    elif kind == "status":
        ok = record.get("status") in STATUSES and _int64(record.get("end_time"))
    if not ok:
        raise SpoolError(f"{where}: malformed {kind!r} record (a field is missing, of the wrong type or out of range)")
    return record


def dataset_input(name: str, digest: str, source: str, profile: str, context: str) -> Any:
    """Build MLflow's ``DatasetInput`` for a data set (``profile``: JSON text; ``context``: e.g. ``training``)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    dataset = Dataset(name=name, digest=digest, source_type="flasync", source=source, schema=None, profile=profile)
    return DatasetInput(dataset, tags=[InputTag("mlflow.data.context", context)])


def _int64(value: Any) -> bool:
    """Tell whether ``value`` is an integer a store keeps (64-bit): larger ones would block a replay for ever."""
    return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63


def read_header(path: str | Path) -> tuple[dict[str, Any], int]:
    """Read and check a spool's header; return it with the byte offset of the first record.

    Raises:
        SpoolError: The file is missing, unreadable, or does not start with a version-1 spool header.
    """
    spool = Path(path)
    try:
        with spool.open("rb") as file:
            line = file.readline()
    except OSError as exc:
        raise SpoolError(f"cannot read spool {spool}: {exc.strerror or exc}") from None
    try:
        header = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise SpoolError(f"{spool}: line 1 is not JSON; not a flasync tracking spool") from None
    if not isinstance(header, dict) or header.get("type") != "header" or header.get("format") != SPOOL_FORMAT:
        raise SpoolError(f"{spool}: line 1 is not a flasync tracking spool header")
    if header.get("version") != SPOOL_VERSION:
        version = header.get("version")
        raise SpoolError(f"{spool}: spool version {version!r} is not supported (expected {SPOOL_VERSION})")
    for key in ("tracking_uri", "experiment"):
        if not isinstance(header.get(key), str) or not header[key]:
            raise SpoolError(f"{spool}: header has no {key!r}")
    if not isinstance(header.get("start_time"), int):
        raise SpoolError(f"{spool}: header has no integer 'start_time'")
    return header, len(line)


def iter_records(path: str | Path, offset: int, first_line: int | None = None) -> Iterator[tuple[dict[str, Any], int]]:
    """Yield ``(record, end offset)`` for each complete record from byte ``offset`` on.

    ``first_line`` is the line number at ``offset`` (2 just after the header), for error messages.

    A last line without its newline (a write cut short by a crash) is not yielded.

    Raises:
        SpoolError: A line is not JSON or not a well-formed record (the message names the line).
    """
    spool = Path(path)
    try:
        file = spool.open("rb")
    except OSError as exc:
        raise SpoolError(f"cannot read spool {spool}: {exc.strerror or exc}") from None
    with file:
        file.seek(offset)
        position = offset
        number = 0
        for raw in file:
            number += 1
            if not raw.endswith(b"\n"):
                return
            position += len(raw)
            if not raw.strip():
                continue
            if first_line is None:
                where = f"{spool}: record {number} after byte {offset}"
            else:
                where = f"{spool}: line {first_line + number - 1}"
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise SpoolError(f"{where} is not JSON") from None
            yield _check_record(record, where), position


def _progress_path(path: str | Path) -> Path:
    spool = Path(path)
    return spool.with_name(spool.name + ".progress.json")


def load_progress(path: str | Path) -> dict[str, dict[str, Any]]:
    """Return the replay progress of a spool: per target tracking URI, ``run_id``, ``records`` and ``offset``."""
    try:
        data = json.loads(_progress_path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    targets = data.get("targets") if isinstance(data, dict) else None
    return {str(k): v for k, v in targets.items() if isinstance(v, dict)} if isinstance(targets, dict) else {}


def save_progress(path: str | Path, tracking_uri: str, *, run_id: str, records: int, offset: int) -> None:
    """Record (atomically) that ``records`` records, up to byte ``offset``, were replayed into ``run_id``."""
    targets = load_progress(path)
    targets[tracking_uri] = {"run_id": run_id, "records": records, "offset": offset}
    target = _progress_path(path)
    temporary = target.with_name(target.name + ".tmp")
    temporary.write_text(json.dumps({"version": SPOOL_VERSION, "targets": targets}, indent=1), encoding="utf-8")
    os.replace(temporary, target)


def _chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for begin in range(0, len(items), size):
        yield items[begin : begin + size]


def rejected(exc: BaseException) -> bool:
    """Tell whether the store refused a record for good (invalid value), rather than failed to answer."""
    code = getattr(exc, "error_code", None)
    return code in ("INVALID_PARAMETER_VALUE", "INVALID_STATE", "RESOURCE_ALREADY_EXISTS")


@dataclass
class Replayer:
    """Apply spool records to one run of a store, creating the run (and experiment) on first need.

    Args:
        client: An ``mlflow.MlflowClient`` of the target store.
        header: The spool's header record.
        spool_dir: The spool's folder (artifact records are relative to it).
        experiment_id: Returns the id of the named experiment, creating it when missing.
        run_id: The run to continue; None creates one at the first record.
    """

    client: Any
    header: Mapping[str, Any]
    spool_dir: Path
    experiment_id: Callable[[str], str]
    run_id: str | None = None
    counts: dict[str, int] = field(default_factory=dict)
    status: str | None = None

    def ensure_run(self) -> str:
        """Return the target run's id, creating the run from the header's experiment, name and start time."""
        if self.run_id is None:
            run = self.client.create_run(
                self.experiment_id(str(self.header["experiment"])),
                start_time=int(self.header["start_time"]),
                run_name=self.header.get("run_name"),
            )
            self.run_id = str(run.info.run_id)
        return self.run_id

    def apply(self, record: Mapping[str, Any]) -> None:
        """Send one record to the run; raises what the store raised."""
        from mlflow.entities import Metric, Param, RunTag

        run_id = self.ensure_run()
        kind = record["type"]
        client = self.client
        if kind == "params":
            params = [Param(k, v) for k, v in record["params"].items()]
            for chunk in _chunks(params, _MAX_ENTRIES_PER_CALL):
                client.log_batch(run_id, params=chunk, synchronous=True)
            self._count("params", len(params))
        elif kind == "tags":
            tags = [RunTag(k, v) for k, v in record["tags"].items()]
            for chunk in _chunks(tags, _MAX_ENTRIES_PER_CALL):
                client.log_batch(run_id, tags=chunk, synchronous=True)
            self._count("tags", len(tags))
        elif kind == "metrics":
            metrics = [Metric(k, float(v), int(t), int(s)) for k, v, t, s in record["metrics"]]
            for chunk in _chunks(metrics, _MAX_METRICS_PER_CALL):
                client.log_batch(run_id, metrics=chunk, synchronous=True)
            self._count("metrics", len(metrics))
        elif kind == "artifact":
            local = artifact_file(self.spool_dir, self.header, str(record["file"]))
            client.log_artifact(run_id, os.fspath(local), record["artifact_path"])
            self._count("artifacts", 1)
        elif kind == "dataset":
            client.log_inputs(
                run_id,
                datasets=[
                    dataset_input(
                        record["name"], record["digest"], record["source"], record["profile"], record["context"]
                    )
                ],
            )
            self._count("datasets", 1)
        else:
            client.set_terminated(run_id, record["status"], end_time=int(record["end_time"]))
            self.counts["status"] = 1
            self.status = str(record["status"])

    def _count(self, key: str, n: int) -> None:
        self.counts[key] = self.counts.get(key, 0) + n


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What :func:`replay` did."""

    tracking_uri: str
    run_id: str | None
    records: int
    """Records applied by this call."""
    already: int
    """Records skipped because an earlier replay into the same store applied them."""
    params: int
    tags: int
    metrics: int
    artifacts: int
    rejected: int
    """Records the store refused as invalid (skipped, with a warning)."""
    status: str | None
    """The run status set by this call, if the spool has one."""
    datasets: int = 0
    """Dataset inputs logged."""
    partial: bool = False
    """The run was live in another store before it spooled: the records logged there are not in the spool."""


def replay(
    path: str | Path,
    tracking_uri: str | None = None,
    *,
    on_rejected: Callable[[Mapping[str, Any], BaseException], None] | None = None,
) -> ReplayResult:
    """Replay a spool into a store, continuing an earlier replay into the same store.

    The run is the one an earlier replay (or the live run, when it recovered) wrote to; else the header's run id,
    when the target is the spool's own store and has that run; else a new run of the header's experiment. Progress
    is saved after each record, so rerunning after a failure neither loses nor repeats records.

    Args:
        path: The spool file.
        tracking_uri: The target store; the spool header's when None.
        on_rejected: Called for each record the store refuses as invalid (it is skipped).

    Returns:
        The counts.

    Raises:
        SpoolError: The spool cannot be read or is malformed (nothing is sent before the whole file was checked).
        mlflow.exceptions.MlflowException: The store failed; progress so far is kept.
    """
    import mlflow

    spool = Path(path).absolute()
    header, first, records = _checked_records(spool)
    uri = absolute_tracking_uri(tracking_uri or str(header["tracking_uri"]))
    done = load_progress(spool).get(uri, {})
    skip = int(done.get("records", 0)) if isinstance(done.get("records"), int) else 0
    run_id = done.get("run_id") if isinstance(done.get("run_id"), str) else None
    db = sqlite_path(uri)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
    with bounded_http(uri):
        client = mlflow.MlflowClient(tracking_uri=uri)
        if run_id is None:
            run_id = _spooled_run(client, header, uri)
        replayer = Replayer(client, header, spool.parent, _experiment_ids(client, uri), run_id)
        applied, refused = _apply_records(replayer, records, skip, spool, uri, on_rejected)
        if not records and replayer.run_id is None:
            replayer.ensure_run()
            save_progress(spool, uri, run_id=replayer.ensure_run(), records=0, offset=first)
    counts = replayer.counts
    original = header.get("run_id")
    return ReplayResult(
        tracking_uri=uri,
        run_id=replayer.run_id,
        records=applied,
        already=min(skip, len(records)),
        params=counts.get("params", 0),
        tags=counts.get("tags", 0),
        metrics=counts.get("metrics", 0),
        artifacts=counts.get("artifacts", 0),
        datasets=counts.get("datasets", 0),
        rejected=refused,
        status=replayer.status,
        partial=bool(original) and replayer.run_id != original,
    )


def _checked_records(spool: Path) -> tuple[dict[str, Any], int, list[tuple[dict[str, Any], int]]]:
    """Return the spool's header, where its records start, and every record with its end offset, all checked
    (artifact files inside the spool's own folder) before anything is sent.

    Raises:
        SpoolError: The spool cannot be read or is malformed.
    """
    header, first = read_header(spool)
    records = list(iter_records(spool, first, first_line=2))  # validate everything before sending anything
    for record, _ in records:
        if record["type"] == "artifact":
            try:
                artifact_file(spool.parent, header, str(record["file"]), must_exist=False)
            except SpoolError as exc:
                raise SpoolError(f"{spool}: {exc}") from None
    return header, first, records


def artifact_file(spool_dir: Path, header: Mapping[str, Any], file: str, *, must_exist: bool = True) -> Path:
    """Return the path of an artifact file a spool's record names, once it is known to be a regular file inside the
    spool's own artifacts folder, reached without a symbolic link.

    The folder is the one the header names, a plain name ending in ``.artifacts`` beside the spool; no part of the
    way from it to the file may be a link, so a crafted header or a link planted in the folder cannot make a replay
    upload a file from elsewhere.

    Args:
        spool_dir: The spool's folder (the record's ``file`` is relative to it).
        header: The spool's header.
        file: The record's ``file``.
        must_exist: Also require the file to be there now (False: check only the names and the links there are).

    Raises:
        SpoolError: The folder or the file is not the spool's own, goes through a link, or is not a regular file.
    """
    folder = str(header.get("artifacts", ""))
    if not folder.endswith(".artifacts") or Path(folder).name != folder:
        raise SpoolError(f"the header's artifacts folder {folder!r} is not a folder name beside the spool")
    parts = Path(file).parts
    if len(parts) < 2 or parts[0] != folder or any(part in ("", ".", "..") for part in parts):
        raise SpoolError(f"artifact file {file!r} is outside the spool's own folder {folder}")
    path = spool_dir
    for k, part in enumerate(parts):
        path = path / part
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            if must_exist:
                raise SpoolError(f"artifact file {spool_dir / file} named by the spool is missing") from None
            return spool_dir / file
        except OSError as exc:
            raise SpoolError(f"cannot read artifact file {spool_dir / file}: {exc.strerror or exc}") from None
        last = k == len(parts) - 1
        if stat.S_ISLNK(mode) or not (stat.S_ISDIR(mode) or (last and stat.S_ISREG(mode))):
            kind = "a link" if stat.S_ISLNK(mode) else "not a regular file" if last else "not a folder"
            raise SpoolError(f"artifact file {file!r} is refused: {path.name} is {kind}")
    if stat.S_ISDIR(mode):  # a folder artifact: everything in it, too
        _check_tree(path, file)
    return path


def _check_tree(folder: Path, file: str) -> None:
    """Refuse a folder artifact holding anything but folders and regular files (a link, a device, a pipe)."""
    for root, dirs, files in os.walk(folder):
        for name in (*dirs, *files):
            mode = (Path(root) / name).lstat().st_mode
            if stat.S_ISLNK(mode) or not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                kind = "a link" if stat.S_ISLNK(mode) else "not a regular file"
                raise SpoolError(f"artifact folder {file!r} is refused: {name} in it is {kind}")


def _spooled_run(client: Any, header: Mapping[str, Any], uri: str) -> str | None:
    """Return the header's run id when the target ``uri`` is the spool's own store and that run is active there."""
    if header.get("run_id") and uri == absolute_tracking_uri(str(header["tracking_uri"])):
        with contextlib.suppress(Exception):
            if client.get_run(str(header["run_id"])).info.lifecycle_stage == "active":
                return str(header["run_id"])
    return None


def _experiment_ids(client: Any, uri: str) -> Callable[[str], str]:
    """Return a function giving the id of a named experiment of the store ``uri``, creating it when missing."""

    def experiment_id(name: str) -> str:
        try:
            return ensure_experiment(client, name, artifact_location(uri, name))
        except ExperimentDeletedError:
            raise SpoolError(
                f"experiment {name!r} is deleted in {uri}; restore it or replay into another store"
            ) from None

    return experiment_id


def _apply_records(
    replayer: Replayer,
    records: list[tuple[dict[str, Any], int]],
    skip: int,
    spool: Path,
    uri: str,
    on_rejected: Callable[[Mapping[str, Any], BaseException], None] | None,
) -> tuple[int, int]:
    """Apply the records after the first ``skip``, saving progress after each; return how many were applied and
    how many of those the store refused as invalid."""
    applied = refused = 0
    for index, (record, end) in enumerate(records):
        if index < skip:
            continue
        try:
            replayer.apply(record)
        except SpoolError:
            raise
        except Exception as exc:
            if not rejected(exc):
                raise
            refused += 1
            if on_rejected is not None:
                on_rejected(record, exc)
        applied += 1
        save_progress(spool, uri, run_id=replayer.ensure_run(), records=index + 1, offset=end)
    return applied, refused
