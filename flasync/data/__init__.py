"""Hold data sets in memory as tensors and split them among federated clients.

A data set is an :class:`ArrayData`: one feature tensor and one label tensor, small enough to keep in
memory, as in every federated-learning simulation. A :class:`Partition` maps each client to the indices of
its samples. The partitioners draw from an injected :class:`numpy.random.Generator` and are vectorised, so a
thousand clients over hundreds of thousands of samples take milliseconds.
"""

from __future__ import annotations

import gzip
import importlib.util
import math
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.data

from flasync.core.errors import DataError

__all__ = [
    "ArrayData",
    "LazyIIDPartition",
    "Partition",
    "SyntheticClients",
    "from_dataset",
    "load_digits",
    "make_synthetic",
    "partition_by_column",
    "partition_dirichlet",
    "partition_iid",
    "partition_shards",
    "split_indices",
    "train_test_split",
]

# Draws of partition_dirichlet's proportions before it repairs the last draw by moving samples.
_MAX_DIRICHLET_DRAWS = 10


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ArrayData:
    """Hold a labelled data set as two tensors.

    ``x`` is made contiguous on construction; everything else is validated and never copied.

    Attributes:
        x: Features, shape ``(N, *feature_shape)``, ``torch.float32``.
        y: Labels, shape ``(N,)``, ``torch.int64``, values in ``[0, num_classes)``.
        num_classes: Number of classes; may exceed the largest label present.

    Raises:
        DataError: If the tensors have the wrong types, dtypes or shapes, or a label is out of range.
    """

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int

    def __post_init__(self) -> None:
        if not isinstance(self.x, torch.Tensor) or not isinstance(self.y, torch.Tensor):
            raise DataError(f"x and y must be torch tensors; got {type(self.x).__name__} and {type(self.y).__name__}.")
        if self.x.dtype != torch.float32:
            raise DataError(f"x must have dtype torch.float32; got {self.x.dtype}.")
        if self.y.dtype != torch.int64:
            raise DataError(f"y must have dtype torch.int64; got {self.y.dtype}.")
        if self.x.dim() < 1:
            raise DataError("x must have a leading sample dimension; got a 0-d tensor.")
        if self.y.dim() != 1:
            raise DataError(f"y must be 1-d; got shape {tuple(self.y.shape)}.")
        if self.x.shape[0] != self.y.shape[0]:
            raise DataError(f"x and y must have the same length; got {self.x.shape[0]} and {self.y.shape[0]}.")
        if isinstance(self.num_classes, bool | np.bool_) or not isinstance(self.num_classes, int | np.integer):
            raise DataError(f"num_classes must be an int; got {type(self.num_classes).__name__}.")
        if self.num_classes < 1:
            raise DataError(f"num_classes must be >= 1; got {self.num_classes}.")
        object.__setattr__(self, "num_classes", int(self.num_classes))
        _check_label_range(self.y, self.num_classes)
        if not self.x.is_contiguous():
            # A layout detail, not a data error: fix it once here so every consumer can rely on it.
            object.__setattr__(self, "x", self.x.contiguous())

    def __len__(self) -> int:
        """Return the number of samples."""
        return int(self.y.shape[0])

    @property
    def feature_shape(self) -> tuple[int, ...]:
        """Shape of one sample's features, ``x.shape[1:]``."""
        return tuple(self.x.shape[1:])

    def subset(self, indices: np.ndarray | torch.Tensor) -> ArrayData:
        """Return the samples at ``indices``, in that order, as a new data set with the same ``num_classes``.

        Args:
            indices: Integer sample indices in ``[0, len(self))``, shape ``(M,)``; repeats are allowed.

        Returns:
            A data set of ``M`` samples whose tensors are copies, not views.

        Raises:
            DataError: If ``indices`` is not a 1-d integer array.
            IndexError: If an index is outside ``[0, len(self))``.
        """
        index = _as_index_tensor(indices)
        if index.numel() > 0:
            low, high = int(index.min()), int(index.max())
            if low < 0 or high >= len(self):
                bad = low if low < 0 else high
                raise IndexError(f"subset index {bad} is out of range for a data set of {len(self)} samples.")
        return ArrayData(x=self.x.index_select(0, index), y=self.y.index_select(0, index), num_classes=self.num_classes)


