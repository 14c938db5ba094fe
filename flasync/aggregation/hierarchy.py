"""Edge aggregation math: partial aggregates and HierFAVG's edge models, as free functions over flat tensors.

An edge folds the updates below it into a *partial aggregate*: the weighted sum ``S = sum_k e_k s_k delta_k`` and
its example weight ``E = sum_k e_k`` (an :class:`~flasync.aggregation.UpdateBuffer` holds both). Adding partials
is associative, so the cloud ends with the sums it would have built from the clients' updates one by one.

HierFAVG (Liu, Zhang, Song and Letaief, "Client-Edge-Cloud Hierarchical Federated Learning", ICC 2020, Algorithm 1)
runs ``kappa2`` edge aggregations per cloud aggregation: after each, the edge model becomes its members'
sample-weighted mean, ``w_edge <- w_edge - S / E``; after the last one, the edge forwards its whole progress of the
cloud round, ``E * (w_cloud - w_edge)``, which the cloud averages over edges by ``E``.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["edge_model", "edge_progress", "mix_partial_"]


def edge_model(weights: Tensor, weighted_sum: Tensor, example_weight: float) -> Tensor:
    """Return the edge model after one edge aggregation: ``w - S / E`` (a new tensor).

    Args:
        weights: The edge model the round's clients started from, flat.
        weighted_sum: ``S = sum_k n_k delta_k`` over the round's updates, flat like ``weights``.
        example_weight: ``E = sum_k n_k`` (> 0).
    """
    return weights - weighted_sum / example_weight


def edge_progress(cloud_weights: Tensor, edge_weights: Tensor, example_weight: float) -> Tensor:
    """Return what a HierFAVG edge forwards after its cloud round: ``E * (w_cloud - w_edge)`` (a new tensor).

    Args:
        cloud_weights: The cloud model the round started from.
        edge_weights: The edge model after the round's ``kappa2`` edge aggregations.
        example_weight: ``E``, the samples of the edge's members that answered.
    """
    return (cloud_weights - edge_weights).mul_(example_weight)


def mix_partial_(weights: Tensor, weighted_sum: Tensor, *, alpha: float, example_weight: float) -> Tensor:
    """Mix an edge's mean delta into the weights at rate ``alpha`` (FedAsync over a partial), in place.

    FedAsync (Xie et al., 2019, eq. 1) mixes a local model ``x`` as ``w <- (1 - a) w + a x``; for the mean of the
    edge's updates, ``x = w - S / E``, this is ``w <- w - a S / E``.

    Args:
        weights: The global weights, updated in place and returned.
        weighted_sum: The partial's ``S``.
        alpha: The mixing rate, already discounted by staleness (``alpha * s(tau)``).
        example_weight: The partial's ``E`` (> 0).
    """
    return weights.sub_(weighted_sum, alpha=alpha / example_weight)
