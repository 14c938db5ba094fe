"""Tests of flasync.data: the in-memory data sets, the stratified split and the client partitioners."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flasync.core.errors import DataError
from flasync.data import (
    ArrayData,
    Partition,
    from_dataset,
    load_digits,
    make_synthetic,
    partition_by_column,
    partition_dirichlet,
    partition_iid,
    partition_shards,
    split_indices,
    train_test_split,
)

PROPERTY = settings(max_examples=60, deadline=None)


class ListDataset(torch.utils.data.Dataset[Any]):
    """Serve fixed items, whatever they are, as a map-style data set."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Any:
        return self.items[index]


class NoLenDataset(torch.utils.data.Dataset[Any]):
    """Serve items without defining ``__len__``."""

    def __getitem__(self, index: int) -> Any:
        return torch.zeros(2), 0


def _data(n: int = 6, num_classes: int = 3) -> ArrayData:
    return ArrayData(
        x=torch.arange(n * 2, dtype=torch.float32).reshape(n, 2),
        y=torch.arange(n, dtype=torch.int64) % num_classes,
        num_classes=num_classes,
    )


def _assert_exact_cover(partition: Partition, num_samples: int) -> None:
    assert partition.indices.dtype == np.int64
    assert partition.offsets.dtype == np.int64
    assert int(partition.sizes.sum()) == num_samples
    assert np.array_equal(np.sort(partition.indices), np.arange(num_samples))


# ----------------------------------------------------------------------------------------------- ArrayData
def test_array_data_reports_first_out_of_range_label() -> None:
    """A label outside [0, num_classes) is named with its value and index."""
    y = torch.tensor([0, 1, 2, 3, 4, 12, 13], dtype=torch.int64)
    with pytest.raises(DataError, match=r"labels must be in \[0, 10\); found 12 at index 5"):
        ArrayData(x=torch.zeros(7, 2), y=y, num_classes=10)


def test_array_data_rejects_negative_label() -> None:
    """A negative label is out of range."""
    with pytest.raises(DataError, match=r"found -1 at index 1"):
        ArrayData(x=torch.zeros(2, 2), y=torch.tensor([0, -1]), num_classes=2)


def test_array_data_rejects_length_mismatch() -> None:
    """x and y must have the same number of samples."""
    with pytest.raises(DataError, match="same length"):
        ArrayData(x=torch.zeros(3, 2), y=torch.zeros(2, dtype=torch.int64), num_classes=2)


def test_array_data_rejects_float64_features() -> None:
    """Features must be float32."""
    with pytest.raises(DataError, match="float32"):
        ArrayData(x=torch.zeros(2, 2, dtype=torch.float64), y=torch.zeros(2, dtype=torch.int64), num_classes=2)


def test_array_data_rejects_int32_labels() -> None:
    """Labels must be int64."""
    with pytest.raises(DataError, match="int64"):
        ArrayData(x=torch.zeros(2, 2), y=torch.zeros(2, dtype=torch.int32), num_classes=2)


def test_array_data_rejects_zero_classes() -> None:
    """num_classes must be at least 1."""
    with pytest.raises(DataError, match="num_classes"):
        ArrayData(x=torch.zeros(0, 2), y=torch.zeros(0, dtype=torch.int64), num_classes=0)


def test_array_data_makes_features_contiguous() -> None:
    """A non-contiguous feature tensor is stored contiguous with the same values."""
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    data = ArrayData(x=x, y=torch.zeros(4, dtype=torch.int64), num_classes=1)
    assert data.x.is_contiguous()
    assert torch.equal(data.x, x)


def test_array_data_reports_length_and_feature_shape() -> None:
    """len() counts samples and feature_shape drops the sample dimension."""
    data = ArrayData(x=torch.zeros(5, 1, 8, 8), y=torch.zeros(5, dtype=torch.int64), num_classes=10)
    assert len(data) == 5
    assert data.feature_shape == (1, 8, 8)