def load_digits() -> ArrayData:
    """Load the scikit-learn digits data set (bundled, no download).

    The 1797 8x8 grey-scale images of the UCI optical digits data set, scaled from ``0..16`` to ``[0, 1]``. The
    table is read from the file scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``, as its own
    ``load_digits`` reads it) without importing scikit-learn, which imports SciPy and pandas: some 100,000 Python
    objects whose creation in the caller's process (an embedding service's) sets off full garbage collections that
    stop every thread, the event loop's too, for 0.2 s each. A scikit-learn without that file is imported as usual.

    Returns:
        ``x`` of shape ``(1797, 64)`` in ``[0, 1]``, ``y`` in ``0..9``, ``num_classes=10``.
    """
    table = _digits_table()
    if table is not None:
        features, labels = table[:, :-1], table[:, -1]
    else:  # pragma: no cover - every scikit-learn since 0.x ships the file
        from sklearn.datasets import load_digits as sklearn_load_digits

        features, labels = sklearn_load_digits(return_X_y=True)
    x = torch.from_numpy(np.ascontiguousarray(features / 16.0, dtype=np.float32))
    y = torch.from_numpy(np.asarray(labels, dtype=np.int64))
    return ArrayData(x=x, y=y, num_classes=10)


def _digits_table() -> np.ndarray | None:
    """Return the digits table (64 pixel columns, then the label) from scikit-learn's bundled file, or None when the
    installed scikit-learn has no such file (its package is located, not imported)."""
    spec = importlib.util.find_spec("sklearn")
    folders = list(spec.submodule_search_locations or ()) if spec is not None else []
    for folder in folders:
        path = Path(folder, "datasets", "data", "digits.csv.gz")
        if path.is_file():
            with gzip.open(path, "rt", encoding="ascii") as lines:
                table: np.ndarray = np.loadtxt(lines, delimiter=",", dtype=np.float64)
            return table
    return None


def make_synthetic(
    *,
    num_samples: int,
    num_features: int = 32,
    num_classes: int = 10,
    rng: np.random.Generator,
    classes: np.ndarray | None = None,
) -> ArrayData:
    """Draw a linearly separable toy data set.

    ``x_i ~ N(0, I)``, ``y_i ~ Uniform{0, ..., num_classes - 1}``, then ``x[i, y_i mod num_features] += 2``,
    so the class-conditional mean of coordinate ``c mod num_features`` is 2 for class ``c`` and 0 elsewhere.
    Features are drawn first, then labels.

    Args:
        num_samples: Number of samples ``N`` (>= 0).
        num_features: Feature dimension ``d`` (>= 1).
        num_classes: Number of classes (>= 1).
        rng: Source of randomness.
        classes: Draw labels uniformly from these classes only (a client of label-quantity skew); default: all.

    Returns:
        ``x`` of shape ``(N, d)``, ``y`` of shape ``(N,)``.

    Raises:
        ValueError: If a size is out of range.
    """
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0; got {num_samples}.")
    if num_features < 1:
        raise ValueError(f"num_features must be >= 1; got {num_features}.")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1; got {num_classes}.")
    x = rng.standard_normal((num_samples, num_features), dtype=np.float32)
    if classes is None:
        y = rng.integers(0, num_classes, size=num_samples, dtype=np.int64)
    else:
        y = np.asarray(classes, dtype=np.int64)[rng.integers(0, len(classes), size=num_samples)]
    x[np.arange(num_samples), y % num_features] += 2.0
    return ArrayData(x=torch.from_numpy(x), y=torch.from_numpy(y), num_classes=num_classes)


def from_dataset(dataset: torch.utils.data.Dataset[Any], *, num_classes: int | None = None) -> ArrayData:
    """Materialise a map-style data set of ``(x, y)`` pairs into tensors.

    Reads ``dataset[0]`` to ``dataset[len(dataset) - 1]`` once. Features may be tensors, numpy arrays,
    numbers or nested lists and are converted to CPU ``float32`` as they are (integer pixels are not
    rescaled). Labels may be Python or numpy integers or 0-d integer tensors or arrays.

    Args:
        dataset: A data set with ``__len__`` and ``__getitem__`` returning ``(x, y)``.
        num_classes: Number of classes; inferred as ``max(y) + 1`` when ``None``.

    Returns:
        The data set as ``x`` of shape ``(N, *shape of one x)`` and ``y`` of shape ``(N,)``.

    Raises:
        DataError: If the data set has no ``len()`` or is empty, an item is not an ``(x, y)`` pair, the
            features differ in shape or are not numeric, a label is not a non-negative integer, or a label
            is ``>= num_classes``.
    """
    try:
        size = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise DataError(f"dataset must define __len__; {type(dataset).__name__} does not.") from None
    if size == 0:
        raise DataError("dataset is empty.")
    if num_classes is not None and num_classes < 1:
        raise DataError(f"num_classes must be >= 1; got {num_classes}.")
    features: list[torch.Tensor] = []
    labels: list[int] = []
    for i in range(size):
        item = dataset[i]
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise DataError(f"item {i} of the dataset must be an (x, y) pair; got {type(item).__name__}.")
        features.append(_feature_tensor(item[0], i))
        if features[-1].shape != features[0].shape:
            raise DataError(
                f"item {i} has x of shape {tuple(features[-1].shape)}, but item 0 has shape {tuple(features[0].shape)}."
            )
        labels.append(_label_int(item[1], i))
    y = torch.tensor(labels, dtype=torch.int64)
    inferred = int(y.max()) + 1 if num_classes is None else num_classes
    return ArrayData(x=torch.stack(features), y=y, num_classes=inferred)


