"""What `run` and `serve` share: the exit status of a run a stop request ended."""

from __future__ import annotations

import pytest

from flasync.cli.running import stopped_status, time_line
from flasync.observe.summary import RunSummary
from flasync.training.executors.ray_watch import CLUSTER_GONE


@pytest.mark.parametrize(("reason", "status"), [("SIGINT", 130), ("SIGTERM", 143), (CLUSTER_GONE, 1)])
def test_a_signal_exits_with_its_status_anything_else_with_1(reason: str, status: int) -> None:
    """A signal's stop exits 130 or 143; a stop for anything else (the Ray cluster gone) exits 1."""
    assert stopped_status(reason) == status


def _summary(**fields: object) -> RunSummary:
    """Return a summary of a run of 12.5 wall seconds and 40 seconds on its clock."""
    base: dict[str, object] = {
        "run_id": None,
        "accuracy": 0.9,
        "loss": 0.3,
        "updates_accepted": 10,
        "updates_dropped": 0,
        "updates_failed": 0,
        "tasks_dispatched": 10,
        "tasks_timed_out": 0,
        "tasks_abandoned": 0,
        "versions": 2,
        "wall_s": 12.5,
        "simulated_s": 40.0,
        "upload_bytes": 0,
        "download_bytes": 0,
        "staleness_mean": 0.0,
        "staleness_max": 0,
        "upload_compression": 1.0,
        "updates_per_s": 0.8,
        "stop_reason": "max_versions",
        "weights_sha256": "0" * 64,
    }
    return RunSummary(**{**base, **fields})  # type: ignore[arg-type]


def test_the_time_line_names_the_clock_the_run_ran_on() -> None:
    """On the virtual clock the line gives wall and simulated seconds; on the wall clock (flasync serve) it says
    nothing is simulated, and a resumed run says the seconds since the run first started."""
    summary = _summary(first_update_s=0.25)
    assert time_line(summary, "virtual") == ("wall 12.50 s, simulated 40.0 s (virtual clock), first update 0.250 s")
    assert time_line(summary, "wall") == "wall 12.50 s (wall clock), first update 0.250 s"
    assert time_line(_summary(), "wall", resumed=True) == (
        "wall 12.50 s in this process (wall clock, 40.0 s since the run started)"
    )
    assert "simulated" not in time_line(summary, "wall")
