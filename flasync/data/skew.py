"""The non-IID partitions of NIID-Bench beside Dirichlet and shards: label-quantity, quantity and feature skew.

Li, Diao, Chen & He, "Federated Learning on Non-IID Data Silos: An Experimental Study" (ICDE 2022) compare
federated algorithms on these splits:

- **label-quantity skew** (their ``#C=k``): each client holds samples of exactly ``k`` labels
  (:func:`partition_label_quantity`);
- **quantity skew**: clients hold different numbers of samples, labels spread IID (:func:`partition_quantity`; the
  sizes follow a lognormal or a power law, as in LEAF and FedScale's populations, rather than NIID-Bench's
  Dirichlet draw);
- **feature skew**: an IID split whose features differ per client, by Gaussian noise of a level that grows with
  the client id (their ``x + N(0, sigma * i / K)``), or by one of a few random rotations of the feature space
  (rotated-MNIST style) (:func:`skew_features`).

Every function draws from an injected generator (or, for the per-client transforms, from streams keyed by the run's
seed and the client), so the same seed gives the same split and the same features on any machine.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch

from flasync.core import seeding
from flasync.core.errors import DataError
from flasync.data import (
    ArrayData,
    Partition,
    SyntheticClients,
    _check_client_count,
    _check_labels,
    _group_by_owner,
    _offsets,
    _shuffled_by_label,
    make_synthetic,
)

__all__ = [
    "LazySkewedClients",
    "SizeDistribution",
    "apportion",
    "client_labels",
    "client_size_weights",
    "feature_noise_levels",
    "partition_label_quantity",
    "partition_quantity",
    "rotation_matrix",
    "skew_features",
]

SizeDistribution = Literal["lognormal", "powerlaw"]
"""How :func:`client_size_weights` draws each client's relative size."""

_NOISE_KEY = 3  # seeding.DATA sub-keys of the feature-skew streams (0..2 are the synthetic data's)
_ROTATION_KEY = 4
_LABELS_KEY = 5  # seeding.DATA sub-key of a lazy client's own labels


def client_labels(num_classes: int, num_clients: int, labels_per_client: int, rng: np.random.Generator) -> np.ndarray:
    """Draw the ``k`` distinct labels each client holds under label-quantity skew.

    NIID-Bench's assignment: client ``i`` holds label ``i mod C`` (so every label has a holder once ``K >= C``),
    then ``k - 1`` further labels drawn uniformly without replacement from the rest.

    Args:
        num_classes: ``C``, labels ``0..C-1``.
        num_clients: ``K``.
        labels_per_client: ``k``, ``1 <= k <= C``.
        rng: Source of randomness.

    Returns:
        ``int64`` of shape ``(K, k)``: row ``i`` holds client ``i``'s labels, ascending.

    Raises:
        DataError: If ``k`` is not in ``1..C``.
    """
    if not 1 <= labels_per_client <= num_classes:
        raise DataError(
            f"partition.labels_per_client: must be in 1..{num_classes} (the labels present), got {labels_per_client}"
        )
    first = np.arange(num_clients, dtype=np.int64) % num_classes
    # Random keys per (client, label), the first label's forced lowest: the k smallest keys pick the labels.
    keys = rng.random((num_clients, num_classes))
    keys[np.arange(num_clients), first] = -1.0
    chosen = np.argpartition(keys, labels_per_client - 1, axis=1)[:, :labels_per_client]
    return np.sort(chosen, axis=1).astype(np.int64)


