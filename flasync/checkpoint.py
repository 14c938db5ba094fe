"""Checkpoints: the whole state of a run, written as an MLflow artifact, read back to resume it exactly.

A checkpoint holds the version and the global weights, then one entry per component, each its own
``state_dict()``: the aggregator (buffer, server optimizer), the sampler (random generator), the task registry
(the tasks in flight as :class:`~flasync.events.TaskAssigned` records, the models they started from, the clients'
participation counters), the accounting (counters), the intake (validation history), the policy (an open round,
the edges), the clock's reading and the error-feedback residuals; and the resolved config. It is one file written
with ``torch.save`` of plain values and tensors only, and read with ``torch.load(..., weights_only=True)``: no
pickled objects, so loading one runs no code.

Under the virtual clock a resumed run ends with the same ``weights_sha256`` as an uninterrupted one: tasks in flight
are started again on their original timelines, and each of their random draws is keyed by client and participation.
"""

from __future__ import annotations

import io
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from flasync._version import __version__
from flasync.config import RunConfig, validate
from flasync.errors import CheckpointError, ConfigError
from tracking.store import sqlite_path

__all__ = ["CHECKPOINT_ARTIFACT", "FORMAT", "ResumePoint", "decode", "encode", "fetch"]

CHECKPOINT_ARTIFACT = "checkpoints/latest.pt"
"""Where a run's latest checkpoint lives among its MLflow artifacts."""
FORMAT = 2
"""Version of the checkpoint layout; a reader refuses others (2: one entry per component's ``state_dict()``)."""


def encode(state: dict[str, Any], config: RunConfig) -> bytes:
    """Serialise a server state (see :meth:`flasync.server.Server.state_dict`) and the run's config."""
    buffer = io.BytesIO()
    torch.save(
        {
            "format": FORMAT,
            "flasync": __version__,
            "config": yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False),
            "state": state,
        },
        buffer,
    )
    return buffer.getvalue()


def decode(data: bytes) -> tuple[RunConfig, dict[str, Any]]:
    """Read :func:`encode`'s bytes back (``weights_only=True``: no code runs) into the config and the state.

    Raises:
        CheckpointError: If the bytes are not a checkpoint of this format.
    """
    try:
        loaded = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:  # torch raises several types for corrupt or foreign files
        raise CheckpointError(
            f"not a readable checkpoint ({type(exc).__name__}): only files of tensors and plain values that "
            "flasync wrote are loaded, with weights_only=True"
        ) from None
    if not isinstance(loaded, dict) or "format" not in loaded or "state" not in loaded:
        raise CheckpointError("not a flasync checkpoint (no format/state entries)")
    if loaded["format"] != FORMAT:
        raise CheckpointError(f"checkpoint format {loaded['format']!r} is not supported (this flasync reads {FORMAT})")
    try:
        config = validate(yaml.safe_load(loaded["config"]))
    except ConfigError as exc:
        raise CheckpointError(f"the checkpoint's config is invalid: {exc}") from None
    state = loaded["state"]
    if not isinstance(state, dict):
        raise CheckpointError("the checkpoint's state is not a mapping")
    return config, state


def fetch(run_id: str, tracking_uri: str) -> tuple[RunConfig, dict[str, Any], str]:
    """Download and decode the latest checkpoint of an MLflow run.

    Returns:
        The run's config, the server state, and the run's status (e.g. ``"KILLED"``).

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
    with tempfile.TemporaryDirectory(prefix="flasync-resume-") as tmp:
        try:
            local = client.download_artifacts(run_id, CHECKPOINT_ARTIFACT, tmp)
        except (MlflowException, OSError):
            raise CheckpointError(f"MLflow run {run_id} has no checkpoint ({CHECKPOINT_ARTIFACT})") from None
        data = Path(local).read_bytes()
    config, state = decode(data)
    return config, state, str(run.info.status)


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where a resumed run starts: the MLflow run to continue (None: a new one) and a decoded server state."""

    run_id: str | None
    state: dict[str, Any]
