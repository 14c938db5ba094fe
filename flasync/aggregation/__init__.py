"""Pure, synchronous aggregation math over flat tensors: FedAvg, FedBuff, FedAsync and server optimizers.

Nothing here touches the event loop. A model state is one flat tensor, and a client's update is its delta
``w_base - w_local`` (a pseudo-gradient). The pieces compose: a `StalenessWeight` discounts stale updates, an
`UpdateBuffer` (or `fedbuff`) combines them, and a `ServerOptimizer` steps the global weights with the result.
"""

from __future__ import annotations

from flasync.aggregation.aggregators import (
    Aggregator,
    BufferedAggregator,
    CustomAggregator,
    MixingAggregator,
    RobustAggregator,
    RobustRule,
)
from flasync.aggregation.buffer import UpdateBuffer
from flasync.aggregation.functional import fedasync_mix_, fedavg, fedbuff, normalized, weighted_mean
from flasync.aggregation.hierarchy import edge_model, edge_progress, mix_partial_
from flasync.aggregation.optimizers import FlatAdam, FlatAdaptive, FlatSGD, ServerOptimizer, TorchServerOptimizer
from flasync.aggregation.robust import coordinate_median, trimmed_mean
from flasync.aggregation.scaffold import ControlVariate, control_delta
from flasync.aggregation.staleness import (
    ConstantStaleness,
    HingeStaleness,
    PolynomialStaleness,
    StalenessWeight,
)
from flasync.aggregation.weights import EqualExampleWeight, ExampleWeight, SampleExampleWeight

__all__ = [
    "Aggregator",
    "BufferedAggregator",
    "ConstantStaleness",
    "ControlVariate",
    "CustomAggregator",
    "EqualExampleWeight",
    "ExampleWeight",
    "FlatAdam",
    "FlatAdaptive",
    "FlatSGD",
    "HingeStaleness",
    "MixingAggregator",
    "PolynomialStaleness",
    "RobustAggregator",
    "RobustRule",
    "SampleExampleWeight",
    "ServerOptimizer",
    "StalenessWeight",
    "TorchServerOptimizer",
    "UpdateBuffer",
    "control_delta",
    "coordinate_median",
    "edge_model",
    "edge_progress",
    "fedasync_mix_",
    "fedavg",
    "fedbuff",
    "mix_partial_",
    "normalized",
    "trimmed_mean",
    "weighted_mean",
]
