"""Checkpoints: the whole state of a run, written as an MLflow artifact, read back to resume it exactly.

A checkpoint holds the version and the global weights, then one entry per component, each its own
``state_dict()``: the aggregator (buffer, server optimizer), the sampler (random generator), the task registry
(the tasks in flight as :class:`~flasync.core.events.TaskAssigned` records, the models they started from, the clients'
participation counters), the accounting (counters), the intake (validation history), the policy (an open round,
the edges), the clock's reading and the error-feedback residuals; and the resolved config. It is one file written
with ``torch.save`` of plain values and tensors only, and read with ``torch.load(..., weights_only=True)``: no
pickled objects, so loading one runs no code.

A running federation hands its checkpoints to a :class:`CheckpointWriter`, which writes them on a thread of its own.

Under the virtual clock a resumed run ends with the same ``weights_sha256`` as an uninterrupted one: tasks in flight
are started again on their original timelines, and each of their random draws is keyed by client and participation.
"""

from __future__ import annotations

import hashlib
import io
import math
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import yaml

from flasync import tracking
from flasync._version import __version__
from flasync.config import RunConfig, validate
from flasync.core.errors import CheckpointError, ConfigError
from flasync.runtime.tracked import redacted
from flasync.server.registry import participation_counters
from flasync.tracking.mlflow_run import yaml_text
from flasync.tracking.store import sqlite_path

__all__ = [
    "CHECKPOINT_FOLDER",
    "CHECKPOINT_SLOTS",
    "FORMAT",
    "CheckpointWriter",
    "Fetched",
    "ResumePoint",
    "check_state",
    "decode",
    "encode",
    "fetch",
    "latest",
    "newest",
]

CHECKPOINT_FOLDER = "checkpoints"
CHECKPOINT_SLOTS = ("checkpoints/a.pt", "checkpoints/b.pt")
"""The two MLflow artifacts a run's checkpoints alternate between.

A store writes an artifact in place (a local store truncates the file, then copies), so a process killed while a
checkpoint is uploaded would leave no whole checkpoint if there were one file. With two, the one not being written
always holds the previous checkpoint; :func:`fetch` resumes from the newest that reads back whole.
"""
FORMAT = 4
"""Version of the checkpoint layout; a reader refuses others (4: one sha256 over the format, the flasync version, the
config and the state's bytes; 3, still read: over the state's bytes only)."""

_READS = (3, FORMAT)

MAX_COUNT = 2**53
"""Largest count a checkpoint may hold (updates, bytes, tasks): beyond it a float cannot say it exactly, and no run
comes near it."""


def _digest(fmt: int, version: str, config: str, state_bytes: bytes) -> str:
    """Return the sha256 a checkpoint of ``fmt`` carries: over its state's bytes (3), or over every field (4)."""
    digest = hashlib.sha256()
    if fmt >= 4:
        for field in (str(fmt), version, config):
            encoded = field.encode()
            digest.update(len(encoded).to_bytes(8, "big") + encoded)
    digest.update(state_bytes)
    return digest.hexdigest()


def encode(state: dict[str, Any], config: RunConfig) -> bytes:
    """Serialise a server state (see :meth:`flasync.server.Server.state_dict`) and the run's config.

    The state is saved on its own, and one sha256 covers the format, the flasync version, the config's text and the
    state's bytes, so a reader detects a change to any of them (a learning rate edited in the config as well as a
    flipped bit of the weights).
    """
    inner = io.BytesIO()
    torch.save(state, inner)
    state_bytes = inner.getvalue()
    config_text = yaml_text(config.model_dump(mode="json"))
    outer = io.BytesIO()
    torch.save(
        {
            "format": FORMAT,
            "flasync": __version__,
            "config": config_text,
            "state_sha256": _digest(FORMAT, __version__, config_text, state_bytes),
            "state": torch.frombuffer(bytearray(state_bytes), dtype=torch.uint8),
        },
        outer,
    )
    return outer.getvalue()


