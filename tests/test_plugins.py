"""The algorithm-state seam (flasync.training.plugins): plug-ins written only against it, and the built-in ones."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import flasync
from flasync.algorithms.per_client import PerClientState
from flasync.core.errors import ConfigError
from flasync.core.events import ClientId, TaskAssigned, UpdateReceived, Version
from flasync.testing import EventRecorder, TaskCounts, UpdateCounts, small_config
from flasync.training.plugins import ClientPlugin, ServerPlugin
from flasync.training.residuals import ResidualStore


def _task(task_id: int, client_id: int) -> TaskAssigned:
    return TaskAssigned(
        task_id=task_id, client_id=ClientId(client_id), participation=0, base_version=Version(0), simulated_s=0.0
    )


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


def test_a_plugins_state_round_trips() -> None:
    """What a plug-in gives a checkpoint restores its table."""
    counts = UpdateCounts()
    counts.counts.update({3: 2, 1: 5})
    counts.versions = 4
    again = UpdateCounts()
    again.load_state_dict(counts.state_dict())
    assert again.table() == [(1, 5), (3, 2)] and again.versions == 4


class _Unnamed(ServerPlugin):
    pass


class _Named(ClientPlugin):
    def __init__(self, name: str) -> None:
        self.name = name


@pytest.mark.parametrize(
    ("plugins", "message"),
    [
        ([object()], "plugins: object is neither a flasync.ClientPlugin nor a flasync.ServerPlugin"),
        ([_Unnamed()], "plugins: _Unnamed.name must be a non-empty identifier, not ''"),
        ([_Named("residuals")], "plugins: _Named.name 'residuals' is taken"),
        ([_Named("mine"), _Named("mine")], "plugins: _Named.name 'mine' is taken"),
    ],
    ids=["not-a-plugin", "unnamed", "built-in-name", "twice"],
)
def test_plugins_that_cannot_be_checkpointed_are_refused_in_one_line(plugins: list[object], message: str) -> None:
    """A plug-in of neither kind, without a name, or whose name another checkpoint entry has: ConfigError."""
    with pytest.raises(ConfigError) as raised:
        flasync.Federation(small_config(), plugins=plugins)  # type: ignore[arg-type]
    assert str(raised.value).startswith(message)
    assert "\n" not in str(raised.value)


def test_a_checkpoint_keeps_what_a_task_in_flight_started_from() -> None:
    """A task that stored its new vector already is checkpointed with the one it started from; one never trained
    is left out, and a released task's record is forgotten."""
    state = PerClientState(ResidualStore(3))
    state.put(1, torch.ones(3))
    first, second = _task(10, 1), _task(11, 2)
    assert torch.equal(state.begin(first), torch.ones(3))  # type: ignore[arg-type]
    assert state.begin(second) is None
    state.put(1, torch.full((3,), 2.0))
    state.put(2, torch.full((3,), 5.0))
    saved = state.state_dict([first, second])
    assert saved["ids"] == [1] and torch.equal(saved["values"][0], torch.ones(3))
    state.released(first)
    state.released(second)
    saved = state.state_dict([first, second])
    assert saved["ids"] == [1, 2] and torch.equal(saved["values"][0], torch.full((3,), 2.0))
    restored = PerClientState(ResidualStore(3))
    restored.load_state_dict(saved)
    assert torch.equal(restored.get(2), torch.full((3,), 5.0))  # type: ignore[arg-type]
