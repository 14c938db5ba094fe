"""Regression targets in :class:`ArrayData`, and scikit-learn's diabetes data set."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flasync.core.errors import DataError
from flasync.data import ArrayData, load_diabetes, train_test_split


def test_diabetes_is_standardized_and_holds_real_targets() -> None:
    """442 samples of 10 features; features and target have mean 0 and standard deviation 1."""
    data = load_diabetes()
    assert data.x.shape == (442, 10) and data.y.shape == (442,) and data.num_classes == 1
    assert data.regression and data.y.dtype == torch.float32
    assert torch.allclose(data.x.double().mean(0), torch.zeros(10, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(data.x.double().std(0, unbiased=False), torch.ones(10, dtype=torch.float64), atol=1e-5)
    assert abs(float(data.y.double().mean())) < 1e-6 and abs(float(data.y.double().std(unbiased=False)) - 1) < 1e-5
    assert len(torch.unique(data.y)) > 200  # a real target, not classes


def test_regression_targets_need_one_output_and_finite_values() -> None:
    """Float targets with more than one output, or not finite, are refused; class data is not ``regression``."""
    x = torch.zeros(3, 2)
    with pytest.raises(DataError, match="need num_classes = 1"):
        ArrayData(x=x, y=torch.zeros(3), num_classes=2)
    with pytest.raises(DataError, match="must be finite"):
        ArrayData(x=x, y=torch.tensor([0.0, float("nan"), 1.0]), num_classes=1)
    with pytest.raises(DataError, match=r"int64 \(classes\) or torch\.float32"):
        ArrayData(x=x, y=torch.zeros(3, dtype=torch.float64), num_classes=1)
    assert not ArrayData(x=x, y=torch.zeros(3, dtype=torch.int64), num_classes=2).regression


def test_a_regression_split_is_random_and_seeded() -> None:
    """The held-out split of real targets takes its share at random, the same for the same seed."""
    data = load_diabetes()
    train, test = train_test_split(data, test_fraction=0.2, rng=np.random.default_rng(3))
    again, _ = train_test_split(data, test_fraction=0.2, rng=np.random.default_rng(3))
    other, _ = train_test_split(data, test_fraction=0.2, rng=np.random.default_rng(4))
    assert (len(train), len(test)) == (354, 88) and train.regression and test.regression
    assert torch.equal(train.y, again.y) and not torch.equal(train.y, other.y)