def decode(data: bytes) -> tuple[RunConfig, dict[str, Any]]:
    """Read :func:`encode`'s bytes back (``weights_only=True``: no code runs) into the config and a checked state.

    Raises:
        CheckpointError: One line naming what is wrong: not a checkpoint, another format, a checksum that does not
            match (a changed or truncated file), an invalid config, or a state field missing or out of range.
    """
    loaded = _load(data, "not a readable checkpoint")
    if not isinstance(loaded, dict) or "format" not in loaded or "state" not in loaded:
        raise CheckpointError("not a flasync checkpoint (no format/state entries)")
    fmt = loaded["format"]
    if isinstance(fmt, bool) or fmt not in _READS:
        raise CheckpointError(f"checkpoint format {fmt!r} is not supported (this flasync reads {_READS})")
    config_text, version = loaded.get("config"), loaded.get("flasync")
    if not isinstance(config_text, str) or not isinstance(version, str):
        raise CheckpointError("the checkpoint's config or flasync version is not text")
    packed = loaded["state"]
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 1:
        raise CheckpointError("the checkpoint's state is not a byte string")
    state_bytes = packed.numpy().tobytes()
    if _digest(fmt, version, config_text, state_bytes) != loaded.get("state_sha256"):
        covered = f"{len(state_bytes)} state bytes" if fmt < 4 else f"config and {len(state_bytes)} state bytes"
        raise CheckpointError(
            f"the checkpoint is corrupt: the sha256 of its {covered} does not match the one it was written with"
        )
    try:
        config = validate(yaml.safe_load(config_text))
    except (ConfigError, yaml.YAMLError) as exc:
        raise CheckpointError(f"the checkpoint's config is invalid: {str(exc).splitlines()[0]}") from None
    state = _load(state_bytes, "the checkpoint's state is not readable")
    if not isinstance(state, dict):
        raise CheckpointError("the checkpoint's state is not a mapping")
    check_state(state)
    _check_client_table(state["accounting"].get("clients"), config)
    if state["version"] > config.stop.max_versions:
        raise CheckpointError(
            f"checkpoint field version: {state['version']} is past the run's stop.max_versions "
            f"{config.stop.max_versions}"
        )
    return config, state


def _load(data: bytes, what: str) -> Any:
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:  # torch raises several types for corrupt or foreign files
        raise CheckpointError(
            f"{what} ({type(exc).__name__}): only files of tensors and plain values that flasync wrote are loaded, "
            "with weights_only=True"
        ) from None


def check_state(state: dict[str, Any]) -> None:
    """Check every field a resumed run reads from a server state: presence, type and range.

    Raises:
        CheckpointError: One line naming the first field that is missing or wrong.
    """
    version = _int(state, "version", low=0, high=MAX_COUNT)
    weights = _tensor(state, "weights", dims=1, floating=True)
    if not bool(torch.isfinite(weights).all()):
        raise CheckpointError("checkpoint field weights: holds NaN or Inf")
    for name in ("aggregator", "accounting", "sampler", "registry", "intake", "policy", "clock"):
        _mapping(state, name)
    if state["aggregator"].get("kind") not in ("buffered", "robust", "mixing", "custom"):
        raise CheckpointError(f"checkpoint field aggregator.kind: unknown kind {state['aggregator'].get('kind')!r}")
    accounting = state["accounting"]
    stats = _mapping(accounting, "stats", "accounting.")
    for key, value in stats.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue  # names and reasons (the stop reason, the refusals' counter)
        if isinstance(value, float) and math.isnan(value):
            continue  # not measured yet (accuracy before the first evaluation)
        low = -1 if key == "evaluated_version" else 0  # -1: nothing evaluated yet
        if not low <= value <= MAX_COUNT:
            raise CheckpointError(
                f"checkpoint field accounting.stats.{key}: must be in [{low}, {MAX_COUNT}], got {value}"
            )
    _int(accounting, "failure_streak", low=0, high=MAX_COUNT, where="accounting.")
    sampler_rng = state["sampler"].get("rng")
    if not isinstance(sampler_rng, str):
        raise CheckpointError("checkpoint field sampler.rng: missing or not a JSON string")
    clock_now = state["clock"].get("now")
    if not isinstance(clock_now, int | float) or not math.isfinite(clock_now) or clock_now < 0:
        raise CheckpointError(f"checkpoint field clock.now: must be a finite number >= 0, got {clock_now!r}")
    registry = state["registry"]
    num_clients, clients, counts = participation_counters(registry)
    if num_clients < 1 or num_clients > MAX_COUNT:
        raise CheckpointError(f"checkpoint field registry.num_clients: must be in [1, {MAX_COUNT}], got {num_clients}")
    if counts.numel() and (int(counts.min()) < 0 or int(counts.max()) > MAX_COUNT):
        raise CheckpointError(f"checkpoint field registry.participation_counts: must be in [0, {MAX_COUNT}]")
    if clients.numel() and (int(clients.min()) < 0 or int(clients.max()) >= num_clients):
        raise CheckpointError(f"checkpoint field registry.participation_clients: ids must be in [0, {num_clients - 1}]")
    bases = registry.get("bases")
    if not isinstance(bases, list) or not bases:
        raise CheckpointError("checkpoint field registry.bases: missing or empty")
    versions = set()
    for index, base in enumerate(bases):
        where = f"registry.bases[{index}]."
        if not isinstance(base, dict):
            raise CheckpointError(f"checkpoint field {where[:-1]}: not a mapping")
        versions.add(_int(base, "version", low=0, high=version, where=where))
        for key in ("weights", "exact"):
            if _tensor(base, key, dims=1, floating=True, where=where).shape != weights.shape:
                raise CheckpointError(f"checkpoint field {where}{key}: shape differs from the weights'")
        _int(base, "download_bytes", low=0, where=where)
    if _int(registry, "snapshot_version", low=0, high=version, where="registry.") not in versions:
        raise CheckpointError("checkpoint field registry.snapshot_version: no such base model")
    in_flight = registry.get("in_flight")
    if not isinstance(in_flight, list):
        raise CheckpointError("checkpoint field registry.in_flight: missing or not a list")
    for index, task in enumerate(in_flight):
        where = f"registry.in_flight[{index}]."
        if not isinstance(task, dict):
            raise CheckpointError(f"checkpoint field {where[:-1]}: not a mapping")
        _int(task, "task_id", low=0, where=where)
        _int(task, "client_id", low=0, high=num_clients - 1, where=where)
        _int(task, "participation", low=0, where=where)
        if _int(task, "base_version", low=0, high=version, where=where) not in versions:
            raise CheckpointError(f"checkpoint field {where}base_version: no such base model")
        started = task.get("simulated_s")
        if not isinstance(started, int | float) or not math.isfinite(started) or started < 0:
            raise CheckpointError(f"checkpoint field {where}simulated_s: must be a finite number >= 0")
    _check_selection(state, weights)
    norms = state["intake"].get("validator_norms")
    if not isinstance(norms, list) or not all(isinstance(n, int | float) for n in norms):
        raise CheckpointError("checkpoint field intake.validator_norms: must be a list of numbers")


