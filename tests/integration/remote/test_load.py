"""The load generator of ``benchmarks/remote_load.py`` against a real uvicorn server: every update it sends is
accounted for, and its counts agree with the server's."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from benchmarks.remote_load import Pace, drive, server_counters
from flasync.cli.serve import remote_line
from flasync.core.errors import RunInterrupted
from flasync.runtime.federation import Federation
from flasync.runtime.serve import serve
from tests.conftest import remote_config

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("train_s", [0.0, 0.05], ids=["saturated", "paced"])
@pytest.mark.slow
async def test_every_update_sent_is_accepted_refused_or_timed_out(
    tmp_path: Path, tokens: dict[int, str], train_s: float
) -> None:
    """A handful of devices replaying one update, at once or after 'training': accepted + refused + timed out +
    failed = sent, the accepted ones are the server's uploads, and the server's remote line reads back as its
    counters."""
    config = remote_config(tmp_path / "tokens.txt", stop={"max_versions": 10**6}, resilience={"task_timeout_s": 60.0})
    federation = Federation(config)
    port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    served = asyncio.create_task(serve(federation, port=0, on_ready=port.set_result, linger_s=0.1))
    connected: list[int] = []

    async def note(count: int) -> None:
        connected.append(count)

    try:
        tally = await drive(f"http://127.0.0.1:{await port}", list(tokens.values()), 1.0, 2.0, note, train_s=train_s)
    finally:
        federation.request_stop("test over")
        with contextlib.suppress(RunInterrupted):
            await served
    updates = tally.updates()
    assert updates["sent"] > 0
    assert updates["accepted"] + updates["refused"] + updates["timed_out"] + updates["failed"] == updates["sent"]
    assert len(connected) == 1 and 0 < connected[0] <= len(tokens)
    assert len(tally.first_offer_s) == connected[0]
    assert len(tally.upload_sent_s) == len(tally.latencies["upload"]) and all(s >= 0 for s in tally.upload_sent_s)
    transport = federation.transport
    assert transport is not None
    statistics = transport.statistics()
    assert statistics["uploads"] == updates["accepted"]
    counters = server_counters(remote_line(statistics))
    assert counters == {"updates_received": updates["accepted"], "refused": statistics["refused"]}


def test_a_devices_training_times_are_its_own_seeded_stream() -> None:
    """Each device's pace is drawn within the spread around the mean, replays with its seed and index, and differs
    from another device's; its first task lasts what remains of one under way (the mean residual time)."""
    first = Pace(0.9, 0.5, seed=3, index=7).next_s()
    pace = Pace(0.9, 0.5, seed=3, index=7)
    drawn = [pace.next_s() for _ in range(2000)]
    assert drawn[0] == first
    assert all(0.45 <= s <= 1.35 for s in drawn)
    assert abs(sum(drawn) / len(drawn) - 0.9) < 0.02
    other = Pace(0.9, 0.5, seed=3, index=8)
    assert [other.next_s() for _ in range(5)] != drawn[:5]
    residual = [pace.first_s() for _ in range(4000)]  # what remains of a task under way at a random moment
    assert all(0.0 <= s <= 1.35 for s in residual)
    assert abs(sum(residual) / len(residual) - (0.9**2 + 0.9**2 / 12) / (2 * 0.9)) < 0.02  # E[D^2] / (2 E[D])
    with pytest.raises(ValueError, match="spread"):
        Pace(0.9, 1.5, seed=0, index=0)
