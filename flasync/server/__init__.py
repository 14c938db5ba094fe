"""The server of a run, in rooms with one job each.

* :mod:`~flasync.server.loop` - the loop: receive, route, drive the policy, checkpoint; the run's lifecycle.
* :mod:`~flasync.server.stopping` - when the run ends, and how often it evaluates and checkpoints.
* :mod:`~flasync.server.versions` - a new version: the aggregator's step, the model published once encoded, evaluation.
* :mod:`~flasync.server.node` - admit, fold and refuse: the job the cloud and every edge share.
* :mod:`~flasync.server.receiver` - the cloud's side of that job: what arrives from below, counted and logged.
* :mod:`~flasync.server.policies` - when tasks start and versions are due (async slots, sync rounds, tree rounds).
* :mod:`~flasync.server.registry` - the tasks in flight, their base models, watchdogs and redispatch.
* :mod:`~flasync.server.intake` - one admission path for updates (cloud and edges).
* :mod:`~flasync.server.accounting` - every outcome and byte counted once.
* :mod:`~flasync.server.sampler` - who trains next.
* :mod:`~flasync.server.edges` - hierarchical edges built on the registry, the aggregation node and the update buffer.
"""

from __future__ import annotations

from flasync.server.accounting import Accounting, ServerStats, VersionFigures
from flasync.server.edges import EdgeLink, EdgeNetwork, EdgeNode, EdgeSettings, TierStats, link_seconds
from flasync.server.intake import Admitted, Intake, Refused
from flasync.server.loop import INTERRUPTED, Evaluator, Server, StopRules
from flasync.server.policies import AsyncSlots, Policy, SyncRounds, TreeRounds
from flasync.server.registry import PostTask, StartGroup, StartTask, TaskRegistry, Timer, one_each
from flasync.server.sampler import ClientSampler

__all__ = [
    "INTERRUPTED",
    "Accounting",
    "Admitted",
    "AsyncSlots",
    "ClientSampler",
    "EdgeLink",
    "EdgeNetwork",
    "EdgeNode",
    "EdgeSettings",
    "Evaluator",
    "Intake",
    "Policy",
    "PostTask",
    "Refused",
    "Server",
    "ServerStats",
    "StartGroup",
    "StartTask",
    "StopRules",
    "SyncRounds",
    "TaskRegistry",
    "TierStats",
    "Timer",
    "TreeRounds",
    "VersionFigures",
    "link_seconds",
    "one_each",
]
