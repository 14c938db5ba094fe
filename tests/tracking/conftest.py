"""Fixtures of the tracking tests: a temporary MLflow store and a clean structlog configuration."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from flasync.tracking.store import prepare_sqlite_store


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    """Undo any global structlog configuration a test made."""
    yield
    structlog.reset_defaults()


@pytest.fixture(autouse=True)
def _no_user_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point MLflow's environment default at a temporary store, never the user's ``mlruns/``."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/stray/mlflow.db")


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Return a folder holding one SQLite store shared by the tests of a module."""
    return tmp_path_factory.mktemp("mlflow")


@pytest.fixture(scope="module")
def tracking_uri(store_dir: Path) -> str:
    """Return the URI of the module's temporary SQLite store, its schema built (as flasync's runs build it, under a
    lock: a test's own MLflow client and a writer process started beside it never both build it)."""
    uri = f"sqlite:///{store_dir}/mlflow.db"
    prepare_sqlite_store(uri)
    return uri