def train_test_split(data: ArrayData, *, test_fraction: float, rng: np.random.Generator) -> tuple[ArrayData, ArrayData]:
    """Split a data set into train and test sets, stratified by label.

    The test set has ``round(test_fraction * N)`` samples (at least 1 and at most ``N - 1``). Each class
    contributes ``floor(test_fraction * n_c)`` or one more, the extra samples going to the classes with the
    largest remainders (largest-remainder apportionment, ties broken at random), so label proportions match to
    within one sample per class. Both sets keep the original sample order.

    Args:
        data: The data set to split, ``N >= 2``.
        test_fraction: Fraction of samples in the test set, in ``(0, 1)``.
        rng: Source of randomness.

    Returns:
        ``(train, test)``.

    Raises:
        ValueError: If ``test_fraction`` is not in ``(0, 1)``.
        DataError: If the data set has fewer than 2 samples.
    """
    train_indices, test_indices = split_indices(data.y.numpy(), data.num_classes, test_fraction=test_fraction, rng=rng)
    return data.subset(train_indices), data.subset(test_indices)


def split_indices(
    groups: np.ndarray,
    num_groups: int,
    *,
    test_fraction: float,
    rng: np.random.Generator,
    keep_one: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Split sample indices into train and test, stratified by group (a label, or a client).

    The apportionment of :func:`train_test_split`: ``round(test_fraction * N)`` test samples (at least 1 and at most
    ``N - 1``), ``floor(test_fraction * n_g)`` or one more from each group, the extras to the largest remainders.
    With ``keep_one`` a group never gives its last sample, so every group stays in the training set (LEAF's
    per-user split); the test set is then smaller when small groups cannot give their share, as no group gives more
    than its quota rounded up.

    Args:
        groups: Group of each sample, integers in ``[0, num_groups)``, shape ``(N,)``, ``N >= 2``.
        num_groups: Number of groups.
        test_fraction: Fraction of samples in the test set, in ``(0, 1)``.
        rng: Source of randomness.
        keep_one: Leave at least one sample of every group in the training set.

    Returns:
        ``(train_indices, test_indices)``, each ascending.

    Raises:
        ValueError: If ``test_fraction`` is not in ``(0, 1)``.
        DataError: If there are fewer than 2 samples.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1); got {test_fraction}.")
    n = int(groups.shape[0])
    if n < 2:
        raise DataError(f"cannot split a data set of {n} samples; at least 2 are needed.")
    group_sizes = np.bincount(groups, minlength=num_groups)
    quota = test_fraction * group_sizes
    per_group = np.floor(quota).astype(np.int64)  # <= n_g - 1, as test_fraction < 1
    total = min(max(round(test_fraction * n), 1), n - 1)
    remainder = quota - per_group
    # Largest remainders first; random keys break ties so no group is favoured by its number.
    order = np.lexsort((rng.random(remainder.shape[0]), -remainder))
    if keep_one:  # an extra sample only from a group with a remainder and a sample to spare
        order = order[(per_group[order] < group_sizes[order] - 1) & (remainder[order] > 0)]
    per_group[order[: max(total - int(per_group.sum()), 0)]] += 1

    ranks = _rank_within_groups(groups, num_groups, rng)
    test_mask = ranks < per_group[groups]
    return np.flatnonzero(~test_mask), np.flatnonzero(test_mask)


def partition_by_column(owners: np.ndarray, *, min_samples: int = 1) -> tuple[Partition, np.ndarray]:
    """Give each owner its own client: the natural partition of data that names its user or device (LEAF).

    Deterministic: client ``k`` is the ``k``-th owner (in increasing order of owner id) holding at least
    ``min_samples`` samples, and its indices are in sample order. Owners with fewer samples are dropped.

    Args:
        owners: Owner of each sample, non-negative integers (e.g. codes of a user column), shape ``(N,)``.
        min_samples: Samples an owner needs to become a client, ``>= 1``.

    Returns:
        ``(partition, kept)``: the partition, and the owner id of each client (``int64``, ascending).

    Raises:
        DataError: If the owners are not non-negative integers or no owner has ``min_samples`` samples.
        ValueError: If ``min_samples < 1``.
    """
    owners = _check_labels(owners)
    if min_samples < 1:
        raise ValueError(f"min_samples must be >= 1; got {min_samples}.")
    counts = np.bincount(owners) if owners.shape[0] else np.zeros(0, dtype=np.int64)
    kept = np.flatnonzero(counts >= min_samples)
    if kept.shape[0] == 0:
        raise DataError(f"no owner has {min_samples} or more samples; there are {owners.shape[0]} samples.")
    client_of = np.full(counts.shape[0], -1, dtype=np.int64)
    client_of[kept] = np.arange(kept.shape[0], dtype=np.int64)
    clients = client_of[owners]
    member = np.flatnonzero(clients >= 0)
    indices = member[np.argsort(clients[member], kind="stable")]
    return Partition(indices, _offsets(counts[kept])), kept.astype(np.int64)