def test_subset_takes_rows_in_given_order() -> None:
    """subset returns the requested samples, in order, with the same num_classes."""
    data = _data()
    part = data.subset(np.array([4, 1, 1]))
    assert torch.equal(part.x, data.x[[4, 1, 1]])
    assert torch.equal(part.y, data.y[[4, 1, 1]])
    assert part.num_classes == data.num_classes


def test_subset_accepts_tensor_indices() -> None:
    """subset takes a torch index tensor as well as a numpy array."""
    data = _data()
    assert torch.equal(data.subset(torch.tensor([2, 0])).y, data.y[[2, 0]])


def test_subset_accepts_empty_indices() -> None:
    """An empty index array gives an empty data set with the same feature shape."""
    part = _data().subset(np.array([], dtype=np.int64))
    assert len(part) == 0
    assert part.feature_shape == (2,)


def test_subset_rejects_out_of_range_index() -> None:
    """An index past the end raises IndexError."""
    with pytest.raises(IndexError, match="out of range"):
        _data(n=6).subset(np.array([0, 6]))


def test_subset_rejects_boolean_mask() -> None:
    """A boolean mask is not mistaken for the indices 0 and 1."""
    with pytest.raises(DataError, match="integers"):
        _data().subset(np.ones(6, dtype=bool))


# ------------------------------------------------------------------------------------------------- digits
def test_load_digits_shapes_and_ranges() -> None:
    """Digits has 1797 float32 rows of 64 pixels in [0, 1] and all 10 labels."""
    data = load_digits()
    assert data.x.shape == (1797, 64)
    assert data.x.dtype == torch.float32
    assert data.y.dtype == torch.int64
    assert data.num_classes == 10
    assert float(data.x.min()) == 0.0
    assert float(data.x.max()) == 1.0
    assert set(data.y.tolist()) == set(range(10))


def test_load_digits_is_scikit_learns_data_set() -> None:
    """The digits read from scikit-learn's bundled file are its ``load_digits`` rows and labels, in order."""
    from sklearn.datasets import load_digits as sklearn_load_digits

    features, labels = sklearn_load_digits(return_X_y=True)
    data = load_digits()
    assert torch.equal(data.x, torch.from_numpy((features / 16.0).astype(np.float32)))
    assert torch.equal(data.y, torch.from_numpy(labels.astype(np.int64)))


@pytest.mark.slow
def test_load_digits_imports_neither_scikit_learn_nor_scipy() -> None:
    """Loading digits leaves scikit-learn, SciPy and pandas unimported (their heaps would set off full collections)."""
    code = (
        "import sys; from flasync.data import load_digits; load_digits(); "
        "print(sorted(m for m in ('sklearn', 'scipy', 'pandas') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------- synthetic
def test_make_synthetic_shifts_label_coordinate_by_two() -> None:
    """For class c, coordinate c mod d has mean about 2; the other coordinates have mean about 0."""
    data = make_synthetic(num_samples=20_000, num_features=32, num_classes=10, rng=np.random.default_rng(0))
    for c in range(10):
        rows = data.x[data.y == c]
        assert abs(float(rows[:, c].mean()) - 2.0) < 0.1
        others = torch.cat([rows[:, :c], rows[:, c + 1 :]], dim=1)
        assert abs(float(others.mean())) < 0.05


def test_make_synthetic_wraps_classes_beyond_features() -> None:
    """With more classes than features, class c shifts coordinate c mod d."""
    data = make_synthetic(num_samples=20_000, num_features=4, num_classes=10, rng=np.random.default_rng(1))
    rows = data.x[data.y == 9]
    assert abs(float(rows[:, 9 % 4].mean()) - 2.0) < 0.15


def test_make_synthetic_shapes_and_dtypes() -> None:
    """The synthetic set has the requested shape, float32 features and labels in range."""
    data = make_synthetic(num_samples=50, num_features=7, num_classes=3, rng=np.random.default_rng(2))
    assert data.x.shape == (50, 7)
    assert data.x.dtype == torch.float32
    assert data.num_classes == 3
    assert int(data.y.min()) >= 0
    assert int(data.y.max()) < 3


def test_make_synthetic_is_deterministic_per_seed() -> None:
    """The same seed gives the same data set."""
    a = make_synthetic(num_samples=100, rng=np.random.default_rng(3))
    b = make_synthetic(num_samples=100, rng=np.random.default_rng(3))
    assert torch.equal(a.x, b.x)
    assert torch.equal(a.y, b.y)


# ------------------------------------------------------------------------------------------- from_dataset
def test_from_dataset_materialises_pairs() -> None:
    """A custom Dataset of (tensor, int) pairs becomes stacked float32 features and int64 labels."""
    items = [(torch.full((2, 3), float(i)), i % 4) for i in range(5)]
    data = from_dataset(ListDataset(items))
    assert data.x.shape == (5, 2, 3)
    assert data.x.dtype == torch.float32
    assert data.x.is_contiguous()
    assert data.y.tolist() == [0, 1, 2, 3, 0]
    assert torch.equal(data.x[3], torch.full((2, 3), 3.0))


def test_from_dataset_infers_num_classes_from_max_label() -> None:
    """Without num_classes, it is the largest label plus one."""
    data = from_dataset(ListDataset([(torch.zeros(2), 0), (torch.zeros(2), 6)]))
    assert data.num_classes == 7


def test_from_dataset_uses_given_num_classes() -> None:
    """An explicit num_classes is kept even if some classes are absent."""
    data = from_dataset(ListDataset([(torch.zeros(2), 1)]), num_classes=10)
    assert data.num_classes == 10


def test_from_dataset_accepts_tensor_and_numpy_labels() -> None:
    """0-d integer tensors, numpy integers and lists of numbers are accepted."""
    items = [([1.0, 2.0], torch.tensor(2)), (np.array([3, 4], dtype=np.uint8), np.int64(0))]
    data = from_dataset(ListDataset(items))
    assert data.y.tolist() == [2, 0]
    assert torch.equal(data.x, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))


