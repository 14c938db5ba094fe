"""Shared test setup."""

from __future__ import annotations

import gc
import importlib.util
from collections.abc import Iterator

import pytest
import structlog
import torch

from flasync.tracking import close_idle_writer

NEEDS_DP_ACCOUNTING = pytest.mark.skipif(
    importlib.util.find_spec("dp_accounting") is None,
    reason="privacy.enabled needs dp-accounting (the privacy and dev extras install it)",
)
"""Marks a test whose run has privacy on: without Google's accountant such a run is refused (a ConfigError)."""


@pytest.fixture(autouse=True, scope="session")
def _no_user_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep what runs cache (MLflow's empty store schema) in a temporary folder, never the user's ``~/.cache``."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    """Undo any global structlog configuration a test (or the CLI it calls) made."""
    before = structlog.get_config()
    yield
    structlog.configure(**before)


@pytest.fixture(autouse=True)
def _no_heap_left_frozen() -> Iterator[None]:
    """Fail the test that leaves objects frozen in the collector's permanent generation (``gc.freeze`` without its
    ``gc.unfreeze``: flasync's frozen heap gives back what it froze), and give them back for the tests after it."""
    before = gc.get_freeze_count()
    yield
    left = gc.get_freeze_count()
    if before == 0 and left:
        gc.unfreeze()
        pytest.fail(f"the test left {left} objects frozen (gc.freeze without gc.unfreeze)")


@pytest.fixture(autouse=True)
def _no_idle_writer() -> Iterator[None]:
    """Stop the MLflow writer process a test's tracked runs left idle, so the next test starts without it."""
    yield
    close_idle_writer()


@pytest.fixture
def one_intra_op_thread() -> Iterator[None]:
    """Run a test's kernels on one intra-op thread, as flasync's training workers do by default, and restore the
    count afterwards. With two, MKL's batched products may round differently from one process to the next (a
    cohort's mean loss moved by 1e-5 in one run in five), which a test comparing two ways of training would read
    as their difference."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def seeded_torch() -> Iterator[None]:
    """Seed torch's default generator for a test and restore it afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield
