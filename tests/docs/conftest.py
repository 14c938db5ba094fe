"""Shared setup of the documentation's tests."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Declare the ``slow`` marker the documentation's subprocess tests carry."""
    config.addinivalue_line("markers", "slow: starts subprocesses or whole federations (left out of the quick tier)")