def test_from_dataset_accepts_tensor_dataset() -> None:
    """torch's own TensorDataset round-trips."""
    x, y = torch.randn(4, 3, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 1, 0])
    data = from_dataset(torch.utils.data.TensorDataset(x, y))
    assert torch.equal(data.x, x)
    assert torch.equal(data.y, y)


def test_from_dataset_rejects_empty_dataset() -> None:
    """An empty data set cannot be materialised."""
    with pytest.raises(DataError, match="empty"):
        from_dataset(ListDataset([]))


def test_from_dataset_rejects_dataset_without_len() -> None:
    """A data set without __len__ is refused with a message naming its type."""
    with pytest.raises(DataError, match="NoLenDataset"):
        from_dataset(NoLenDataset())


def test_from_dataset_rejects_item_that_is_not_a_pair() -> None:
    """An item that is a bare tensor is not an (x, y) pair."""
    with pytest.raises(DataError, match=r"item 0 .* \(x, y\) pair"):
        from_dataset(ListDataset([torch.zeros(2)]))


def test_from_dataset_rejects_triple() -> None:
    """An (x, y, extra) triple is not an (x, y) pair."""
    with pytest.raises(DataError, match=r"item 1 .* \(x, y\) pair"):
        from_dataset(ListDataset([(torch.zeros(2), 0), (torch.zeros(2), 0, "extra")]))


def test_from_dataset_rejects_inconsistent_shapes() -> None:
    """Features of different shapes cannot be stacked; the message names the item and both shapes."""
    with pytest.raises(DataError, match=r"item 2 has x of shape \(3,\), but item 0 has shape \(2,\)"):
        from_dataset(ListDataset([(torch.zeros(2), 0), (torch.zeros(2), 1), (torch.zeros(3), 0)]))


def test_from_dataset_rejects_non_numeric_features() -> None:
    """Features that are strings cannot become a tensor."""
    with pytest.raises(DataError, match="item 0"):
        from_dataset(ListDataset([("pixels", 0)]))


@pytest.mark.parametrize("label", [1.5, 1.0, torch.tensor(1.0), torch.tensor([1]), "1", None, True])
def test_from_dataset_rejects_non_integer_label(label: Any) -> None:
    """Floats, 1-d tensors, strings, None and booleans are not integer labels."""
    with pytest.raises(DataError, match="label of item 1 must be an integer"):
        from_dataset(ListDataset([(torch.zeros(2), 0), (torch.zeros(2), label)]))


