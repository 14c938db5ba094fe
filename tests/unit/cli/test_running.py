"""What `run` and `serve` share: the exit status of a run a stop request ended."""

from __future__ import annotations

import pytest

from flasync.cli.running import stopped_status
from flasync.training.executors.ray_watch import CLUSTER_GONE


@pytest.mark.parametrize(("reason", "status"), [("SIGINT", 130), ("SIGTERM", 143), (CLUSTER_GONE, 1)])
def test_a_signal_exits_with_its_status_anything_else_with_1(reason: str, status: int) -> None:
    """A signal's stop exits 130 or 143; a stop for anything else (the Ray cluster gone) exits 1."""
    assert stopped_status(reason) == status