def _check_client_table(table: object, config: RunConfig) -> None:
    """Check the per-client table a checkpoint holds (``tracking.client_table``): at most the config's rows, each a
    mapping of its counts; a table the config does not keep is refused."""
    if table is None:
        return
    where = "checkpoint field accounting.clients"
    if not config.tracking.client_table:
        raise CheckpointError(f"{where}: present, but the run's tracking.client_table is off")
    if not isinstance(table, dict) or not isinstance(table.get("rows"), list):
        raise CheckpointError(f"{where}: not a mapping with a list of rows")
    rows = table["rows"]
    if len(rows) > config.tracking.client_table_rows:
        raise CheckpointError(
            f"{where}.rows: {len(rows)} rows, more than tracking.client_table_rows {config.tracking.client_table_rows}"
        )
    heavy, most = table.get("heavy", []), 4 * config.tracking.client_table_top
    if not isinstance(heavy, list) or len(heavy) > most:
        raise CheckpointError(f"{where}.heavy: not a list of at most {most} counters")
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise CheckpointError(f"{where}.rows[{index}]: not a mapping")
        for key in ("client_id", "tasks", "accepted", "refused", "failed", "timed_out", "staleness_sum"):
            _int(row, key, low=0, where=f"accounting.clients.rows[{index}].")


def _check_selection(state: dict[str, Any], weights: torch.Tensor) -> None:
    """Check the best version a checkpoint holds (``eval.select``), when it holds one."""
    selection = state.get("selection")
    if selection is None or selection == {}:
        return
    if not isinstance(selection, dict):
        raise CheckpointError("checkpoint field selection: not a mapping")
    pending = selection.get("pending", {})
    if not isinstance(pending, dict):
        raise CheckpointError("checkpoint field selection.pending: not a mapping")
    for version in pending:
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= int(state["version"]):
            raise CheckpointError(f"checkpoint field selection.pending: version {version!r} out of range")
        kept = pending[version]
        if not isinstance(kept, torch.Tensor) or not kept.is_floating_point() or kept.shape != weights.shape:
            raise CheckpointError(f"checkpoint field selection.pending.{version}: not weights of the model's shape")
    if "version" not in selection:
        return
    _int(selection, "version", low=0, high=int(state["version"]), where="selection.")
    if _tensor(selection, "weights", dims=1, floating=True, where="selection.").shape != weights.shape:
        raise CheckpointError("checkpoint field selection.weights: shape differs from the weights'")
    value = selection.get("value")
    if isinstance(value, bool) or not isinstance(value, float) or not math.isfinite(value):
        raise CheckpointError(f"checkpoint field selection.value: must be a finite number, got {value!r}")
    if not isinstance(selection.get("metric"), str) or selection.get("direction") not in ("max", "min"):
        raise CheckpointError("checkpoint field selection: metric or direction missing")