def test_from_dataset_rejects_negative_label() -> None:
    """A negative label is refused with the item's index."""
    with pytest.raises(DataError, match="label of item 1 must be non-negative; got -3"):
        from_dataset(ListDataset([(torch.zeros(2), 0), (torch.zeros(2), -3)]))


def test_from_dataset_rejects_label_at_least_num_classes() -> None:
    """A label >= num_classes is out of range."""
    with pytest.raises(DataError, match=r"labels must be in \[0, 3\); found 3 at index 1"):
        from_dataset(ListDataset([(torch.zeros(2), 0), (torch.zeros(2), 3)]), num_classes=3)


# --------------------------------------------------------------------------------------- train_test_split
def test_train_test_split_keeps_label_proportions() -> None:
    """Each class contributes floor or ceil of test_fraction times its size to the test set."""
    data = load_digits()
    train, test = train_test_split(data, test_fraction=0.25, rng=np.random.default_rng(0))
    class_sizes = np.bincount(data.y.numpy(), minlength=10)
    test_sizes = np.bincount(test.y.numpy(), minlength=10)
    assert np.all(np.abs(test_sizes - 0.25 * class_sizes) < 1.0)
    assert len(test) == round(0.25 * len(data))
    assert len(train) + len(test) == len(data)


@PROPERTY
@given(
    seed=st.integers(0, 2**32 - 1),
    num_samples=st.integers(2, 300),
    num_classes=st.integers(1, 12),
    test_fraction=st.floats(0.01, 0.99),
)
def test_train_test_split_is_stratified_partition(
    seed: int, num_samples: int, num_classes: int, test_fraction: float
) -> None:
    """The split covers every sample once and each class's test share is within one sample of its quota."""
    rng = np.random.default_rng(seed)
    # Skewed labels so that small classes exist.
    labels = np.minimum(rng.geometric(0.3, size=num_samples) - 1, num_classes - 1)
    data = ArrayData(
        x=torch.arange(num_samples, dtype=torch.float32)[:, None],
        y=torch.from_numpy(labels.astype(np.int64)),
        num_classes=num_classes,
    )
    train, test = train_test_split(data, test_fraction=test_fraction, rng=rng)
    ids = np.concatenate([train.x[:, 0].numpy(), test.x[:, 0].numpy()]).astype(np.int64)
    assert np.array_equal(np.sort(ids), np.arange(num_samples))
    assert len(test) == min(max(round(test_fraction * num_samples), 1), num_samples - 1)
    quota = test_fraction * np.bincount(labels, minlength=num_classes)
    assert np.all(np.abs(np.bincount(test.y.numpy(), minlength=num_classes) - quota) < 1.0 + 1e-9)


def test_train_test_split_is_deterministic_per_seed() -> None:
    """The same seed gives the same split."""
    data = load_digits()
    a = train_test_split(data, test_fraction=0.2, rng=np.random.default_rng(5))[1]
    b = train_test_split(data, test_fraction=0.2, rng=np.random.default_rng(5))[1]
    assert torch.equal(a.x, b.x)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5, math.nan])
def test_train_test_split_rejects_fraction_outside_open_unit_interval(fraction: float) -> None:
    """test_fraction must lie strictly between 0 and 1."""
    with pytest.raises(ValueError, match="test_fraction"):
        train_test_split(_data(), test_fraction=fraction, rng=np.random.default_rng(0))


