"""Secure aggregation: the server learns the sum of a group of updates, never one client's update.

The protocol is SecAgg+ (Bonawitz et al., CCS 2017; Bell et al., CCS 2020) over X25519, HKDF, AES-GCM and AES-CTR
from the ``cryptography`` package, with Shamir secret sharing and fixed-point encoding written here as small pure
functions. :mod:`flasync.secure.group` runs one group in memory with its costs; :mod:`flasync.secure.rounds` runs
a FedAvg round's cohort (:class:`SecureAggregator`) and FedBuff's buffers (:class:`SecureBuffer`, one group per
buffer) with simulated clients. Inside a federation (``[secure_aggregation]``), simulated clients' groups run in
:mod:`flasync.clients.simulated.secure` and remote clients' over HTTP in :mod:`flasync.clients.remote.secure`.
"""

from __future__ import annotations

from flasync.secure.group import GroupResult, Phase, PhaseCost, WeightedEncoding, phase_seconds, run_group
from flasync.secure.keys import KeyPair, RandomSource, SeededRandom, SystemRandom
from flasync.secure.protocol import GroupParams, ProtocolAbort, SecAggClient, neighbour_graph
from flasync.secure.ring import FixedPoint
from flasync.secure.rounds import ClientUpdate, GroupReport, Link, SecureAggregator, SecureBuffer, WaitingUpdate
from flasync.secure.server import GroupOutcome, SecAggServer

__all__ = [
    "ClientUpdate",
    "FixedPoint",
    "GroupOutcome",
    "GroupParams",
    "GroupReport",
    "GroupResult",
    "KeyPair",
    "Link",
    "Phase",
    "PhaseCost",
    "ProtocolAbort",
    "RandomSource",
    "SecAggClient",
    "SecAggServer",
    "SecureAggregator",
    "SecureBuffer",
    "SeededRandom",
    "SystemRandom",
    "WaitingUpdate",
    "WeightedEncoding",
    "neighbour_graph",
    "phase_seconds",
    "run_group",
]