def partition_label_quantity(
    labels: np.ndarray, num_clients: int, *, labels_per_client: int, rng: np.random.Generator
) -> Partition:
    """Split samples so that each client holds samples of exactly ``labels_per_client`` labels.

    NIID-Bench's ``#C=k`` (Li et al. 2022, Section IV-A): the labels of each client come from :func:`client_labels`
    (over the labels present, in increasing order); the shuffled samples of a label are then dealt in near-equal
    parts (sizes differ by at most one) to the clients holding it. A label no client holds (possible when
    ``K * k < C``) leaves its samples unused.

    Args:
        labels: Integer labels, shape ``(N,)``, non-negative.
        num_clients: Number of clients ``K``, ``1 <= K <= N``.
        labels_per_client: ``k``, between 1 and the number of distinct labels.
        rng: Source of randomness.

    Returns:
        A partition of (a subset of) ``range(N)``; each client's indices are in random order.

    Raises:
        DataError: If the labels are not non-negative integers, ``K`` is out of range, ``k`` exceeds the labels
            present, or a label has fewer samples than clients holding it.
    """
    labels = _check_labels(labels)
    _check_client_count(labels.shape[0], num_clients)
    _, dense, class_sizes = np.unique(labels, return_inverse=True, return_counts=True)
    dense = dense.reshape(-1)
    held = client_labels(class_sizes.shape[0], num_clients, labels_per_client, rng)
    holders = np.bincount(held.ravel(), minlength=class_sizes.shape[0])
    short = np.flatnonzero((holders > 0) & (class_sizes < holders))
    if short.shape[0]:
        c = int(short[0])
        raise DataError(
            f"partition.labels_per_client: label {c} has {class_sizes[c]} samples for {holders[c]} clients holding it; "
            "use fewer clients or fewer labels_per_client"
        )
    # The holders of each label in client order: (label, client) pairs sorted by label.
    pair_label = held.ravel()
    pair_client = np.repeat(np.arange(num_clients, dtype=np.int64), labels_per_client)
    order = np.argsort(pair_label, kind="stable")
    pair_label, pair_client = pair_label[order], pair_client[order]
    # Near-equal share of each (label, holder) pair: floor(n_c / m_c), the first n_c mod m_c holders one more.
    rank = np.arange(pair_label.shape[0], dtype=np.int64) - _offsets(holders)[pair_label]
    base, extra = np.divmod(class_sizes[pair_label], holders[pair_label])
    share = base + (rank < extra)
    samples = _shuffled_by_label(dense, rng)
    used = np.isin(np.arange(class_sizes.shape[0]), pair_label)
    kept = samples[used[dense[samples]]]
    owner = np.repeat(pair_client, share)
    return _group_by_owner(kept, owner, num_clients, rng)


def client_size_weights(
    num_clients: int,
    *,
    distribution: SizeDistribution,
    sigma: float = 1.0,
    exponent: float = 2.0,
    rng: np.random.Generator,
) -> np.ndarray:
    """Draw each client's relative size under quantity skew.

    ``lognormal``: ``w_k = exp(N(0, sigma^2))``. ``powerlaw``: ``w_k`` Pareto with density ``(a - 1) w^-a`` on
    ``w >= 1`` (``a = exponent > 1``; the smaller ``a``, the heavier the tail of large clients).

    Args:
        num_clients: ``K``.
        distribution: ``"lognormal"`` or ``"powerlaw"``.
        sigma: Log-space standard deviation of the lognormal, ``>= 0``.
        exponent: The power law's exponent ``a > 1``.
        rng: Source of randomness.

    Returns:
        ``float64`` of shape ``(K,)``, all positive.

    Raises:
        ValueError: If a parameter is out of range or the distribution is unknown.
    """
    if distribution == "lognormal":
        if not (math.isfinite(sigma) and sigma >= 0):
            raise ValueError(f"sigma must be a finite number >= 0; got {sigma}")
        weights: np.ndarray = np.exp(sigma * rng.standard_normal(num_clients))
        return weights
    if distribution == "powerlaw":
        if not (math.isfinite(exponent) and exponent > 1):
            raise ValueError(f"exponent must be a finite number > 1; got {exponent}")
        weights = rng.pareto(exponent - 1.0, size=num_clients) + 1.0
        return weights
    raise ValueError(f"unknown size distribution {distribution!r} (use 'lognormal' or 'powerlaw')")


def apportion(weights: np.ndarray, total: int, *, min_size: int = 1) -> np.ndarray:
    """Turn positive weights into integer sizes summing to ``total``, each at least ``min_size``.

    Every client first gets ``min_size``; the remaining ``total - K * min_size`` are apportioned in proportion to
    the weights by largest remainders (ties to the lower client id), so each size is within one of
    ``min_size + share_k``.

    Args:
        weights: Positive finite weights, shape ``(K,)``.
        total: Samples to apportion, ``>= K * min_size``.
        min_size: Fewest samples per client, ``>= 0``.

    Returns:
        ``int64`` sizes of shape ``(K,)`` summing to ``total``.

    Raises:
        DataError: If ``total < K * min_size``.
        ValueError: If a weight is not positive and finite.
    """
    weights = np.asarray(weights, dtype=np.float64)
    if weights.shape[0] == 0 or not np.all(np.isfinite(weights) & (weights > 0)):
        raise ValueError("weights must be positive finite numbers, at least one")
    spare = total - weights.shape[0] * min_size
    if spare < 0:
        raise DataError(f"cannot give each of {weights.shape[0]} clients {min_size} samples from {total} samples")
    quota = weights / weights.sum() * spare
    sizes = np.floor(quota).astype(np.int64)
    remainder = quota - sizes
    extra = spare - int(sizes.sum())
    sizes[np.argsort(-remainder, kind="stable")[:extra]] += 1
    out: np.ndarray = sizes + min_size
    return out


