"""Tests of flasync.data.skew: label-quantity, quantity and feature skew, and their statistics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from flasync.config import RunConfig
from flasync.core.errors import DataError
from flasync.data import ArrayData, SyntheticClients, make_synthetic, partition_iid, prepare
from flasync.data.skew import (
    LazySkewedClients,
    apportion,
    client_labels,
    client_size_weights,
    feature_noise_levels,
    partition_label_quantity,
    partition_quantity,
    rotation_matrix,
    skew_features,
)


def _labels(n: int, classes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, classes, size=n)


@pytest.mark.parametrize(("clients", "k"), [(10, 1), (37, 2), (100, 3), (4, 10)])
def test_label_quantity_gives_every_client_exactly_k_labels(clients: int, k: int) -> None:
    """Each client's samples carry exactly k distinct labels, and every sample is used once."""
    labels = _labels(5000, 10)
    part = partition_label_quantity(labels, clients, labels_per_client=k, rng=np.random.default_rng(1))
    assert len(part) == clients
    assert all(len(np.unique(labels[rows])) == k for rows in part)
    # With K >= C every label has a holder, so the partition covers every sample exactly once.
    assert np.array_equal(np.sort(part.indices), np.arange(5000))


def test_label_quantity_deals_each_label_evenly_among_its_holders() -> None:
    """A label's samples go in parts differing by at most one to the clients holding it."""
    labels = _labels(3000, 10)
    part = partition_label_quantity(labels, 25, labels_per_client=2, rng=np.random.default_rng(2))
    for label in range(10):
        shares = [int((labels[rows] == label).sum()) for rows in part]
        held = [s for s in shares if s > 0]
        assert max(held) - min(held) <= 1
        assert sum(held) == int((labels == label).sum())


def test_client_labels_start_with_the_client_id_mod_classes() -> None:
    """Client i holds label i mod C (every label has a holder once K >= C), and k distinct labels in all."""
    held = client_labels(10, 30, 3, np.random.default_rng(0))
    assert held.shape == (30, 3)
    assert all(i % 10 in held[i] for i in range(30))
    assert all(len(set(row)) == 3 for row in held.tolist())


def test_label_quantity_is_seeded() -> None:
    """The same generator seed gives the same partition; another seed, another one."""
    labels = _labels(2000, 10)

    def draw(seed: int) -> object:
        return partition_label_quantity(labels, 20, labels_per_client=2, rng=np.random.default_rng(seed))

    assert draw(5) == draw(5)
    assert draw(5) != draw(6)


def test_label_quantity_refuses_more_labels_than_present_and_too_few_samples() -> None:
    """k above the labels present, or a label with fewer samples than holders, is a one-line DataError."""
    labels = _labels(500, 10)
    with pytest.raises(DataError, match=r"labels_per_client: must be in 1\.\.10"):
        partition_label_quantity(labels, 5, labels_per_client=11, rng=np.random.default_rng(0))
    rare = np.concatenate([np.zeros(200, dtype=np.int64), np.ones(2, dtype=np.int64)])
    with pytest.raises(DataError, match="label 1 has 2 samples for"):
        partition_label_quantity(rare, 10, labels_per_client=2, rng=np.random.default_rng(0))


def test_lognormal_sizes_have_the_configured_log_spread() -> None:
    """Log client sizes of a lognormal(sigma=0.8) split are normal with standard deviation 0.8 (KS test)."""
    part = partition_quantity(
        2_000_000, 4000, distribution="lognormal", sigma=0.8, min_samples=1, rng=np.random.default_rng(3)
    )
    logs = np.log(part.sizes)
    assert part.sizes.sum() == 2_000_000
    assert abs(logs.std() - 0.8) < 0.04  # the standard error of the estimate is about 0.01
    assert stats.kstest((logs - logs.mean()) / 0.8, "norm").pvalue > 1e-3


