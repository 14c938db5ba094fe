"""A run's data from its config: the training and held-out sets, and the partition among clients.

A remote device that trains on its own share of the server's configured data set builds it with these functions too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flasync.config import (
    ByColumnPartition,
    DiabetesData,
    DigitsData,
    DirichletPartition,
    FeatureSkewPartition,
    FilesData,
    IIDPartition,
    LabelQuantityPartition,
    LineBlocksPartition,
    QuantityPartition,
    RunConfig,
    ShardsPartition,
    SyntheticData,
)
from flasync.core import seeding
from flasync.core.errors import DataError
from flasync.data import (
    ArrayData,
    Partition,
    SyntheticClients,
    from_dataset,
    load_diabetes,
    load_digits,
    make_synthetic,
    partition_by_column,
    partition_dirichlet,
    partition_iid,
    partition_shards,
    split_indices,
    train_test_split,
)
from flasync.data.files import load_files
from flasync.data.skew import (
    LazySkewedClients,
    apportion,
    client_size_weights,
    partition_label_quantity,
    partition_quantity,
    skew_features,
)
from flasync.data.text import load_text

__all__ = ["Loaded", "lazy_clients", "load", "partition"]


@dataclass(frozen=True, slots=True)
class Loaded:
    """The training and test data, and (``by_column``) each training sample's client."""

    train: ArrayData
    test: ArrayData
    partition: Partition | None = None
    files_sha256: str | None = None


def load(
    config: RunConfig,
    dataset: ArrayData | torch.utils.data.Dataset[Any] | None = None,
    test_dataset: ArrayData | torch.utils.data.Dataset[Any] | None = None,
) -> Loaded:
    """Load the training and held-out data a config names, or split a given data set.

    Args:
        config: The run's configuration.
        dataset: Training data instead of ``config.data``.
        test_dataset: Held-out data (default: a split of ``dataset``).

    Raises:
        DataError: If the files cannot be read or leave no held-out sample.
    """
    if dataset is None and isinstance(config.data, FilesData):
        loaded = _load_files(config, config.data)
    else:
        loaded = Loaded(*_load_arrays(config, dataset, test_dataset))
    part, source = config.partition, config.data
    lazy = isinstance(source, SyntheticData) and source.lazy and dataset is None
    if isinstance(part, FeatureSkewPartition) and not lazy:  # lazy clients skew their own draws
        # The split depends on the sample count and the seed only: the one partition() returns later.
        owned = partition(config, loaded.train)
        train = skew_features(loaded.train, owned, noise=part.noise, rotations=part.rotations, seed=config.seed)
        return Loaded(train, loaded.test, loaded.partition, loaded.files_sha256)
    return loaded


def _load_arrays(
    cfg: RunConfig,
    dataset: ArrayData | torch.utils.data.Dataset[Any] | None,
    test_dataset: ArrayData | torch.utils.data.Dataset[Any] | None,
) -> tuple[ArrayData, ArrayData]:
    if dataset is not None:
        train = dataset if isinstance(dataset, ArrayData) else from_dataset(dataset)
        if test_dataset is not None:
            test = (
                test_dataset
                if isinstance(test_dataset, ArrayData)
                else from_dataset(test_dataset, num_classes=train.num_classes)
            )
            return train, test
        fraction = cfg.data.test_fraction if isinstance(cfg.data, DigitsData | DiabetesData | FilesData) else 0.2
        return train_test_split(train, test_fraction=fraction, rng=seeding.numpy_stream(cfg.seed, seeding.DATA))
    source = cfg.data
    if isinstance(source, DiabetesData):
        return train_test_split(
            load_diabetes(), test_fraction=source.test_fraction, rng=seeding.numpy_stream(cfg.seed, seeding.DATA)
        )
    if isinstance(source, DigitsData):
        return train_test_split(
            load_digits(),
            test_fraction=source.test_fraction,
            rng=seeding.numpy_stream(cfg.seed, seeding.DATA),
        )
    assert isinstance(source, SyntheticData)
    test = make_synthetic(
        num_samples=source.test_samples,
        num_features=source.num_features,
        num_classes=source.num_classes,
        rng=seeding.numpy_stream(cfg.seed, seeding.DATA, 1),
    )
    if source.lazy:  # only a sample for shapes: clients draw their own data when sampled
        return lazy_clients(cfg).client(0), test
    train = make_synthetic(
        num_samples=source.samples_per_client * cfg.population.num_clients,
        num_features=source.num_features,
        num_classes=source.num_classes,
        rng=seeding.numpy_stream(cfg.seed, seeding.DATA, 0),
    )
    return train, test


