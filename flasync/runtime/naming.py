"""What a run and its parts are called: run names, tracking tags, the dataset record, a user's rule's name."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from flasync import tracking
from flasync._version import __version__
from flasync.config import (
    FedAvgServer,
    FilesData,
    RunConfig,
    TreeTopology,
)
from flasync.runtime.prepare import Prepared
from flasync.training.local import objective_name

__all__ = [
    "DatasetRecord",
    "data_name",
    "dataset_record",
    "finished_tags",
    "rule_name",
    "run_mode",
    "run_name",
    "run_tags",
    "topology_name",
]


def topology_name(config: RunConfig) -> str:
    """Return a short name of the run's topology (``flat``, ``tree(10x4)``, ``tree(3 edges)``)."""
    topology = config.topology
    if not isinstance(topology, TreeTopology):
        return "flat"
    if topology.edges:
        return f"tree({len(topology.edges)} edges)"
    return "tree(" + "x".join(str(f) for f in topology.fanout) + ")"


def run_mode(config: RunConfig) -> str:
    """Return ``sync`` for round-based servers and ``async`` for the others."""
    return "sync" if isinstance(config.server, FedAvgServer) else "async"


@dataclass(frozen=True, slots=True)
class DatasetRecord:
    """How a run's training data is recorded in MLflow (a dataset input): name, digest, source and profile."""

    name: str
    digest: str
    source: str
    profile: dict[str, Any]


_HASHED_BYTES = 256 * 2**20  # larger data sets are digested from evenly spaced rows


def dataset_record(config: RunConfig, prepared: Prepared, *, custom: bool) -> DatasetRecord:
    """Describe the run's training data for tracking: a content digest, where it came from, and its sizes.

    The digest is the sha256 (first 16 hex digits) of the training features and labels, of evenly spaced rows when
    they exceed 256 MiB, and of the data config for lazily drawn clients (nothing is held to hash). Data read from
    files (``data.kind = "files"``) is named after the training file's stem and digested from the files' bytes
    (training file, then test file), so ``sha256sum train.csv`` shows the same digits when no test file is named.

    Args:
        config: The run's configuration.
        prepared: What the run is made of.
        custom: The data came from the Python API (a user's data set) rather than ``config.data``.
    """
    train = prepared.train
    source = data_name(config, custom=custom)
    if isinstance(config.data, FilesData) and not custom and prepared.files_sha256 is not None:
        files = [config.data.train] + ([config.data.test] if config.data.test is not None else [])
        digest, where = prepared.files_sha256, ", ".join(files)
    else:
        hashed = hashlib.sha256()
        if prepared.lazy is not None:
            hashed.update(config.data.model_dump_json().encode())
        else:
            step = max(1, math.ceil((train.x.nbytes + train.y.nbytes) / _HASHED_BYTES))
            hashed.update(repr((tuple(train.x.shape), train.num_classes, step)).encode())
            hashed.update(train.x[::step].cpu().contiguous().numpy().tobytes())
            hashed.update(train.y[::step].cpu().contiguous().numpy().tobytes())
        digest = hashed.hexdigest()
        where = {
            "custom": "a data set given to flasync.Federation",
            "digits": "sklearn.datasets.load_digits",
            "synthetic": f"flasync synthetic data, seed {config.seed}",
        }.get(source, source)
    partition = config.partition.model_dump(mode="json")
    return DatasetRecord(
        name=source,
        digest=digest[:16],
        source=where,
        profile={
            "rows": int(prepared.sizes.sum()),
            "test_rows": int(prepared.test.x.shape[0]),
            "features": int(math.prod(train.x.shape[1:])),
            "classes": int(train.num_classes),
            "clients": len(prepared.sizes),
            "partition": ", ".join(f"{k}={v}" for k, v in partition.items()),
        },
    )


def data_name(config: RunConfig, *, custom: bool = False) -> str:
    """Name the run's data: ``custom`` (given in Python), the training file's stem (``data.kind = "files"``), or
    the data kind (``digits``, ``synthetic``)."""
    if custom:
        return "custom"
    if isinstance(config.data, FilesData):
        return Path(config.data.train).stem
    return config.data.kind


def run_name(config: RunConfig, *, started: datetime, run_id: str, custom: bool = False) -> str:
    """Return the run's name: ``tracking.run_name`` with its fields filled in, or a name that says what ran.

    ``{seed}`` is the config's seed, ``{time}`` the UTC start as ``20260105-143000`` and ``{id}`` ``run_id`` (a few
    random hex digits), so that repeated runs of one config get names that differ. Without ``tracking.run_name``
    the name is ``<aggregator>-<data>-seed<seed>-<run_id>`` (the data named by :func:`data_name`).

    Args:
        config: The run's configuration.
        started: When the run starts (timezone-aware).
        run_id: What ``{id}`` stands for.
        custom: The data came from the Python API.
    """
    template = config.tracking.run_name
    if template is None:
        template = f"{config.server.kind}-{data_name(config, custom=custom)}-seed{{seed}}-{{id}}"
    utc = started.astimezone(UTC)
    return template.format(seed=config.seed, time=utc.strftime("%Y%m%d-%H%M%S"), id=run_id)


def run_tags(config: RunConfig, *, virtual_clock: bool) -> dict[str, str]:
    """Return the tracking tags of a run: flasync version, aggregator, mode, clock, topology, seed."""
    return {
        "flasync.version": __version__,
        "aggregator": config.server.kind,
        "mode": run_mode(config),
        "clock": "virtual" if virtual_clock else "wall",
        "topology": topology_name(config),
        "seed": str(config.seed),
    }


def finished_tags(figures: dict[str, int | float]) -> dict[str, str]:
    """Return a run's final figures as tracking tags, ``finished.<name>`` (a float written so that it reads back
    exactly): one value each, shown with the run's tags rather than as a one-point chart each."""
    prefix = tracking.FINISHED_TAG_PREFIX
    return {f"{prefix}{key}": repr(value) if isinstance(value, float) else str(value) for key, value in figures.items()}


def rule_name(rule: object) -> str:
    """Return what a user's factory or rule is called in tags and messages (a function's or a class's name)."""
    name = getattr(rule, "__qualname__", None)
    return name if isinstance(name, str) else objective_name(rule)
