"""Events on the bus: frozen, slotted, keyword-only dataclasses naming facts in the past tense.

Tensors never travel in events; the one event that carries an update carries the encoded bytes a client uploaded
(``UpdateUploaded.payload``), exactly what would cross a network.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NewType

__all__ = [
    "Aggregated",
    "ClientFailed",
    "ClientId",
    "Evaluated",
    "ModelPublished",
    "RunFinished",
    "TaskAssigned",
    "UpdateReceived",
    "UpdateRejected",
    "UpdateUploaded",
    "Version",
]

ClientId = NewType("ClientId", int)
Version = NewType("Version", int)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelPublished:
    """The server made global model ``version`` available for download."""

    version: Version
    simulated_s: float
    download_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskAssigned:
    """Client ``client_id`` was given task ``task_id`` (its ``participation``-th, from 0) on model ``base_version``."""

    task_id: int
    client_id: ClientId
    participation: int
    base_version: Version
    simulated_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateUploaded:
    """A client finished its upload; ``payload`` holds the encoded delta ``w_base - w_local``."""

    task_id: int
    client_id: ClientId
    base_version: Version
    num_samples: int
    payload: bytes = field(repr=False)
    train_loss: float
    simulated_s: float
    sent_wall_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateReceived:
    """The server accepted an update into aggregation."""

    task_id: int
    client_id: ClientId
    base_version: Version
    version: Version
    staleness: int
    upload_bytes: int
    simulated_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateRejected:
    """The server refused an update (``reason``: ``stale``, ``decode``, ``non_finite``, ``unknown_version``,
    ``unexpected``: no such task in flight)."""

    task_id: int
    client_id: ClientId
    base_version: Version
    reason: str
    detail: str
    simulated_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientFailed:
    """A client task ended with an error instead of an update."""

    task_id: int
    client_id: ClientId
    base_version: Version
    error: str
    simulated_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Aggregated:
    """The server folded ``num_updates`` updates into the model, producing ``version``."""

    version: Version
    num_updates: int
    mean_staleness: float
    aggregate_s: float
    simulated_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Evaluated:
    """The server evaluated ``version`` on the held-out split."""

    version: Version
    accuracy: float
    loss: float
    simulated_s: float
    wall_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RunFinished:
    """The run stopped (``reason``: ``max_versions``, ``target_accuracy``, ``max_simulated_s``, ``max_wall_s``)."""

    reason: str
    versions: int
    updates_accepted: int
    simulated_s: float
    wall_s: float