def test_train_test_split_rejects_single_sample() -> None:
    """One sample cannot be split into two non-empty sets."""
    with pytest.raises(DataError, match="at least 2"):
        train_test_split(_data(n=1), test_fraction=0.5, rng=np.random.default_rng(0))


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), num_samples=st.integers(2, 200), test_fraction=st.floats(0.01, 0.99))
def test_split_indices_keep_one_leaves_every_group_a_training_sample(
    seed: int, num_samples: int, test_fraction: float
) -> None:
    """With keep_one every group keeps a training sample, no group gives more than its quota rounded up, and
    the split covers every sample once."""
    rng = np.random.default_rng(seed)
    groups = rng.geometric(0.4, size=num_samples) - 1  # many groups of one or two samples
    num_groups = int(groups.max()) + 1
    train, test = split_indices(groups, num_groups, test_fraction=test_fraction, rng=rng, keep_one=True)
    assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(num_samples))
    sizes = np.bincount(groups, minlength=num_groups)
    assert np.array_equal(np.bincount(groups[train], minlength=num_groups) > 0, sizes > 0)
    assert np.all(np.bincount(groups[test], minlength=num_groups) <= np.ceil(test_fraction * sizes))
    assert len(test) <= min(max(round(test_fraction * num_samples), 1), num_samples - 1)


def test_split_indices_without_keep_one_is_train_test_split() -> None:
    """train_test_split is split_indices over the labels: same seed, same test samples."""
    data = load_digits()
    _, test = train_test_split(data, test_fraction=0.2, rng=np.random.default_rng(3))
    _, held = split_indices(data.y.numpy(), 10, test_fraction=0.2, rng=np.random.default_rng(3))
    assert torch.equal(test.x, data.x[held])


def test_split_indices_keep_one_moves_the_extra_sample_elsewhere() -> None:
    """A group of one sample, whose remainder is the largest, gives nothing; another group gives instead."""
    groups = np.array([0, 1, 1, 1, 1])  # quotas at 0.3: 0.3 and 1.2 -> the extra goes to group 0 without keep_one
    _, test = split_indices(groups, 2, test_fraction=0.3, rng=np.random.default_rng(0))
    assert 0 in test
    _, test = split_indices(groups, 2, test_fraction=0.3, rng=np.random.default_rng(0), keep_one=True)
    assert 0 not in test and len(test) == 2


# ---------------------------------------------------------------------------------------------- Partition
def test_partition_from_lists_round_trips() -> None:
    """Each client gets back its own indices, and sizes and len match the lists."""
    parts = [np.array([3, 1]), np.array([], dtype=np.int64), np.array([0, 2, 4])]
    partition = Partition.from_lists(parts)
    assert len(partition) == 3
    assert partition.sizes.tolist() == [2, 0, 3]
    for k, part in enumerate(parts):
        assert np.array_equal(partition[k], part)
    assert [p.tolist() for p in partition] == [[3, 1], [], [0, 2, 4]]


def test_partition_from_empty_list_has_no_clients() -> None:
    """Zero parts give a partition of zero clients."""
    assert len(Partition.from_lists([])) == 0


def test_partition_getitem_counts_negative_clients_from_the_end() -> None:
    """partition[-1] is the last client."""
    partition = Partition.from_lists([np.array([0]), np.array([1, 2])])
    assert partition[-1].tolist() == [1, 2]


def test_partition_getitem_rejects_out_of_range_client() -> None:
    """A client past the end raises IndexError."""
    with pytest.raises(IndexError, match="client 2"):
        Partition.from_lists([np.array([0]), np.array([1])])[2]


def test_partition_views_are_read_only() -> None:
    """A client's index view cannot be written through."""
    partition = Partition.from_lists([np.array([0, 1])])
    with pytest.raises(ValueError, match="read-only"):
        partition[0][0] = 5


def test_partition_leaves_caller_arrays_writable() -> None:
    """Building a partition does not freeze the caller's own arrays."""
    indices, offsets = np.array([1, 0], dtype=np.int64), np.array([0, 1, 2], dtype=np.int64)
    Partition(indices, offsets)
    indices[0] = 7
    assert indices.flags.writeable


@pytest.mark.parametrize(
    ("indices", "offsets"),
    [
        ([0, 1], [0, 1]),  # does not end at len(indices)
        ([0, 1], [1, 2]),  # does not start at 0
        ([0, 1], [0, 2, 1, 2]),  # decreasing
        ([0, -1], [0, 2]),  # negative index
        ([0.0, 1.0], [0, 2]),  # float indices
    ],
)
def test_partition_rejects_invalid_layout(indices: list[float], offsets: list[int]) -> None:
    """Offsets must run from 0 to len(indices) without decreasing over non-negative integer indices."""
    with pytest.raises(DataError):
        Partition(np.array(indices), np.array(offsets))


