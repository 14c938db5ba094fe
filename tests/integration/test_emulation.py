"""Emulation on the wall clock: simulated in-process clients honour the speed and network models in real time."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import flasync
from flasync.core.clock import WallClock
from flasync.core.errors import ConfigError
from flasync.testing import small_config


def _emulated(seconds_per_step: float, *overrides: str) -> Any:
    return small_config(
        "clock=wall",
        "stop.max_versions=4",
        *overrides,
        population={"num_clients": 20, "speed": {"kind": "constant", "seconds_per_step": seconds_per_step}},
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_ten_times_slower_clients_take_longer_in_real_time() -> None:
    """At factor 1 a 10x slower speed model makes the run last far longer; the factor scales it back down."""
    fast = await flasync.Federation(_emulated(0.02, "wall_time_factor=1")).run()
    slow = await flasync.Federation(_emulated(0.2, "wall_time_factor=1")).run()
    scaled = await flasync.Federation(_emulated(0.2, "wall_time_factor=0.1")).run()
    # Simulated seconds follow the speed model (2 waves of 10 steps: 0.4 s against 4 s, plus real work)...
    assert slow.simulated_s > 3 * fast.simulated_s
    # ... so do real seconds at factor 1 ...
    assert slow.wall_s > 3 * fast.wall_s
    assert slow.wall_s >= 0.9 * slow.simulated_s
    # ... and a factor of 0.1 plays the same simulated time ten times faster.
    assert scaled.wall_s < slow.wall_s / 3
    assert scaled.simulated_s > 3 * fast.simulated_s


async def test_without_a_factor_the_speed_model_is_not_waited_for() -> None:
    """Unset, the wall clock runs clients at the machine's pace (a deployment), whatever the speed model says."""
    summary = await flasync.Federation(_emulated(1.0)).run()
    assert summary.wall_s < 10.0  # the emulation would take 4 versions x 10 steps x 1 s = 40 s at least


async def test_the_clock_scales_sleeps_and_its_reading() -> None:
    """A factor of 0.01 sleeps 1/100 of a simulated second and reads simulated seconds."""
    clock = WallClock(factor=0.01)
    await clock.sleep(2.0)  # 20 ms of real time
    assert clock.now() >= 2.0
    clock.restore({"now": 100.0})
    assert 100.0 <= clock.now() < 150.0


def test_the_factor_needs_the_wall_clock() -> None:
    """wall_time_factor under the virtual clock is a one-line configuration error naming the field."""
    with pytest.raises(ConfigError, match="wall_time_factor: needs clock = 'wall'"):
        small_config("wall_time_factor=1")


def test_a_non_positive_factor_is_refused() -> None:
    """A factor of 0 is refused (by the config, and by the clock itself)."""
    with pytest.raises(ConfigError, match="wall_time_factor"):
        small_config("clock=wall", "wall_time_factor=0")
    with pytest.raises(ValueError, match="factor"):
        WallClock(factor=0.0)


async def test_a_cancelled_emulated_job_is_cancelled() -> None:
    """Cancelling run() during the emulated wait cancels the job's future too."""
    from concurrent.futures import ThreadPoolExecutor

    clock = WallClock(factor=1.0)
    with ThreadPoolExecutor(1) as pool:
        task = asyncio.create_task(clock.run(pool, lambda: 1, simulated_s=60.0))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