@dataclass(frozen=True, slots=True, eq=False)
class Partition:
    """Map each client to the indices of its samples, stored compactly.

    Compressed-sparse-row layout: client ``k`` holds ``indices[offsets[k]:offsets[k + 1]]``, so a million
    clients cost two arrays. Both arrays are read-only views; ``partition[k]`` is a view into ``indices``.

    Attributes:
        indices: ``int64``, shape ``(total,)``, every client's sample indices one after another.
        offsets: ``int64``, shape ``(num_clients + 1,)``, non-decreasing from 0 to ``total``.

    Raises:
        DataError: If the arrays are not 1-d integer arrays forming a valid layout or an index is negative.
    """

    indices: np.ndarray
    offsets: np.ndarray

    def __post_init__(self) -> None:
        indices = _as_int64_vector(self.indices, "indices")
        offsets = _as_int64_vector(self.offsets, "offsets")
        if offsets.shape[0] < 1 or offsets[0] != 0 or offsets[-1] != indices.shape[0]:
            raise DataError(f"offsets must start at 0 and end at len(indices) = {indices.shape[0]}.")
        if np.any(np.diff(offsets) < 0):
            raise DataError("offsets must be non-decreasing.")
        if indices.shape[0] > 0 and indices.min() < 0:
            raise DataError(f"indices must be non-negative; found {int(indices.min())}.")
        # Read-only views: the caller's arrays keep their flags, and clients cannot overwrite each other.
        indices, offsets = indices.view(), offsets.view()
        indices.flags.writeable = False
        offsets.flags.writeable = False
        object.__setattr__(self, "indices", indices)
        object.__setattr__(self, "offsets", offsets)

    def __len__(self) -> int:
        """Return the number of clients."""
        return int(self.offsets.shape[0]) - 1

    def __getitem__(self, client: int) -> np.ndarray:
        """Return a read-only view of the sample indices of ``client`` (negative counts from the end)."""
        k = operator.index(client)
        n = len(self)
        if k < 0:
            k += n
        if not 0 <= k < n:
            raise IndexError(f"client {client} is out of range for a partition of {n} clients.")
        return self.indices[self.offsets[k] : self.offsets[k + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        """Iterate over the clients' index arrays in client order."""
        for k in range(len(self)):
            yield self.indices[self.offsets[k] : self.offsets[k + 1]]

    def __eq__(self, other: object) -> bool:
        """Return whether both partitions give every client the same indices in the same order."""
        if not isinstance(other, Partition):
            return NotImplemented
        return np.array_equal(self.offsets, other.offsets) and np.array_equal(self.indices, other.indices)

    __hash__ = None  # type: ignore[assignment]

    @property
    def sizes(self) -> np.ndarray:
        """Number of samples of each client, ``int64`` of shape ``(num_clients,)``."""
        return np.diff(self.offsets)

    def hold_out(self, share: float, generator: np.random.Generator) -> tuple[Partition, Partition]:
        """Split every client's samples into a training part and a held-out part for its own evaluation.

        Client ``k`` with ``n_k`` samples holds out ``min(floor(share * n_k), n_k - 1)`` of them, drawn uniformly with
        ``generator`` (one draw per sample, in index order: the same generator state gives the same split); both parts
        keep the partition's order of the indices. A client with one sample keeps it for training and holds out none.

        Args:
            share: Share of each client's samples held out, in ``(0, 1)``.
            generator: Where the draws come from.

        Returns:
            ``(train, held)``: two partitions of the same clients.
        """
        sizes = self.sizes
        held_sizes = np.minimum(np.floor(share * sizes).astype(np.int64), np.maximum(sizes - 1, 0))
        owner = np.repeat(np.arange(len(self), dtype=np.int64), sizes)
        keys = np.asarray(generator.random(self.indices.shape[0]), dtype=np.float64)
        order = np.lexsort((keys, owner))  # each client's samples, in the order of their draws
        rank = np.empty_like(order)
        rank[order] = np.arange(order.shape[0], dtype=np.int64) - np.repeat(self.offsets[:-1], sizes)
        held = rank < held_sizes[owner]
        train_offsets = np.concatenate(([0], np.cumsum(sizes - held_sizes)))
        held_offsets = np.concatenate(([0], np.cumsum(held_sizes)))
        return Partition(self.indices[~held], train_offsets), Partition(self.indices[held], held_offsets)

    @classmethod
    def from_lists(cls, parts: Sequence[np.ndarray]) -> Partition:
        """Build a partition from one index array per client.

        Args:
            parts: ``parts[k]`` holds the sample indices of client ``k``; 1-d integer arrays, possibly empty.

        Returns:
            The partition, which owns copies of the indices.

        Raises:
            DataError: If a part is not a 1-d integer array or holds a negative index.
        """
        arrays = [_as_int64_vector(np.asarray(part), f"part {k}") for k, part in enumerate(parts)]
        sizes = np.array([a.shape[0] for a in arrays], dtype=np.int64)
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        indices = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
        return cls(indices, offsets)


def partition_iid(num_samples: int, num_clients: int, *, rng: np.random.Generator) -> Partition:
    """Split samples uniformly at random into near-equal client shards (the IID baseline).

    Args:
        num_samples: Number of samples ``N``.
        num_clients: Number of clients ``K``, ``1 <= K <= N``.
        rng: Source of randomness.

    Returns:
        A partition of a random permutation of ``range(N)``; client sizes are ``N // K`` or ``N // K + 1``.

    Raises:
        DataError: If ``num_clients < 1`` or ``num_clients > num_samples``.
    """
    _check_client_count(num_samples, num_clients)
    base, extra = divmod(num_samples, num_clients)
    sizes = np.full(num_clients, base, dtype=np.int64)
    sizes[:extra] += 1
    return Partition(rng.permutation(num_samples).astype(np.int64, copy=False), _offsets(sizes))


def partition_dirichlet(
    labels: np.ndarray,
    num_clients: int,
    *,
    alpha: float,
    rng: np.random.Generator,
    min_samples: int = 1,
) -> Partition:
    """Split samples with label skew drawn from a symmetric Dirichlet distribution.

    Hsu, Qi & Brown, "Measuring the Effects of Non-Identical Data Distribution for Federated Visual
    Classification" (2019): for each class ``c``, draw ``p_c ~ Dir(alpha * 1_K)`` and give client ``k`` the
    share ``p_{c,k}`` of class ``c``'s (shuffled) samples, using ``floor`` of the cumulative shares as cut
    points. Small ``alpha`` gives each client few classes; large ``alpha`` approaches IID.

    A draw can leave clients with fewer than ``min_samples`` samples. Then the proportions of every class are
    redrawn, at most 10 draws in all; if the last draw still falls short, the shortfall is taken from the
    largest clients (levelling them down, never below ``min_samples``, each giving random samples of its own)
    and dealt at random to the short clients. Always terminates.

    Args:
        labels: Integer labels, shape ``(N,)``, non-negative.
        num_clients: Number of clients ``K``, ``1 <= K <= N``.
        alpha: Concentration ``alpha > 0``.
        rng: Source of randomness.
        min_samples: Fewest samples any client may hold, ``>= 0``.

    Returns:
        A partition of ``range(N)``; each client's indices are in random order.

    Raises:
        DataError: If the labels are not non-negative integers, ``num_clients < 1``, ``num_clients > N`` or
            ``num_clients * min_samples > N``.
        ValueError: If ``alpha`` is not a positive finite number or ``min_samples < 0``.
    """
    labels = _check_labels(labels)
    num_samples = labels.shape[0]
    _check_client_count(num_samples, num_clients)
    if not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be a positive finite number; got {alpha}.")
    if min_samples < 0:
        raise ValueError(f"min_samples must be >= 0; got {min_samples}.")
    if num_clients * min_samples > num_samples:
        raise DataError(f"cannot give each of {num_clients} clients {min_samples} samples from {num_samples} samples.")

    # Only the labels present get a Dirichlet row, so sparse label values cost nothing.
    _, dense_labels, class_sizes = np.unique(labels, return_inverse=True, return_counts=True)
    num_classes = class_sizes.shape[0]
    samples = _shuffled_by_label(dense_labels.reshape(-1), rng)
    counts = _dirichlet_counts(class_sizes, num_clients, alpha, rng)
    for _ in range(_MAX_DIRICHLET_DRAWS - 1):
        if counts.sum(axis=0).min() >= min_samples:
            break
        counts = _dirichlet_counts(class_sizes, num_clients, alpha, rng)
    client_sizes = counts.sum(axis=0)
    # Row-major (class, client) order matches `samples`, which is grouped by class.
    owner = np.repeat(np.tile(np.arange(num_clients, dtype=np.int64), num_classes), counts.ravel())
    if client_sizes.min() < min_samples:
        owner = _level_up(owner, client_sizes, min_samples, rng)
    return _group_by_owner(samples, owner, num_clients, rng)


def partition_shards(
    labels: np.ndarray, num_clients: int, *, shards_per_client: int = 2, rng: np.random.Generator
) -> Partition:
    """Split samples into label-sorted shards and deal each client a few (pathological non-IID).

    McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data"
    (AISTATS 2017): sort the samples by label, cut them into ``K * shards_per_client`` shards of near-equal
    size (sizes differ by at most one), and give each client ``shards_per_client`` shards chosen at random, so
    most clients see only ``shards_per_client`` classes. Samples of one label are shuffled before cutting.

    Args:
        labels: Integer labels, shape ``(N,)``, non-negative.
        num_clients: Number of clients ``K``, ``1 <= K <= N``.
        shards_per_client: Shards per client, ``>= 1``; ``K * shards_per_client <= N``.
        rng: Source of randomness.

    Returns:
        A partition of ``range(N)``; each client's indices are in random order.

    Raises:
        DataError: If the labels are not non-negative integers, ``num_clients < 1``, ``num_clients > N`` or
            there are more shards than samples.
        ValueError: If ``shards_per_client < 1``.
    """
    labels = _check_labels(labels)
    num_samples = labels.shape[0]
    _check_client_count(num_samples, num_clients)
    if shards_per_client < 1:
        raise ValueError(f"shards_per_client must be >= 1; got {shards_per_client}.")
    num_shards = num_clients * shards_per_client
    if num_shards > num_samples:
        raise DataError(
            f"cannot cut {num_samples} samples into {num_shards} shards "
            f"({num_clients} clients x {shards_per_client} shards each)."
        )
    samples = _shuffled_by_label(labels, rng)
    base, extra = divmod(num_samples, num_shards)
    shard_sizes = np.full(num_shards, base, dtype=np.int64)
    shard_sizes[:extra] += 1
    shard_owner = np.empty(num_shards, dtype=np.int64)
    shard_owner[rng.permutation(num_shards)] = np.arange(num_shards, dtype=np.int64) // shards_per_client
    owner = np.repeat(shard_owner, shard_sizes)
    return _group_by_owner(samples, owner, num_clients, rng)


def _check_label_range(y: torch.Tensor, num_classes: int) -> None:
    bad = (y < 0) | (y >= num_classes)
    if bool(bad.any()):
        index = int(torch.nonzero(bad)[0, 0])
        raise DataError(f"labels must be in [0, {num_classes}); found {int(y[index])} at index {index}.")


def _as_index_tensor(indices: np.ndarray | torch.Tensor) -> torch.Tensor:
    index = indices if isinstance(indices, torch.Tensor) else torch.from_numpy(np.asarray(indices))
    if index.dtype == torch.bool or index.is_floating_point() or index.is_complex():
        raise DataError(f"subset indices must be integers; got dtype {index.dtype}.")
    if index.dim() != 1:
        raise DataError(f"subset indices must be 1-d; got shape {tuple(index.shape)}.")
    return index.to(torch.int64)


def _feature_tensor(value: Any, item: int) -> torch.Tensor:
    try:
        tensor = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as error:
        raise DataError(f"x of item {item} cannot be converted to a tensor: {error}") from None
    if tensor.dtype == torch.bool or tensor.is_complex() or not (tensor.is_floating_point() or _is_int(tensor)):
        raise DataError(f"x of item {item} must be real numbers; got dtype {tensor.dtype}.")
    return tensor.detach().to(device="cpu", dtype=torch.float32)


def _is_int(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() and not tensor.is_complex() and tensor.dtype != torch.bool


def _label_int(value: Any, item: int) -> int:
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or not _is_int(value):
            raise DataError(
                f"label of item {item} must be an integer or a 0-d integer tensor; "
                f"got a tensor of shape {tuple(value.shape)} and dtype {value.dtype}."
            )
        label = int(value)
    elif isinstance(value, int | np.integer | np.ndarray) and not isinstance(value, bool | np.bool_):
        if isinstance(value, np.ndarray) and (value.ndim != 0 or value.dtype.kind not in "iu"):
            raise DataError(
                f"label of item {item} must be an integer or a 0-d integer array; "
                f"got an array of shape {value.shape} and dtype {value.dtype}."
            )
        label = int(value)
    else:
        raise DataError(f"label of item {item} must be an integer; got {type(value).__name__} {value!r}.")
    if label < 0:
        raise DataError(f"label of item {item} must be non-negative; got {label}.")
    return label


def _as_int64_vector(array: np.ndarray, name: str) -> np.ndarray:
    array = np.asarray(array)
    if array.ndim != 1:
        raise DataError(f"{name} must be 1-d; got shape {array.shape}.")
    if array.dtype.kind not in "iu":
        if array.shape[0] == 0:
            return np.zeros(0, dtype=np.int64)
        raise DataError(f"{name} must hold integers; got dtype {array.dtype}.")
    out = array.astype(np.int64, copy=False)
    if array.dtype.kind == "i" and out.shape[0] > 0 and out.min() < 0:
        raise DataError(f"{name} must be non-negative; found {int(out.min())}.")
    return np.ascontiguousarray(out)


def _check_labels(labels: np.ndarray) -> np.ndarray:
    array = np.asarray(labels)
    if array.ndim != 1:
        raise DataError(f"labels must be 1-d; got shape {array.shape}.")
    if array.shape[0] > 0 and array.dtype.kind not in "iu":
        raise DataError(f"labels must be integers; got dtype {array.dtype}.")
    array = array.astype(np.int64, copy=False)
    if array.shape[0] > 0 and array.min() < 0:
        raise DataError(f"labels must be non-negative; found {int(array.min())}.")
    return array


def _check_client_count(num_samples: int, num_clients: int) -> None:
    if num_clients < 1:
        raise DataError(f"num_clients must be >= 1; got {num_clients}.")
    if num_clients > num_samples:
        raise DataError(f"cannot split {num_samples} samples among {num_clients} clients; need one per client.")


def _offsets(sizes: np.ndarray) -> np.ndarray:
    offsets = np.zeros(sizes.shape[0] + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return offsets


def _shuffled_by_label(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Return all sample indices grouped by ascending label, in random order within each label."""
    permutation: np.ndarray = rng.permutation(labels.shape[0]).astype(np.int64, copy=False)
    grouped: np.ndarray = permutation[_stable_argsort(labels[permutation])]
    return grouped


def _rank_within_groups(groups: np.ndarray, num_groups: int, rng: np.random.Generator) -> np.ndarray:
    """Return, per sample, its position in a random order of the samples sharing its group."""
    ordered = _shuffled_by_label(groups, rng)
    starts = _offsets(np.bincount(groups, minlength=num_groups))[:-1]
    ranks = np.empty(groups.shape[0], dtype=np.int64)
    ranks[ordered] = np.arange(groups.shape[0], dtype=np.int64) - starts[groups[ordered]]
    return ranks


def _dirichlet_counts(class_sizes: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """Draw per-class client shares ``~ Dir(alpha)`` and round them to counts ``(classes, clients)``."""
    shares = rng.dirichlet(np.full(num_clients, alpha), size=class_sizes.shape[0])
    degenerate = ~np.isfinite(shares).all(axis=1) | (shares.sum(axis=1) <= 0)
    if degenerate.any():
        # Very small alpha can underflow every gamma variate of a row; the limit of Dir(alpha) is one-hot.
        shares[degenerate] = 0.0
        shares[degenerate, rng.integers(0, num_clients, size=int(degenerate.sum()))] = 1.0
    cumulative = np.cumsum(shares, axis=1)
    cumulative /= cumulative[:, -1:]
    cuts = np.floor(cumulative * class_sizes[:, None]).astype(np.int64)
    cuts[:, -1] = class_sizes
    cuts = np.minimum(np.maximum.accumulate(cuts, axis=1), class_sizes[:, None])
    counts: np.ndarray = np.diff(cuts, axis=1, prepend=np.zeros((cuts.shape[0], 1), dtype=np.int64))
    return counts


def _level_up(owner: np.ndarray, sizes: np.ndarray, min_samples: int, rng: np.random.Generator) -> np.ndarray:
    """Move random samples from the largest clients to those holding fewer than ``min_samples``.

    The donors are levelled down from the top (water-filling): every client above level ``L + 1`` is cut to
    ``L + 1`` and some at ``L + 1`` give one more, with ``L >= min_samples`` the highest level that frees
    enough.
    """
    deficit = (min_samples - sizes).clip(min=0)
    needed = int(deficit.sum())
    low, high = min_samples, int(sizes.max())
    # Highest level L with sum(max(sizes - L, 0)) >= needed; L = min_samples always qualifies.
    while low < high:
        mid = (low + high + 1) // 2
        if int((sizes - mid).clip(min=0).sum()) >= needed:
            low = mid
        else:
            high = mid - 1
    give = (sizes - (low + 1)).clip(min=0)
    short = needed - int(give.sum())
    at_top = np.flatnonzero(sizes - give >= low + 1)
    give[rng.permutation(at_top)[:short]] += 1

    ranks = _rank_within_groups(owner, sizes.shape[0], rng)
    moved = rng.permutation(np.flatnonzero(ranks < give[owner]))
    owner = owner.copy()
    owner[moved] = np.repeat(np.arange(sizes.shape[0], dtype=np.int64), deficit)
    return owner


def _group_by_owner(samples: np.ndarray, owner: np.ndarray, num_clients: int, rng: np.random.Generator) -> Partition:
    """Gather ``samples[i]`` into client ``owner[i]``, each client's samples in random order."""
    permutation = rng.permutation(samples.shape[0])
    order = permutation[_stable_argsort(owner[permutation])]
    return Partition(samples[order], _offsets(np.bincount(owner, minlength=num_clients)))


def _stable_argsort(keys: np.ndarray) -> np.ndarray:
    """Return the stable argsort of non-negative integer ``keys``.

    Keys below 65536 are narrowed to ``uint16`` first, for which numpy's stable sort is a radix sort (about
    ten times faster than its merge sort on ``int64``).
    """
    if keys.shape[0] > 0 and int(keys.max()) < 1 << 16:
        keys = keys.astype(np.uint16)
    order: np.ndarray = np.argsort(keys, kind="stable")
    return order


class LazyIIDPartition:
    """An IID split of ``N`` samples over ``K`` clients that stores nothing per client or per sample.

    Client ``k`` holds positions ``[offset_k, offset_{k+1})`` of a pseudo-random permutation of ``range(N)``, the
    affine bijection ``i -> (a * i + b) mod N`` with ``a`` coprime to ``N`` drawn from ``rng``; offsets follow from
    ``k`` alone (sizes ``N // K`` or ``N // K + 1``, larger ones first, as :func:`partition_iid`). Its indices are
    computed when a client is sampled, so a million clients over hundreds of millions of samples cost nothing until
    then. The permutation is cheap rather than uniform: good enough to spread a shuffled or synthetic data set.

    Args:
        num_samples: ``N``.
        num_clients: ``K``, ``1 <= K <= N``.
        rng: Draws ``a`` and ``b``.

    Raises:
        DataError: If ``num_clients < 1`` or ``num_clients > num_samples``.
    """

    def __init__(self, num_samples: int, num_clients: int, *, rng: np.random.Generator) -> None:
        """Draw the permutation's two numbers."""
        _check_client_count(num_samples, num_clients)
        self.num_samples = num_samples
        self.num_clients = num_clients
        self._base, self._extra = divmod(num_samples, num_clients)
        multiplier = int(rng.integers(1, max(num_samples, 2)))
        while math.gcd(multiplier, num_samples) != 1:
            multiplier = multiplier % num_samples + 1
        self._a = multiplier
        self._b = int(rng.integers(0, num_samples))

    def __len__(self) -> int:
        """Return the number of clients."""
        return self.num_clients

    def size(self, client: int) -> int:
        """Return the number of samples of ``client``."""
        return self._base + (1 if client < self._extra else 0)

    def offset(self, client: int) -> int:
        """Return the first permutation position of ``client``."""
        return client * self._base + min(client, self._extra)

    @property
    def sizes(self) -> np.ndarray:
        """Number of samples of each client, ``int64`` of shape ``(num_clients,)`` (built on each call)."""
        sizes = np.full(self.num_clients, self._base, dtype=np.int64)
        sizes[: self._extra] += 1
        return sizes

    def __getitem__(self, client: int) -> np.ndarray:
        """Return the sample indices of ``client`` (a new ``int64`` array)."""
        k = operator.index(client)
        if not 0 <= k < self.num_clients:
            raise IndexError(f"client {client} is out of range for a partition of {self.num_clients} clients.")
        positions = np.arange(self.offset(k), self.offset(k) + self.size(k), dtype=np.int64)
        indices: np.ndarray = (positions * self._a + self._b) % self.num_samples
        return indices


class SyntheticClients:
    """:func:`make_synthetic` data drawn per client on demand: client ``k``'s samples come from its own stream.

    Nothing is stored per client: ``client(k)`` draws ``sizes[k]`` samples from ``numpy_stream(seed, DATA, 2, k)``
    every time it is called (the same samples each time), so a population of any size costs its ``sizes`` array
    (nothing per client where that is one count broadcast over every client, ``np.broadcast_to``).

    Args:
        sizes: Samples per client (any integer dtype; kept as given, without a copy).
        num_features: Feature dimension.
        num_classes: Number of classes.
        seed: The run's seed.
    """

    def __init__(self, sizes: np.ndarray, *, num_features: int = 32, num_classes: int = 10, seed: int = 0) -> None:
        """Remember the sizes; draw nothing yet."""
        self.sizes = np.asarray(sizes)
        if not np.issubdtype(self.sizes.dtype, np.integer):
            raise DataError(f"sizes must be integers, got dtype {self.sizes.dtype}")
        self.num_features = num_features
        self.num_classes = num_classes
        self.seed = seed

    def __len__(self) -> int:
        """Return the number of clients."""
        return len(self.sizes)

    def client(self, k: int) -> ArrayData:
        """Draw client ``k``'s samples."""
        from flasync.core import (
            seeding,  # flasync.core.seeding imports nothing from here; kept local to keep data.py leaf
        )

        rng = seeding.numpy_stream(self.seed, seeding.DATA, 2, k)
        return make_synthetic(
            num_samples=int(self.sizes[k]), num_features=self.num_features, num_classes=self.num_classes, rng=rng
        )