def partition_quantity(
    num_samples: int,
    num_clients: int,
    *,
    distribution: SizeDistribution,
    sigma: float = 1.0,
    exponent: float = 2.0,
    min_samples: int = 1,
    rng: np.random.Generator,
) -> Partition:
    """Split samples IID among clients whose sizes follow a lognormal or a power law (quantity skew).

    The sizes are :func:`apportion` of :func:`client_size_weights` (drawn first from ``rng``); the samples are then
    a random permutation of ``range(N)`` cut at those sizes, so each client's labels are an IID draw.

    Args:
        num_samples: ``N``.
        num_clients: ``K``, ``1 <= K``, ``K * min_samples <= N``.
        distribution: ``"lognormal"`` or ``"powerlaw"``.
        sigma: Log-space standard deviation of the lognormal.
        exponent: The power law's exponent ``a > 1``.
        min_samples: Fewest samples per client, ``>= 1``.
        rng: Source of randomness.

    Returns:
        A partition of ``range(N)``.

    Raises:
        DataError: If ``K`` is out of range or ``K * min_samples > N``.
        ValueError: If a parameter is out of range.
    """
    _check_client_count(num_samples, num_clients)
    if min_samples < 1:
        raise ValueError(f"min_samples must be >= 1; got {min_samples}")
    weights = client_size_weights(num_clients, distribution=distribution, sigma=sigma, exponent=exponent, rng=rng)
    sizes = apportion(weights, num_samples, min_size=min_samples)
    return Partition(rng.permutation(num_samples).astype(np.int64, copy=False), _offsets(sizes))


def feature_noise_levels(num_clients: int, noise: float) -> np.ndarray:
    """Return each client's noise standard deviation: ``noise * (k + 1) / K`` for client ``k`` (NIID-Bench).

    Args:
        num_clients: ``K``.
        noise: The largest level (client ``K - 1``'s), ``>= 0``.

    Returns:
        ``float64`` of shape ``(K,)``, increasing from ``noise / K`` to ``noise``.
    """
    levels: np.ndarray = noise * np.arange(1, num_clients + 1, dtype=np.float64) / num_clients
    return levels


def rotation_matrix(dim: int, group: int, seed: int) -> torch.Tensor:
    """Return rotation group ``group``'s orthogonal ``dim x dim`` matrix (group 0: the identity).

    A group other than 0 draws a Haar-random orthogonal matrix (the QR decomposition of a Gaussian matrix with the
    signs of R's diagonal moved into Q; Mezzadri, "How to generate random matrices from the classical compact
    groups", 2007) from the stream ``(seed, DATA, 4, group)``.

    Args:
        dim: Feature dimension (features are flattened).
        group: Rotation group, ``>= 0``.
        seed: The run's seed.

    Returns:
        ``float32`` of shape ``(dim, dim)`` with ``Q^T Q = I``.
    """
    if group == 0:
        return torch.eye(dim, dtype=torch.float32)
    rng = seeding.numpy_stream(seed, seeding.DATA, _ROTATION_KEY, group)
    q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
    q *= np.sign(np.diag(r))
    return torch.from_numpy(np.ascontiguousarray(q, dtype=np.float32))