def test_powerlaw_sizes_fit_the_configured_exponent() -> None:
    """The Hill estimator of a power-law split's sizes recovers the exponent (a = 2.5)."""
    part = partition_quantity(
        2_000_000, 4000, distribution="powerlaw", exponent=2.5, min_samples=1, rng=np.random.default_rng(4)
    )
    sizes = part.sizes.astype(np.float64)
    hill = 1.0 + sizes.shape[0] / np.log(sizes / sizes.min()).sum()
    assert abs(hill - 2.5) < 0.1  # the standard error is about (a - 1) / sqrt(K) = 0.024
    assert part.sizes.sum() == 2_000_000
    assert np.array_equal(np.sort(part.indices), np.arange(2_000_000))


def test_size_weights_follow_their_law() -> None:
    """The raw weights pass a KS test against lognormal(sigma) and Pareto(a) with unit minimum."""
    rng = np.random.default_rng(5)
    logn = client_size_weights(3000, distribution="lognormal", sigma=1.5, rng=rng)
    assert stats.kstest(np.log(logn) / 1.5, "norm").pvalue > 1e-3
    pareto = client_size_weights(3000, distribution="powerlaw", exponent=3.0, rng=rng)
    assert stats.kstest(pareto, stats.pareto(b=2.0).cdf).pvalue > 1e-3


def test_apportion_keeps_the_minimum_and_the_total() -> None:
    """Sizes sum to the total, none under the minimum, each within one of its exact share."""
    weights = np.array([1.0, 2.0, 3.0, 100.0])
    sizes = apportion(weights, 50, min_size=5)
    assert sizes.sum() == 50 and sizes.min() >= 5
    exact = 5 + weights / weights.sum() * 30
    assert np.all(np.abs(sizes - exact) < 1)
    with pytest.raises(DataError, match="cannot give each of 4 clients 20 samples"):
        apportion(weights, 50, min_size=20)


def test_bad_size_parameters_are_refused() -> None:
    """An exponent <= 1 or a negative sigma is a ValueError naming it."""
    with pytest.raises(ValueError, match="exponent must be"):
        client_size_weights(3, distribution="powerlaw", exponent=1.0, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="sigma must be"):
        client_size_weights(3, distribution="lognormal", sigma=-1.0, rng=np.random.default_rng(0))


def _data(n: int = 4000, d: int = 16) -> ArrayData:
    return make_synthetic(num_samples=n, num_features=d, num_classes=4, rng=np.random.default_rng(0))


def test_feature_noise_has_each_clients_level() -> None:
    """Client k's features differ from the originals by noise of standard deviation noise * (k + 1) / K."""
    data = _data()
    part = partition_iid(len(data), 8, rng=np.random.default_rng(1))
    skewed = skew_features(data, part, noise=2.0, seed=7)
    levels = feature_noise_levels(8, 2.0)
    assert np.allclose(levels, 2.0 * np.arange(1, 9) / 8)
    for k, rows in enumerate(part):
        index = torch.from_numpy(np.array(rows))
        residual = (skewed.x[index] - data.x[index]).numpy()
        assert abs(residual.std() - levels[k]) < 0.05 * levels[k]  # 8000 draws: standard error 0.8 %
        assert abs(residual.mean()) < 0.05 * levels[k]
    assert torch.equal(skewed.y, data.y)


def test_rotations_preserve_norms_and_share_a_matrix_per_group() -> None:
    """Rotated features keep their norms; group 0 is unchanged; clients k and k + G share group k's rotation."""
    data = _data(d=12)
    part = partition_iid(len(data), 6, rng=np.random.default_rng(1))
    skewed = skew_features(data, part, rotations=3, seed=11)
    assert torch.allclose(skewed.x.norm(dim=1), data.x.norm(dim=1), atol=1e-4)
    for k, rows in enumerate(part):
        index = torch.from_numpy(np.array(rows))
        expected = data.x[index] @ rotation_matrix(12, k % 3, 11)
        assert torch.allclose(skewed.x[index], expected, atol=1e-5)
    assert torch.equal(skewed.x[torch.from_numpy(np.array(part[0]))], data.x[torch.from_numpy(np.array(part[0]))])
    q = rotation_matrix(12, 2, 11).double()
    assert torch.allclose(q.T @ q, torch.eye(12, dtype=torch.float64), atol=1e-5)
    assert not torch.allclose(rotation_matrix(12, 1, 11), rotation_matrix(12, 2, 11))