def check_fits(state: dict[str, Any], *, num_params: int, num_clients: int) -> None:
    """Check that a checkpoint's state fits the run it resumes: its weights are the model's length and its clients'
    counters the population's size (checked before the MLflow run is touched, so a misfit leaves its status as it was).

    Raises:
        CheckpointError: One line naming the field that does not fit.
    """
    weights = state["weights"].numel()
    if weights != num_params:
        raise CheckpointError(f"checkpoint field weights: {weights} parameters, but the run's model has {num_params}")
    clients, _, _ = participation_counters(state["registry"])
    if clients != num_clients:
        raise CheckpointError(
            f"checkpoint field registry.num_clients: {clients} clients, but the run's population has {num_clients}"
        )


def _mapping(state: dict[str, Any], key: str, where: str = "") -> dict[str, Any]:
    value = state.get(key)
    if not isinstance(value, dict):
        raise CheckpointError(f"checkpoint field {where}{key}: missing or not a mapping")
    return value


def _int(state: dict[str, Any], key: str, *, low: int, high: int | None = None, where: str = "") -> int:
    value = state.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(f"checkpoint field {where}{key}: must be an integer, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise CheckpointError(f"checkpoint field {where}{key}: must be {bound}, got {value}")
    return value


def _tensor(state: dict[str, Any], key: str, *, dims: int, floating: bool = False, where: str = "") -> torch.Tensor:
    value = state.get(key)
    if not isinstance(value, torch.Tensor) or value.dim() != dims or (floating and not value.is_floating_point()):
        kind = "floating-point " if floating else ""
        raise CheckpointError(f"checkpoint field {where}{key}: must be a {dims}-D {kind}tensor")
    return value


class Fetched(NamedTuple):
    """A run's newest checkpoint, as :func:`fetch` found it."""

    config: RunConfig
    state: dict[str, Any]
    status: str
    """The MLflow run's status, e.g. ``"KILLED"``."""
    tags: dict[str, str]
    """The MLflow run's tags."""
    artifact: str
    """The artifact it was read from (one of :data:`CHECKPOINT_SLOTS`, or an older run's ``checkpoints/latest.pt``)."""


def fetch(run_id: str, tracking_uri: str) -> Fetched:
    """Download every checkpoint of an MLflow run and decode the newest that reads back whole.

    Returns:
        The run's config, the server state, the run's status, its tags and the artifact read.

    Raises:
        CheckpointError: If the run does not exist, has no checkpoint, or it cannot be read.
    """
    import mlflow
    from mlflow.exceptions import MlflowException

    db = sqlite_path(tracking_uri)
    if db is not None and not db.is_file():  # do not let MLflow create an empty store just to find no run in it
        raise CheckpointError(f"no MLflow run {run_id!r}: there is no store at {tracking_uri}")
    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise CheckpointError(f"no MLflow run {run_id!r} in {tracking_uri}") from None
    files: list[tuple[str, bytes]] = []
    with tempfile.TemporaryDirectory(prefix="flasync-resume-") as tmp:
        try:
            names = [a.path for a in client.list_artifacts(run_id, CHECKPOINT_FOLDER) if a.path.endswith(".pt")]
            for name in sorted(names):
                files.append((name, Path(client.download_artifacts(run_id, name, tmp)).read_bytes()))
        except (MlflowException, OSError):
            files = []
    if not files:
        raise CheckpointError(f"MLflow run {run_id} has no checkpoint ({CHECKPOINT_FOLDER}/*.pt)")
    artifact, config, state = newest(files)
    return Fetched(config, state, str(run.info.status), dict(run.data.tags), artifact)


def newest(files: Iterable[tuple[str, bytes]]) -> tuple[str, RunConfig, dict[str, Any]]:
    """Decode checkpoint files and return the one of the highest version that reads back whole.

    Args:
        files: ``(name, bytes)`` of each candidate (e.g. both slots of :data:`CHECKPOINT_SLOTS`).

    Returns:
        The chosen file's name, config and state.

    Raises:
        CheckpointError: If there is no file, or none decodes (the error of the first one that failed).
    """
    best: tuple[str, RunConfig, dict[str, Any]] | None = None
    first_error: CheckpointError | None = None
    for name, data in files:
        try:
            config, state = decode(data)
        except CheckpointError as exc:
            first_error = first_error or exc
            continue
        if best is None or int(state["version"]) > int(best[2]["version"]):
            best = (name, config, state)
    if best is not None:
        return best
    if first_error is not None:
        raise first_error
    raise CheckpointError("no checkpoint")


def latest(artifacts: Mapping[str, bytes]) -> bytes:
    """Return the bytes of the newest whole checkpoint among a run's artifacts (``{path: bytes}``).

    Raises:
        CheckpointError: If there is none, or none decodes.
    """
    files = [(k, v) for k, v in artifacts.items() if k.startswith(f"{CHECKPOINT_FOLDER}/") and k.endswith(".pt")]
    name, _, _ = newest(files)
    return artifacts[name]


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where a resumed run starts: the MLflow run to continue (None: a new one) and a decoded server state."""

    run_id: str | None
    state: dict[str, Any]
    artifact: str | None = None
    """The artifact the state was read from: the resumed run writes its first checkpoint to the other slot."""


class CheckpointWriter:
    """Write checkpoints on one background thread: the newest one, and only after the metrics it covers.

    A checkpoint taken while an earlier one still waits replaces it (the earlier one would be older than this one
    by the time it was written), so a slow store costs one write of lag, never a growing queue. Before a checkpoint
    is written the tracker's queued metrics are flushed: a checkpoint of version ``v`` reaches the store only after
    every metric logged up to ``v`` has, so a run resumed from it misses no step (and the resumed tracker drops the
    steps the store already holds, see :meth:`tracking.MlflowTracker.resume`). A flush that times out skips that
    checkpoint with a warning and the next one tries again; failures are logged, never raised.

    Checkpoints alternate between the two artifacts of :data:`CHECKPOINT_SLOTS` (a slot is reused only after a
    write to the other succeeded), so a process killed mid-upload still leaves the previous one whole; a resumed run
    starts with the slot it was not resumed from.
    """

    def __init__(
        self,
        tracker: tracking.Tracker,
        config: RunConfig,
        log: Any,
        wall: Callable[[], float] = time.perf_counter,
        *,
        resumed_from: str | None = None,
    ) -> None:
        self._wall = wall
        self._tracker = tracker
        self._config = config
        self._log = log
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._waiting: tuple[dict[str, Any], float] | None = None
        self._draining: Future[None] | None = None
        self.superseded = 0
        """Checkpoints replaced by a newer one before they were written."""
        self.last_saved: str | None = None
        """The artifact holding the newest checkpoint in the store."""
        self._slot = 1 if resumed_from == CHECKPOINT_SLOTS[0] else 0
        """Index in :data:`CHECKPOINT_SLOTS` of the slot the next checkpoint goes to."""

    def submit(self, state: dict[str, Any]) -> None:
        """Hand ``state`` over for writing (returns at once: the event loop must not wait)."""
        if isinstance(self._tracker, tracking.NullTracker):
            return
        with self._lock:
            if self._waiting is not None:
                self.superseded += 1
            self._waiting = (state, self._wall())
            if self._draining is None or self._draining.done():
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flasync-checkpoint")
                self._draining = self._pool.submit(self._drain)

    def _drain(self) -> None:
        while True:
            with self._lock:
                waiting, self._waiting = self._waiting, None
            if waiting is None:
                return
            self._write(*waiting)

    def _write(self, state: dict[str, Any], taken: float) -> None:
        start = self._wall()
        version = int(state["version"])
        tracker = self._tracker
        journaling = tracker if isinstance(tracker, tracking.MlflowTracker) else None
        try:
            data = encode(state, redacted(self._config))
            # The other slot keeps the previous checkpoint whole while this one is written (and if this fails).
            slot = CHECKPOINT_SLOTS[self._slot]
            # While the MLflow run is being opened, the run's journal keeps it, after the metrics it covers.
            journaled = journaling is not None and journaling.journal.keep(data, slot)
            if not journaled:
                if not tracker.flush():
                    self._log.warning(
                        "checkpoint.skipped",
                        version=version,
                        reason="the metrics it covers are not all written yet",
                        metrics=False,
                    )
                    return
                tracker.log_bytes(data, slot)
                if journaling is not None:
                    journaling.journal.retire()  # the store holds all the journal kept
        except Exception as exc:  # a failing store must not take the run down
            self._log.warning("checkpoint.failed", version=version, error=f"{type(exc).__name__}: {exc}", metrics=False)
            return
        self.last_saved = slot
        self._slot = 1 - self._slot
        self._log.debug(
            "checkpoint",
            step=version,
            bytes=len(data),
            seconds=self._wall() - start,
            lag_s=self._wall() - taken,
            superseded=self.superseded,
            in_flight=len(state["registry"]["in_flight"]),
            journal=journaled,
        )

    def close(self) -> None:
        """Wait until the newest checkpoint handed over was written."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
