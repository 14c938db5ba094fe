"""The [secure_aggregation] section: off by default, its parameters checked, unsupported combinations refused."""

from __future__ import annotations

import pytest

from flasync.config import RunConfig, load_config
from flasync.core.errors import ConfigError

_ON = ["secure_aggregation.enabled=true"]


def _error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_secure_aggregation_is_off_by_default() -> None:
    """A default run has secure aggregation off, and its params are flattened like every section's."""
    config = RunConfig()
    assert not config.secure_aggregation.enabled
    assert config.secure_aggregation.bits == 32


@pytest.mark.parametrize(
    ("overrides", "start", "reason"),
    [
        (["server.kind=fedasync"], "secure_aggregation.enabled:", "FedAsync applies each update alone"),
        (["codec.upload=[{kind: topk, ratio: 0.1}]"], "secure_aggregation.enabled:", "masks only cancel"),
        (["codec.upload=[{kind: int8}]"], "secure_aggregation.enabled:", "masked ring vector is the upload"),
        (
            ["server.kind=fedavg", "server.aggregation=median"],
            "secure_aggregation.enabled:",
            "robust rule needs the individual updates",
        ),
        (["resilience.max_update_norm=5.0"], "secure_aggregation.enabled:", "never sees one update's norm"),
        (["privacy.enabled=true", "privacy.noise_multiplier=1.0"], "secure_aggregation.enabled:", "central DP"),
        (["scaffold.enabled=true"], "secure_aggregation.enabled:", "control variates"),
        (["topology.kind=tree"], "secure_aggregation.enabled:", "an edge would see"),
        (["server.buffer_size=2"], "server.buffer_size:", "at least 3 clients"),
        (["secure_aggregation.bits=16", "secure_aggregation.clip=4096"], "secure_aggregation.bits:", "cannot sum"),
        (["secure_aggregation.neighbours=3"], "secure_aggregation.neighbours:", "must be even"),
        (["secure_aggregation.threshold=4"], "secure_aggregation.threshold:", "must exceed half of the 9"),
        (["secure_aggregation.max_dropouts=5"], "secure_aggregation.max_dropouts:", "exceeds the 9 neighbours"),
        (["resilience.round_deadline_s=5", "server.kind=fedavg"], "secure_aggregation.enabled:", "hold their"),
        (["server.concurrency=5"], "secure_aggregation.enabled:", "concurrency >= server.buffer_size"),
    ],
)
def test_unsupported_combinations_are_refused_in_one_line(overrides: list[str], start: str, reason: str) -> None:
    """Each combination secure aggregation cannot take is a one-line error on the field, with the reason."""
    message = _error([*_ON, *overrides])
    assert message.startswith(start) and reason in message, message


def test_a_group_uses_over_selected_clients_for_its_size() -> None:
    """A FedAvg round's group is its over-selected cohort: its size decides whether the ring can hold the sum."""
    message = _error(
        [
            *_ON,
            "server.kind=fedavg",
            "server.clients_per_round=100",
            "resilience.over_selection=0.3",
            "secure_aggregation.bits=16",
            "secure_aggregation.clip=300",
        ]
    )
    assert message.startswith("secure_aggregation.bits:") and "sum 130 updates" in message


@pytest.mark.parametrize("server", ["server.kind=fedbuff", "server.kind=fedavg"])
def test_a_supported_run_validates_with_its_dropout_probability(server: str) -> None:
    """FedBuff and FedAvg with simulated clients take the section, with a dropout probability in [0, 1]."""
    config = load_config(None, [*_ON, server, "secure_aggregation.dropout=0.1"])
    assert config.secure_aggregation.enabled and config.secure_aggregation.dropout == 0.1
    assert _error([*_ON, server, "secure_aggregation.dropout=1.5"]).startswith("secure_aggregation.dropout:")
