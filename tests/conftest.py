"""Shared test setup: the fixtures and helpers every tier uses (temporary MLflow stores, free ports, a focal loss,
remote clients' configs and tokens)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import logging
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
import yaml

import flasync
from flasync.core.errors import RunInterrupted
from flasync.core.events import Aggregated
from flasync.runtime import checkpoint
from flasync.testing import MemoryTracker
from flasync.tracking import close_idle_writer
from flasync.tracking.store import prepare_sqlite_store

ROOT = Path(__file__).resolve().parents[1]
"""The repository's root: the tests read ``examples/`` and ``README.md`` there and start subprocesses in it."""

EXAMPLES = ROOT / "examples"
"""The runnable examples the tests start and read."""

NEEDS_DP_ACCOUNTING = pytest.mark.skipif(
    importlib.util.find_spec("dp_accounting") is None,
    reason="privacy.enabled needs dp-accounting (the privacy and dev extras install it)",
)
"""Marks a test whose run has privacy on: without Google's accountant such a run is refused (a ConfigError)."""


@pytest.fixture(autouse=True, scope="session")
def _no_user_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep what runs cache (MLflow's empty store schema) in a temporary folder, never the user's ``~/.cache``; and
    start or ask no writer server (:mod:`flasync.tracking._server`), which would outlive the tests, but in the tests
    of it, whose sockets go to a private temporary folder."""
    runtime = tmp_path_factory.mktemp("runtime")
    runtime.chmod(0o700)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        patch.setenv("XDG_RUNTIME_DIR", str(runtime))
        patch.setenv("FLASYNC_WRITER_SERVER", "0")
        yield


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    """Undo any global structlog configuration a test (or the CLI it calls) made."""
    before = structlog.get_config()
    yield
    structlog.configure(**before)


LIBRARY_LOGGERS = ("mlflow", "alembic", "urllib3", "git", "matplotlib", "mlflow.store.db.utils")
"""The libraries' loggers whose level the command line's ``--log-level`` sets (with ``MLFLOW_LOGGING_LEVEL``)."""


@pytest.fixture(autouse=True)
def _restore_library_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Undo the library log levels and the ``MLFLOW_LOGGING_LEVEL`` a command run in the test's process set (the
    subprocesses of later tests would inherit the variable)."""
    levels = {name: logging.getLogger(name).level for name in LIBRARY_LOGGERS}
    if "MLFLOW_LOGGING_LEVEL" in os.environ:
        monkeypatch.setenv("MLFLOW_LOGGING_LEVEL", os.environ["MLFLOW_LOGGING_LEVEL"])
    else:
        monkeypatch.delenv("MLFLOW_LOGGING_LEVEL", raising=False)
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


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


@pytest.fixture(autouse=True, scope="session")
def _no_user_journals() -> Iterator[None]:
    """Leave no folder behind in the checkout's ``mlruns/``: a tracked run made in the test process writes its journal
    under the current folder's ``mlruns/spool`` (tests that look at it work in a temporary folder) and removes it when
    the run ends; an empty folder it made for it goes too."""
    made = [folder for folder in (ROOT / "mlruns", ROOT / "mlruns" / "spool") if not folder.exists()]
    yield
    for folder in reversed(made):
        with contextlib.suppress(OSError):  # not empty (a journal left behind): kept, for the user to see
            folder.rmdir()


@pytest.fixture(autouse=True)
def _no_user_store(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point MLflow's environment default at a temporary store in the tracking tests (``tests/*/tracking/``), never
    the user's ``mlruns/``."""
    if request.path.parent.name == "tracking":
        tmp_path: Path = request.getfixturevalue("tmp_path")
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


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Work in a temporary directory with a temporary MLflow store (the URI of a database not yet made)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"


def ready_models(client: Any, experiment_id: str, run_id: str, name: str, count: int = 3) -> list[Any]:
    """Log ``count`` READY models called ``name`` to run ``run_id`` (each created a millisecond or more after the one
    before), then one more still pending; return the READY ones, oldest first."""
    made = []
    for _ in range(count):
        model = client.create_logged_model(experiment_id, name=name, source_run_id=run_id)
        client.finalize_logged_model(model.model_id, "READY")
        made.append(model)
        time.sleep(0.005)  # a creation time of its own (milliseconds)
    client.create_logged_model(experiment_id, name=name, source_run_id=run_id)  # pending, created last
    return made


def free_port() -> int:
    """Return a TCP port of 127.0.0.1 that nothing listens on (free when asked; a server started next takes it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Focal:
    """Focal loss (Lin et al., 2017) per sample: ``-(1 - p_t) ** gamma * log(p_t)``; ``gamma = 0`` is
    cross-entropy."""

    def __init__(self, gamma: float = 2.0, *, vectorizable: bool = True) -> None:
        self.gamma = gamma
        self.vectorizable = vectorizable

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Return one loss per sample of ``outputs`` (logits, ``[batch, classes]``) against ``targets``."""
        log_p = outputs.log_softmax(dim=1).gather(1, targets[:, None]).squeeze(1)
        return -((1.0 - log_p.exp()) ** self.gamma) * log_p


NUM_CLIENTS = 5
"""The number of remote clients of :func:`remote_config`."""


def remote_config(tokens_file: Path, **overrides: Any) -> dict[str, Any]:
    """Return a quick FedBuff-on-digits config with remote clients (tracking off unless overridden)."""
    config: dict[str, Any] = {
        "seed": 0,
        "clock": "wall",
        "partition": {"kind": "iid"},
        "model": {"kind": "mlp", "hidden": [32]},
        "population": {"num_clients": NUM_CLIENTS},
        "client": {"epochs": 2, "batch_size": 16, "lr": 0.1},
        "server": {"kind": "fedbuff", "buffer_size": 3, "concurrency": NUM_CLIENTS},
        "stop": {"max_versions": 20},
        "eval": {"every_versions": 5},
        "resilience": {"task_timeout_s": 20.0},
        "tracking": {"enabled": False},
        "remote": {"enabled": True, "tokens_file": str(tokens_file), "poll_s": 5.0},
    }
    for key, value in overrides.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) and key in config else value
    return config


def write_remote_config(path: Path, tokens_file: Path, **overrides: Any) -> Path:
    """Write :func:`remote_config` (tracking on unless overridden) as the YAML file a `flasync serve` reads."""
    tracking = {"log_model": False, **overrides.pop("tracking", {})}
    config = remote_config(tokens_file, tracking=tracking, **overrides)
    config["tracking"].pop("enabled")
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def client_process(
    url: str, token: str, token_file: Path, *options: str, env: Mapping[str, str], **popen: Any
) -> subprocess.Popen[Any]:
    """Start a `flasync client` process for ``url`` with ``token`` (written to ``token_file``) and ``options``."""
    token_file.write_text(token + "\n")
    command = [sys.executable, "-m", "flasync", "client", "--server", url, "--token-file", str(token_file), *options]
    return subprocess.Popen(command, env=dict(env), **popen)


@pytest.fixture
def tokens(tmp_path: Path) -> dict[int, str]:
    """Return a fresh token per remote client id, written to ``tmp_path / "tokens.txt"``."""
    issued = {client_id: secrets.token_urlsafe(24) for client_id in range(NUM_CLIENTS)}
    lines = ["# client_id token", *(f"{cid} {token}" for cid, token in issued.items())]
    (tmp_path / "tokens.txt").write_text("\n".join(lines) + "\n")
    return issued


async def interrupt_at(
    config: flasync.RunConfig, version: int, resume: checkpoint.ResumePoint | None = None, **kwargs: Any
) -> tuple[MemoryTracker, flasync.Federation]:
    """Run ``config`` (``resume``, and ``kwargs`` for :class:`~flasync.Federation`) and request a stop as SIGINT would
    once ``version`` was aggregated; return the tracker it wrote to (its checkpoints) and the federation."""
    tracker = MemoryTracker()
    federation = flasync.Federation(config, tracker=tracker, resume=resume, **kwargs)
    aggregated = federation.bus.subscribe(Aggregated, policy="drop_oldest")
    task = asyncio.create_task(federation.run())
    async for event in aggregated:
        if event.version >= version:
            federation.request_stop("SIGINT")
            break
    with pytest.raises(RunInterrupted, match="interrupted \\(SIGINT\\)"):
        await task
    return tracker, federation
