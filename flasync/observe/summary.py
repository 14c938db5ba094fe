"""What a run achieved and cost: the summary built from the server's counters, and its JSON form."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from flasync import codecs
from flasync.server import ServerStats

__all__ = ["RunSummary", "json_ready", "weights_sha256"]


def weights_sha256(weights: torch.Tensor) -> str:
    """Return the sha256 of a flat vector's little-endian float32 bytes."""
    array = weights.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4", copy=False)
    return hashlib.sha256(array.tobytes()).hexdigest()


def json_ready(value: Any) -> Any:
    """Return ``value`` as strict JSON data: non-finite floats become None, tuples lists, keys strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(v) for v in value]
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSummary:
    """What a run achieved and cost; also written as ``summary.json``."""

    run_id: str | None
    accuracy: float
    loss: float
    updates_accepted: int
    updates_dropped: int
    updates_failed: int
    tasks_dispatched: int
    tasks_timed_out: int
    tasks_abandoned: int
    versions: int
    wall_s: float
    simulated_s: float
    upload_bytes: int
    download_bytes: int
    staleness_mean: float
    staleness_max: int
    upload_compression: float
    updates_per_s: float
    stop_reason: str
    weights_sha256: str
    cloud_ingress_bytes: int = 0
    cloud_egress_bytes: int = 0
    cloud_aggregate_s: float = 0.0
    topology: str = "flat"
    tiers: dict[str, float] = field(default_factory=dict)
    peak_rss_bytes: int = 0
    alerts: int = 0
    stragglers: tuple[int, ...] = ()
    server_idle_fraction: float = math.nan
    privacy_epsilon: float = math.nan
    """Differential privacy spent (epsilon at ``privacy.delta``); NaN without differential privacy."""
    first_update_s: float = math.nan
    """Real seconds from the start of the federation to its first accepted update (NaN: none was accepted)."""
    metric_rows_lost: int = 0
    """Metric rows of the run written neither to MLflow nor to its journal (also the tag
    ``flasync.metric_rows_lost``); 0 for an untracked run."""
    eval_metrics: dict[str, float] = field(default_factory=dict)
    """The last central evaluation's figures besides accuracy and loss (``eval.metrics``), by name."""
    best_version: int | None = None
    """The version ``eval.select`` rated best (None: no selection, or no evaluation with a finite figure)."""
    best_metric: str = ""
    """The metric it was selected by, with its direction (``server/eval/accuracy:max``); empty without a selection."""
    best_value: float = math.nan
    """That metric's value at ``best_version``."""
    best_weights_sha256: str = ""
    """The sha256 of the best version's weights (as :attr:`weights_sha256`); empty without a selection."""

    @classmethod
    def from_stats(
        cls,
        stats: ServerStats,
        *,
        run_id: str | None,
        wall_s: float,
        simulated_s: float,
        num_params: int,
        weights: torch.Tensor,
        updates_before: int = 0,
        **extra: Any,
    ) -> RunSummary:
        """Build the summary from the server's counters and the run's own figures.

        Args:
            stats: The server's counters; every field the summary shares with them is taken as it is.
            run_id: The tracking run (None: untracked).
            wall_s: Real seconds of the federation.
            simulated_s: Simulated seconds of the run (from its start, also when resumed).
            num_params: Length of the flat model (the dense upload size).
            weights: The final weights.
            updates_before: Updates accepted before this process took over (a resumed run's rate counts its own).
            **extra: Further fields (``topology``, ``tiers``, ...).
        """
        counters = {f.name for f in fields(stats)}
        shared = {f.name: getattr(stats, f.name) for f in fields(cls) if f.name in counters}
        sent = stats.updates_accepted + stats.updates_dropped
        dense = codecs.HEADER.size + 4 * num_params
        return cls(
            **shared,
            run_id=run_id,
            wall_s=wall_s,
            simulated_s=simulated_s,
            staleness_mean=stats.staleness_mean,
            upload_compression=sent * dense / stats.upload_bytes if stats.upload_bytes else 1.0,
            updates_per_s=(stats.updates_accepted - updates_before) / wall_s if wall_s > 0 else 0.0,
            weights_sha256=weights_sha256(weights),
            **extra,
        )

    def to_dict(self) -> dict[str, Any]:
        """Return the summary as a JSON-ready dict (NaN becomes None, tuples lists)."""
        out: dict[str, Any] = json_ready(asdict(self))
        return out