def _load_files(cfg: RunConfig, source: FilesData) -> Loaded:
    """Read ``data.kind = "files"``; split off a test set if no test file is named; partition ``by_column``."""
    if source.text:
        files = load_text(source.train, source.test, context=source.context, num_clients=cfg.population.num_clients)
    else:
        files = load_files(
            source.train,
            source.test,
            features=source.features,
            label=source.label,
            client_column=source.client_column,
            num_classes=source.num_classes,
        )
    part = cfg.partition
    by_owner = isinstance(part, ByColumnPartition | LineBlocksPartition)
    train, test, owners = files.train, files.test, files.clients
    if test is None:
        # by_column holds out a share of every client's samples (LEAF's per-user split), else of every label's.
        if by_owner and owners is not None:
            groups, count, keep_one = owners, len(files.client_ids), True
        else:
            groups, count, keep_one = train.y.numpy(), train.num_classes, False
        rng = seeding.numpy_stream(cfg.seed, seeding.DATA)
        keep, held = split_indices(groups, count, test_fraction=source.test_fraction, rng=rng, keep_one=keep_one)
        if len(held) == 0:
            raise DataError(
                f"data.test_fraction: no client of {source.train} can spare a sample for the held-out split "
                "(each has one); name a data.test file"
            )
        train, test = train.subset(keep), train.subset(held)
        owners = owners[keep] if owners is not None else None
    partition = None
    if by_owner and owners is not None:
        min_samples = part.min_samples if isinstance(part, ByColumnPartition) else 1
        partition, _ = partition_by_column(owners, min_samples=min_samples)
    return Loaded(train, test, partition, files.sha256)


def lazy_clients(cfg: RunConfig) -> SyntheticClients:
    """Return the clients of a lazy synthetic source, each drawing its own data when sampled.

    Quantity skew draws the clients' sizes (one count per client, ``samples_per_client`` on average); label-quantity
    and feature skew apply to each client's own draw; the other partitions do not apply.
    """
    source, part, n = cfg.data, cfg.partition, cfg.population.num_clients
    assert isinstance(source, SyntheticData)
    features, classes, seed = source.num_features, source.num_classes, cfg.seed
    if isinstance(part, QuantityPartition):
        weights = client_size_weights(
            n,
            distribution=part.distribution,
            sigma=1.0 if part.sigma is None else part.sigma,
            exponent=2.0 if part.exponent is None else part.exponent,
            rng=seeding.numpy_stream(seed, seeding.PARTITION),
        )
        sizes = apportion(weights, source.samples_per_client * n, min_size=part.min_samples)
        return SyntheticClients(sizes, num_features=features, num_classes=classes, seed=seed)
    # One value seen through a zero stride: every client holds the same count, stored once.
    sizes = np.broadcast_to(np.int64(source.samples_per_client), (n,))
    if isinstance(part, LabelQuantityPartition | FeatureSkewPartition):
        labels = part.labels_per_client if isinstance(part, LabelQuantityPartition) else None
        noise, rotations = (part.noise, part.rotations) if isinstance(part, FeatureSkewPartition) else (0.0, 1)
        return LazySkewedClients(
            sizes,
            num_features=features,
            num_classes=classes,
            seed=seed,
            labels_per_client=labels,
            noise=noise,
            rotations=rotations,
        )
    return SyntheticClients(sizes, num_features=features, num_classes=classes, seed=seed)


def partition(cfg: RunConfig, train: ArrayData) -> Partition:
    """Split ``train`` among ``population.num_clients`` clients by the config's partition.

    Raises:
        DataError: If a client would get no sample.
    """
    n, rng = cfg.population.num_clients, seeding.numpy_stream(cfg.seed, seeding.PARTITION)
    if n > len(train):
        raise DataError(
            f"population.num_clients: {n} clients need one training sample each, but the data has {len(train)}"
        )
    part = cfg.partition
    if isinstance(part, IIDPartition):
        partition = partition_iid(len(train), n, rng=rng)
    elif isinstance(part, DirichletPartition):
        partition = partition_dirichlet(train.y.numpy(), n, alpha=part.alpha, rng=rng, min_samples=part.min_samples)
    elif isinstance(part, ShardsPartition):
        partition = partition_shards(train.y.numpy(), n, shards_per_client=part.shards_per_client, rng=rng)
    elif isinstance(part, LabelQuantityPartition):
        partition = partition_label_quantity(train.y.numpy(), n, labels_per_client=part.labels_per_client, rng=rng)
    elif isinstance(part, QuantityPartition):
        partition = partition_quantity(
            len(train),
            n,
            distribution=part.distribution,
            sigma=1.0 if part.sigma is None else part.sigma,
            exponent=2.0 if part.exponent is None else part.exponent,
            min_samples=part.min_samples,
            rng=rng,
        )
    else:
        assert isinstance(part, FeatureSkewPartition)
        partition = partition_iid(len(train), n, rng=rng)
    empty = np.flatnonzero(partition.sizes == 0)
    if len(empty):
        raise DataError(f"partition leaves {len(empty)} client(s) with 0 samples (first: client {empty[0]})")
    return partition