def skew_features(
    data: ArrayData, partition: Partition, *, noise: float = 0.0, rotations: int = 1, seed: int
) -> ArrayData:
    """Give each client's samples features of their own: a rotation of its group, then Gaussian noise.

    Client ``k`` belongs to rotation group ``k mod rotations`` and its flattened features ``x`` become
    ``x Q_g + e`` with ``Q_g`` from :func:`rotation_matrix` and ``e ~ N(0, s_k^2)`` elementwise, ``s_k`` from
    :func:`feature_noise_levels`, drawn from the client's own stream ``(seed, DATA, 3, k)``: the same client gets
    the same features whatever the number of threads or the order of clients. Samples no client holds are kept
    as they are.

    Args:
        data: The training data.
        partition: Which samples each client holds (disjoint).
        noise: The largest noise level, ``>= 0`` (0: no noise).
        rotations: Rotation groups, ``>= 1`` (1: no rotation).
        seed: The run's seed.

    Returns:
        A new data set (the input is not modified).

    Raises:
        ValueError: If ``noise < 0`` or ``rotations < 1``.
    """
    if not (math.isfinite(noise) and noise >= 0):
        raise ValueError(f"noise must be a finite number >= 0; got {noise}")
    if rotations < 1:
        raise ValueError(f"rotations must be >= 1; got {rotations}")
    x = data.x.reshape(len(data), -1).clone()
    dim, clients = x.shape[1], len(partition)
    # One group's matrix at a time: a group of 3072 features holds 36 MiB.
    for group in range(1, min(rotations, clients)):
        matrix = rotation_matrix(dim, group, seed)
        for k in range(group, clients, rotations):
            index = torch.from_numpy(np.array(partition[k], dtype=np.int64))
            x.index_copy_(0, index, x.index_select(0, index) @ matrix)
    levels = feature_noise_levels(clients, noise)
    for k in np.flatnonzero(levels > 0).tolist():
        rows = partition[k]
        if rows.shape[0] == 0:
            continue
        index = torch.from_numpy(np.array(rows, dtype=np.int64))
        rng = seeding.numpy_stream(seed, seeding.DATA, _NOISE_KEY, k)
        draw = rng.standard_normal((rows.shape[0], dim), dtype=np.float32) * np.float32(levels[k])
        x.index_copy_(0, index, x.index_select(0, index) + torch.from_numpy(draw))
    return ArrayData(x=x.reshape(data.x.shape), y=data.y, num_classes=data.num_classes)


class LazySkewedClients(SyntheticClients):
    """Lazily drawn synthetic clients (:class:`~flasync.data.SyntheticClients`) with label-quantity or feature skew.

    Nothing is stored per client beyond the sizes: client ``k`` draws its samples from its own stream each time it
    is sampled. With ``labels_per_client`` it draws labels from its own ``k`` labels only: label ``k mod C`` and
    ``k - 1`` others drawn from the stream ``(seed, DATA, 5, k)``, as :func:`client_labels` chooses them. With
    ``noise`` or ``rotations`` its features get :func:`skew_features`'s transform (the rotation of group
    ``k mod rotations``, then noise of ``noise * (k + 1) / K`` from the stream ``(seed, DATA, 3, k)``).

    Args:
        sizes: Samples per client.
        num_features: Feature dimension.
        num_classes: Number of classes ``C``.
        seed: The run's seed.
        labels_per_client: Labels of each client (None: all).
        noise: The largest client's noise level (0: none).
        rotations: Rotation groups (1: none).
    """

    def __init__(
        self,
        sizes: np.ndarray,
        *,
        num_features: int = 32,
        num_classes: int = 10,
        seed: int = 0,
        labels_per_client: int | None = None,
        noise: float = 0.0,
        rotations: int = 1,
    ) -> None:
        """Remember the sizes and the skew; draw nothing yet."""
        super().__init__(sizes, num_features=num_features, num_classes=num_classes, seed=seed)
        if labels_per_client is not None and not 1 <= labels_per_client <= num_classes:
            raise DataError(
                f"partition.labels_per_client: must be in 1..{num_classes} (data.num_classes), got {labels_per_client}"
            )
        self.labels_per_client = labels_per_client
        self.noise = noise
        self.rotations = rotations

    def labels_of(self, k: int) -> np.ndarray | None:
        """Return client ``k``'s labels, ascending (None: every label)."""
        if self.labels_per_client is None:
            return None
        rng = seeding.numpy_stream(self.seed, seeding.DATA, _LABELS_KEY, k)
        others = np.delete(np.arange(self.num_classes), k % self.num_classes)
        chosen = rng.choice(others, size=self.labels_per_client - 1, replace=False)
        return np.sort(np.append(chosen, k % self.num_classes)).astype(np.int64)

    def client(self, k: int) -> ArrayData:
        """Draw client ``k``'s samples, then skew its features."""
        rng = seeding.numpy_stream(self.seed, seeding.DATA, 2, k)
        data = make_synthetic(
            num_samples=int(self.sizes[k]),
            num_features=self.num_features,
            num_classes=self.num_classes,
            rng=rng,
            classes=self.labels_of(k),
        )
        group = k % self.rotations
        x = data.x @ rotation_matrix(self.num_features, group, self.seed) if group else data.x
        level = self.noise * (k + 1) / len(self)
        if level > 0:
            noise = seeding.numpy_stream(self.seed, seeding.DATA, _NOISE_KEY, k)
            x = x + torch.from_numpy(noise.standard_normal(tuple(x.shape), dtype=np.float32) * np.float32(level))
        return ArrayData(x=x, y=data.y, num_classes=data.num_classes)
