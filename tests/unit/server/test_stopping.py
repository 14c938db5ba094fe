"""The stop rules: which limit ends a run, when it evaluates and checkpoints, and the pace's estimate."""

from __future__ import annotations

import math

import pytest

from flasync.server import INTERRUPTED, ServerStats, StopRules
from flasync.server.stopping import eta_seconds

pytestmark = pytest.mark.timeout(30)


def _never() -> float:
    raise AssertionError("read although no limit needs it")


def test_no_limit_reached_means_the_run_goes_on() -> None:
    """With every limit ahead, the reason is empty."""
    rules = StopRules(max_versions=5, target_accuracy=0.9, max_simulated_s=10.0, max_wall_s=10.0)
    stats = ServerStats(versions=4, accuracy=0.5)
    assert rules.reason(stats, requested=False, now=lambda: 1.0, elapsed_s=lambda: 1.0) == ""


def test_a_stop_request_wins_over_every_limit() -> None:
    """A requested stop is reported as interrupted even when max_versions is reached too."""
    stats = ServerStats(versions=5)
    assert StopRules(max_versions=5).reason(stats, requested=True, now=_never, elapsed_s=_never) == INTERRUPTED


@pytest.mark.parametrize(
    ("versions", "accuracy", "now", "elapsed", "expected"),
    [
        (5, 0.95, 20.0, 20.0, "max_versions"),
        (4, 0.95, 20.0, 20.0, "target_accuracy"),
        (4, 0.5, 20.0, 20.0, "max_simulated_s"),
        (4, 0.5, 1.0, 20.0, "max_wall_s"),
    ],
)
def test_the_first_limit_reached_in_order_names_the_reason(
    versions: int, accuracy: float, now: float, elapsed: float, expected: str
) -> None:
    """max_versions, then target_accuracy, max_simulated_s and max_wall_s: the first that holds is the reason."""
    rules = StopRules(max_versions=5, target_accuracy=0.9, max_simulated_s=10.0, max_wall_s=10.0)
    stats = ServerStats(versions=versions, accuracy=accuracy)
    assert rules.reason(stats, requested=False, now=lambda: now, elapsed_s=lambda: elapsed) == expected


def test_the_clocks_are_read_only_for_a_limit_that_is_set() -> None:
    """Without time limits, neither the run's clock nor the wall is read."""
    assert StopRules(max_versions=5).reason(ServerStats(), requested=False, now=_never, elapsed_s=_never) == ""


def test_evaluation_every_n_versions() -> None:
    """eval_every = 3 evaluates versions 3 and 6, not 4."""
    rules = StopRules(max_versions=10, eval_every=3)
    assert [v for v in range(1, 8) if rules.evaluates(v)] == [3, 6]


def test_a_checkpoint_every_n_versions_but_not_at_the_last() -> None:
    """checkpoint_every = 2 of 6 versions offers checkpoints at 2 and 4 (6 is the result); None offers none."""
    assert [v for v in range(1, 7) if StopRules(max_versions=6, checkpoint_every=2).checkpoints(v)] == [2, 4]
    assert not any(StopRules(max_versions=6).checkpoints(v) for v in range(1, 7))


def test_a_checkpoint_is_offered_once_its_wall_seconds_passed_never_at_the_last_version() -> None:
    """checkpoint_every_s offers one at the first version made that long after the last checkpoint; the versions
    rule still holds beside it, and the last version is never one."""
    rules = StopRules(max_versions=6, checkpoint_every=4, checkpoint_every_s=30.0)
    assert rules.checkpoints(4, lambda: 0.0)
    assert not rules.checkpoints(3, lambda: 29.9)
    assert rules.checkpoints(3, lambda: 30.0)
    assert not rules.checkpoints(6, lambda: 99.0)
    assert not StopRules(max_versions=6).checkpoints(3, lambda: 99.0)


def test_the_eta_follows_the_pace_and_the_wall_limit() -> None:
    """Versions left at the pace so far, capped by the wall time left; NaN before a version was made."""
    assert eta_seconds(StopRules(max_versions=10), 2, 4, 8.0) == pytest.approx(24.0)
    assert eta_seconds(StopRules(max_versions=10, max_wall_s=10.0), 2, 4, 8.0) == pytest.approx(2.0)
    assert math.isnan(eta_seconds(StopRules(max_versions=10), 0, 0, 8.0))