def test_partition_equality_compares_contents() -> None:
    """Partitions with the same clients and indices are equal; a different order is not."""
    a = Partition.from_lists([np.array([0, 1]), np.array([2])])
    assert a == Partition.from_lists([np.array([0, 1]), np.array([2])])
    assert a != Partition.from_lists([np.array([1, 0]), np.array([2])])


# ------------------------------------------------------------------------------------------- partitioners
sizes = st.integers(1, 400).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n)))


@PROPERTY
@given(sizes=sizes, seed=st.integers(0, 2**32 - 1))
def test_partition_iid_assigns_every_sample_once_in_near_equal_shares(sizes: tuple[int, int], seed: int) -> None:
    """IID gives each sample to one client, and client sizes differ by at most one."""
    num_samples, num_clients = sizes
    partition = partition_iid(num_samples, num_clients, rng=np.random.default_rng(seed))
    assert len(partition) == num_clients
    _assert_exact_cover(partition, num_samples)
    assert int(partition.sizes.max() - partition.sizes.min()) <= 1


@PROPERTY
@given(
    sizes=sizes,
    num_classes=st.integers(1, 20),
    alpha=st.sampled_from([0.01, 0.05, 0.3, 1.0, 100.0]),
    min_fraction=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_partition_dirichlet_assigns_every_sample_once_and_honours_min_samples(
    sizes: tuple[int, int], num_classes: int, alpha: float, min_fraction: float, seed: int
) -> None:
    """Dirichlet gives each sample to one client and every client at least min_samples."""
    num_samples, num_clients = sizes
    min_samples = int(min_fraction * (num_samples // num_clients))
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, size=num_samples)
    partition = partition_dirichlet(labels, num_clients, alpha=alpha, rng=rng, min_samples=min_samples)
    assert len(partition) == num_clients
    _assert_exact_cover(partition, num_samples)
    assert int(partition.sizes.min()) >= min_samples


def test_partition_dirichlet_repairs_small_alpha_with_many_clients() -> None:
    """With alpha=0.05, 500 clients and 10 classes, no client is left below min_samples."""
    labels = np.random.default_rng(0).integers(0, 10, size=20_000)
    partition = partition_dirichlet(labels, 500, alpha=0.05, rng=np.random.default_rng(1), min_samples=20)
    _assert_exact_cover(partition, 20_000)
    assert int(partition.sizes.min()) >= 20


def test_partition_dirichlet_uses_all_samples_when_min_samples_is_tight() -> None:
    """num_clients * min_samples == num_samples forces exactly min_samples per client."""
    labels = np.random.default_rng(0).integers(0, 5, size=300)
    partition = partition_dirichlet(labels, 30, alpha=0.1, rng=np.random.default_rng(2), min_samples=10)
    assert partition.sizes.tolist() == [10] * 30


def test_partition_dirichlet_small_alpha_skews_labels() -> None:
    """Small alpha gives clients few labels each; large alpha gives them nearly all labels."""
    labels = np.repeat(np.arange(10), 1000)

    def mean_labels_per_client(alpha: float) -> float:
        partition = partition_dirichlet(labels, 20, alpha=alpha, rng=np.random.default_rng(3))
        return float(np.mean([np.unique(labels[p]).size for p in partition]))

    assert mean_labels_per_client(0.05) < 4.0
    assert mean_labels_per_client(100.0) == 10.0


def test_partition_dirichlet_rejects_impossible_min_samples() -> None:
    """num_clients * min_samples > num_samples is a DataError naming the numbers."""
    with pytest.raises(DataError, match="10 clients 11 samples from 100 samples"):
        partition_dirichlet(np.zeros(100, dtype=np.int64), 10, alpha=1.0, rng=np.random.default_rng(0), min_samples=11)


@pytest.mark.parametrize("alpha", [0.0, -1.0, math.inf, math.nan])
def test_partition_dirichlet_rejects_invalid_alpha(alpha: float) -> None:
    """alpha must be a positive finite number."""
    with pytest.raises(ValueError, match="alpha"):
        partition_dirichlet(np.zeros(10, dtype=np.int64), 2, alpha=alpha, rng=np.random.default_rng(0))


@PROPERTY
@given(
    num_clients=st.integers(1, 40),
    shards_per_client=st.integers(1, 4),
    extra=st.integers(0, 200),
    num_classes=st.integers(1, 15),
    seed=st.integers(0, 2**32 - 1),
)
def test_partition_shards_assigns_every_sample_once(
    num_clients: int, shards_per_client: int, extra: int, num_classes: int, seed: int
) -> None:
    """Shards gives each sample to one client, each client shards_per_client near-equal shards."""
    num_samples = num_clients * shards_per_client + extra
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, size=num_samples)
    partition = partition_shards(labels, num_clients, shards_per_client=shards_per_client, rng=rng)
    assert len(partition) == num_clients
    _assert_exact_cover(partition, num_samples)
    shard_size = num_samples // (num_clients * shards_per_client)
    assert int(partition.sizes.min()) >= shards_per_client * shard_size
    assert int(partition.sizes.max()) <= shards_per_client * (shard_size + 1)


def test_partition_shards_gives_each_client_few_labels() -> None:
    """With label-pure shards, each client sees at most shards_per_client labels (McMahan et al. 2017)."""
    labels = np.repeat(np.arange(10), 100)
    partition = partition_shards(labels, 50, shards_per_client=2, rng=np.random.default_rng(0))
    assert max(np.unique(labels[p]).size for p in partition) <= 2


def test_partition_shards_rejects_more_shards_than_samples() -> None:
    """Cutting N samples into more than N shards is a DataError."""
    with pytest.raises(DataError, match="cannot cut 10 samples into 12 shards"):
        partition_shards(np.zeros(10, dtype=np.int64), 6, shards_per_client=2, rng=np.random.default_rng(0))


def test_partition_shards_rejects_zero_shards_per_client() -> None:
    """shards_per_client must be at least 1."""
    with pytest.raises(ValueError, match="shards_per_client"):
        partition_shards(np.zeros(10, dtype=np.int64), 2, shards_per_client=0, rng=np.random.default_rng(0))


Partitioner = Callable[[np.ndarray, int, np.random.Generator], Partition]
PARTITIONERS: dict[str, Partitioner] = {
    "iid": lambda labels, k, rng: partition_iid(labels.shape[0], k, rng=rng),
    "dirichlet": lambda labels, k, rng: partition_dirichlet(labels, k, alpha=0.1, rng=rng),
    "shards": lambda labels, k, rng: partition_shards(labels, k, shards_per_client=1, rng=rng),
}


@pytest.mark.parametrize("name", sorted(PARTITIONERS))
def test_partitioner_is_deterministic_per_seed(name: str) -> None:
    """The same seed gives the same partition."""
    labels = np.random.default_rng(0).integers(0, 10, size=1000)
    partition = PARTITIONERS[name]
    assert partition(labels, 30, np.random.default_rng(7)) == partition(labels, 30, np.random.default_rng(7))


@pytest.mark.parametrize("name", sorted(PARTITIONERS))
def test_partitioner_rejects_zero_clients(name: str) -> None:
    """num_clients must be at least 1."""
    with pytest.raises(DataError, match="num_clients must be >= 1"):
        PARTITIONERS[name](np.zeros(10, dtype=np.int64), 0, np.random.default_rng(0))


@pytest.mark.parametrize("name", sorted(PARTITIONERS))
def test_partitioner_rejects_more_clients_than_samples(name: str) -> None:
    """More clients than samples is a DataError."""
    with pytest.raises(DataError, match="cannot split 10 samples among 11 clients"):
        PARTITIONERS[name](np.zeros(10, dtype=np.int64), 11, np.random.default_rng(0))


@pytest.mark.parametrize("name", ["dirichlet", "shards"])
def test_partitioner_rejects_negative_labels(name: str) -> None:
    """Labels must be non-negative."""
    with pytest.raises(DataError, match="non-negative"):
        PARTITIONERS[name](np.array([0, 1, -1, 2]), 2, np.random.default_rng(0))


@pytest.mark.parametrize("name", ["dirichlet", "shards"])
def test_partitioner_rejects_float_labels(name: str) -> None:
    """Labels must be integers."""
    with pytest.raises(DataError, match="integers"):
        PARTITIONERS[name](np.array([0.0, 1.0, 2.0]), 2, np.random.default_rng(0))


def test_partition_dirichlet_handles_sparse_label_values() -> None:
    """Labels with huge gaps (0 and 10**9) are partitioned without a row per unused class."""
    labels = np.repeat(np.array([0, 10**9]), 50)
    partition = partition_dirichlet(labels, 4, alpha=0.5, rng=np.random.default_rng(0))
    _assert_exact_cover(partition, 100)


def test_lazy_iid_partition_covers_every_sample_once() -> None:
    """The lazy IID split gives each sample to exactly one client, with partition_iid's sizes."""
    from flasync.data import LazyIIDPartition

    partition = LazyIIDPartition(1003, 10, rng=np.random.default_rng(0))
    parts = [partition[k] for k in range(len(partition))]
    assert sorted(np.concatenate(parts).tolist()) == list(range(1003))
    assert [len(p) for p in parts] == partition.sizes.tolist() == [101, 101, 101, 100, 100, 100, 100, 100, 100, 100]
    with pytest.raises(IndexError, match="client 10 is out of range"):
        partition[10]


def test_synthetic_clients_draw_the_same_samples_every_time() -> None:
    """A client's lazily drawn samples are a function of the seed and its id only."""
    from flasync.data import SyntheticClients

    clients = SyntheticClients(np.array([3, 5, 7]), num_features=4, num_classes=3, seed=1)
    first, again, other = clients.client(1), clients.client(1), clients.client(2)
    assert first.x.shape == (5, 4) and other.x.shape == (7, 4)
    assert torch.equal(first.x, again.x) and torch.equal(first.y, again.y)


# ------------------------------------------------------------------------------------------------ by column
def test_partition_by_column_gives_each_owner_its_samples_in_order() -> None:
    """Client k holds the samples of the k-th owner id, in sample order; nothing is random."""
    owners = np.array([2, 0, 2, 1, 0, 2])
    partition, kept = partition_by_column(owners)
    assert kept.tolist() == [0, 1, 2]
    assert [part.tolist() for part in partition] == [[1, 4], [3], [0, 2, 5]]


def test_partition_by_column_drops_owners_below_min_samples() -> None:
    """Owners with fewer than min_samples samples (or none) are not clients; the rest keep their order."""
    owners = np.array([3, 0, 3, 1, 0, 3])  # owner 2 has no samples
    partition, kept = partition_by_column(owners, min_samples=2)
    assert kept.tolist() == [0, 3]
    assert [part.tolist() for part in partition] == [[1, 4], [0, 2, 5]]


def test_partition_by_column_refuses_when_no_owner_qualifies() -> None:
    """No owner with min_samples samples is a data error."""
    with pytest.raises(DataError, match="no owner has 3 or more samples"):
        partition_by_column(np.array([0, 1, 1]), min_samples=3)
    with pytest.raises(DataError, match="non-negative"):
        partition_by_column(np.array([0, -1]))


def test_holding_out_splits_every_client_apart_and_repeatably() -> None:
    """Each client holds out floor(share * n) of its samples (at most n - 1), disjoint from the ones it trains on,
    the same for the same generator state."""
    import numpy as np

    from flasync.data import Partition

    partition = Partition.from_lists([np.arange(0, 10), np.arange(10, 11), np.arange(11, 16), np.array([], dtype=int)])
    train, held = partition.hold_out(0.3, np.random.default_rng(7))
    assert held.sizes.tolist() == [3, 0, 1, 0] and train.sizes.tolist() == [7, 1, 4, 0]
    for k in range(4):
        assert sorted([*train[k], *held[k]]) == sorted(partition[k])
        assert list(train[k]) == [i for i in partition[k] if i in set(train[k])]  # the partition's order is kept
    again = partition.hold_out(0.3, np.random.default_rng(7))
    assert again == (train, held)
