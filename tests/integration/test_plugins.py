"""Plug-ins written only against the algorithm-state seam (flasync.training.plugins), in whole runs."""

from __future__ import annotations

from collections import Counter

import pytest

import flasync
from flasync.core.events import UpdateReceived
from flasync.testing import EventRecorder, TaskCounts, UpdateCounts, small_config


@pytest.mark.slow
@pytest.mark.parametrize("server", ["{kind: fedavg, clients_per_round: 4}", "{kind: fedbuff, buffer_size: 3}"])
async def test_a_plugin_written_against_the_seam_sees_every_update(server: str) -> None:
    """A server plug-in counts each client's admitted updates and a client plug-in each kept task; the weights are
    those of the same run without them."""
    config = small_config("stop.max_versions=6", f"server={server}")
    counts, tasks = UpdateCounts(), TaskCounts()
    federation = flasync.Federation(config, plugins=[counts, tasks])
    received = EventRecorder(federation.bus)
    summary = await federation.run()
    plain = await flasync.Federation(config).run()
    assert summary.weights_sha256 == plain.weights_sha256
    expected = Counter(int(e.client_id) for e in received.of(UpdateReceived))
    assert counts.table() == sorted(expected.items())
    assert sum(n for _, n in counts.table()) == summary.updates_accepted
    assert counts.versions == summary.versions
    assert tasks.started >= sum(tasks.counts.values()) >= summary.updates_accepted
    for client, n in expected.items():
        assert tasks.counts[client] >= n
