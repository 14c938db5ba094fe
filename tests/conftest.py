"""Shared test setup."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog
import torch


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    """Undo any global structlog configuration a test (or the CLI it calls) made."""
    before = structlog.get_config()
    yield
    structlog.configure(**before)


@pytest.fixture
def seeded_torch() -> Iterator[None]:
    """Seed torch's default generator for a test and restore it afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield
