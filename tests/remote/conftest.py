"""Remote-client fixtures: a tokens file and a small remote FedBuff config on digits."""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

NUM_CLIENTS = 5


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
    """Return a fresh token per client id, written to ``tmp_path / "tokens.txt"``."""
    issued = {client_id: secrets.token_urlsafe(24) for client_id in range(NUM_CLIENTS)}
    lines = ["# client_id token", *(f"{cid} {token}" for cid, token in issued.items())]
    (tmp_path / "tokens.txt").write_text("\n".join(lines) + "\n")
    return issued