def test_feature_skew_is_deterministic_and_leaves_the_input() -> None:
    """The same seed gives bit-identical features; another seed other ones; the input is not modified."""
    data = _data()
    before = data.x.clone()
    part = partition_iid(len(data), 5, rng=np.random.default_rng(1))
    first = skew_features(data, part, noise=1.0, rotations=2, seed=3)
    assert torch.equal(first.x, skew_features(data, part, noise=1.0, rotations=2, seed=3).x)
    assert not torch.equal(first.x, skew_features(data, part, noise=1.0, rotations=2, seed=4).x)
    assert torch.equal(data.x, before)


def test_prepare_applies_the_configured_partitions() -> None:
    """A run's config selects each partitioner; feature skew changes the training features, not the held-out set."""
    base = {"population": {"num_clients": 20}, "seed": 3}
    cfg = RunConfig.model_validate({**base, "partition": {"kind": "label_quantity", "labels_per_client": 3}})
    loaded = prepare.load(cfg)
    part = prepare.partition(cfg, loaded.train)
    assert {len(np.unique(loaded.train.y.numpy()[rows])) for rows in part} == {3}

    cfg = RunConfig.model_validate({**base, "partition": {"kind": "quantity", "distribution": "powerlaw"}})
    assert prepare.partition(cfg, prepare.load(cfg).train).sizes.std() > 10

    plain = prepare.load(RunConfig.model_validate({**base, "partition": {"kind": "iid"}}))
    cfg = RunConfig.model_validate({**base, "partition": {"kind": "feature_skew", "noise": 0.5}})
    skewed = prepare.load(cfg)
    assert torch.equal(skewed.test.x, plain.test.x)
    assert not torch.equal(skewed.train.x, plain.train.x)
    assert prepare.partition(cfg, skewed.train) == prepare.partition(cfg, plain.train)


def _lazy(partition: dict[str, object], clients: int = 1000, per_client: int = 200) -> object:
    data = {"kind": "synthetic", "lazy": True, "samples_per_client": per_client}
    server = {"kind": "fedbuff", "buffer_size": 2, "concurrency": 2}
    sections = {"data": data, "population": {"num_clients": clients}, "partition": partition, "server": server}
    config = RunConfig.model_validate(sections)
    return prepare.lazy_clients(config)


def test_lazy_label_quantity_clients_draw_their_own_k_labels() -> None:
    """A lazy client draws labels from exactly its k labels (label k mod C among them), the same each time."""
    clients = _lazy({"kind": "label_quantity", "labels_per_client": 3})
    assert isinstance(clients, LazySkewedClients)
    for k in (0, 7, 999):
        data = clients.client(k)
        held = clients.labels_of(k)
        assert held is not None and len(held) == 3 and k % 10 in held
        assert np.array_equal(np.unique(data.y.numpy()), held)
        assert torch.equal(clients.client(k).x, data.x)


def test_lazy_quantity_sizes_follow_the_law_and_keep_the_total() -> None:
    """Lazy quantity skew: sizes sum to samples_per_client x clients; log sizes spread by sigma."""
    clients = _lazy({"kind": "quantity", "sigma": 0.7}, clients=20_000, per_client=500)
    assert isinstance(clients, SyntheticClients)
    sizes = np.asarray(clients.sizes)
    assert sizes.sum() == 500 * 20_000 and sizes.min() >= 1
    assert abs(np.log(sizes).std() - 0.7) < 0.03
    assert len(clients.client(int(np.argmax(sizes)))) == sizes.max()


def test_lazy_feature_skew_adds_each_clients_noise_level() -> None:
    """A lazy client's features are the plain draw plus noise of noise * (k + 1) / K."""
    skewed = _lazy({"kind": "feature_skew", "noise": 2.0}, clients=10, per_client=2000)
    plain = _lazy({"kind": "iid"}, clients=10, per_client=2000)
    assert type(plain) is SyntheticClients
    for k in (0, 4, 9):
        residual = (skewed.client(k).x - plain.client(k).x).numpy()  # type: ignore[attr-defined]
        assert abs(residual.std() - 2.0 * (k + 1) / 10) < 0.03 * 2.0 * (k + 1) / 10
