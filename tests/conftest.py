"""Shared test setup."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    """Undo any global structlog configuration a test (or the CLI it calls) made."""
    before = structlog.get_config()
    yield
    structlog.configure(**before)
