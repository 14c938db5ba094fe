"""The algorithm-state seam (flasync.training.plugins): a plug-in's checkpoint state, and plug-ins a run refuses."""

from __future__ import annotations

import pytest

import flasync
from flasync.core.errors import ConfigError
from flasync.testing import UpdateCounts, small_config
from flasync.training.plugins import ClientPlugin, ServerPlugin


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
