"""The failure model: fates by seed, client and participation, their rates, availability windows, Byzantine shares."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flasync.clients.simulated.faults import Fate, FaultModel
from flasync.config import FaultsConfig
from flasync.core.errors import ConfigError
from flasync.testing import small_config


# ------------------------------------------------------------------------------------------ the model itself
def test_fates_are_a_pure_function_of_seed_client_and_participation() -> None:
    """The same (seed, client, participation) always gets the same fate; another seed another pattern."""
    config = FaultsConfig(crash=0.3, hang=0.1, dropout=0.1)
    first = FaultModel(config, seed=1, num_clients=50)
    again = FaultModel(config, seed=1, num_clients=50)
    other = FaultModel(config, seed=2, num_clients=50)
    keys = [(c, p) for c in range(50) for p in range(20)]
    fates = [first.fate(c, p) for c, p in keys]
    assert fates == [again.fate(c, p) for c, p in reversed(keys)][::-1]
    assert fates != [other.fate(c, p) for c, p in keys]
    assert all(0.0 <= f.fraction <= 1.0 for f in fates)


def test_fate_rates_match_the_configured_probabilities() -> None:
    """Over many tasks, the shares of crash, hang and dropout are the configured rates (binomial bounds)."""
    model = FaultModel(FaultsConfig(crash=0.3, hang=0.1, dropout=0.05), seed=0, num_clients=200)
    n = 200 * 50
    counts = {fate: 0 for fate in Fate}
    for client in range(200):
        for participation in range(50):
            counts[model.fate(client, participation).fate] += 1
    for fate, rate in ((Fate.CRASH, 0.3), (Fate.HANG, 0.1), (Fate.DROPOUT, 0.05)):
        assert abs(counts[fate] / n - rate) < 5 * math.sqrt(rate * (1 - rate) / n)


def test_no_faults_means_every_task_is_ok() -> None:
    """The default config injects nothing."""
    model = FaultModel(FaultsConfig(), seed=0, num_clients=10)
    assert not model.active
    assert {model.fate(c, p).fate for c in range(10) for p in range(10)} == {Fate.OK}


def test_availability_windows() -> None:
    """A client is online for online_fraction of each period, from its own phase; the helpers agree."""
    config = FaultsConfig.model_validate({"availability": {"period_s": 10.0, "online_fraction": 0.3}})
    model = FaultModel(config, seed=0, num_clients=40)
    times = np.linspace(0.0, 100.0, 2001)
    for client in range(40):
        online = np.array([model.online(client, float(t)) for t in times])
        assert abs(online.mean() - 0.3) < 0.02
    mask = model.online_mask(12.34)
    assert mask.tolist() == [model.online(c, 12.34) for c in range(40)]
    for client in np.flatnonzero(mask).tolist():
        end = model.offline_at(client, 12.34)
        assert 12.34 < end <= 12.34 + 3.0 + 1e-9
        assert model.online(client, end - 1e-6) and not model.online(client, end + 1e-6)
    start = model.next_online(0.0)
    assert model.online_mask(start).any()


def test_a_window_ending_within_rounding_of_now_is_offline() -> None:
    """A client whose window ends less than a rounding step after ``t`` (``offline_at`` gives ``t`` itself) is
    offline at ``t`` for every helper: a task handed to it would fail at once at the same time, again and again,
    with the clock never moving (a secure-aggregation run with short windows stalled on this)."""
    config = FaultsConfig.model_validate({"availability": {"period_s": 2.0, "online_fraction": 0.6}})
    model = FaultModel(config, seed=0, num_clients=3)
    t = 8.548936089821607
    model.phase[:] = [1.2 - 6.661338147750939e-16 - math.fmod(t, 2.0), 0.0, 1.0]
    position = math.fmod(t + float(model.phase[0]), 2.0)
    assert position < 1.2 and model.offline_at(0, t) == t  # inside the window, yet it ends at t
    assert not model.online(0, t) and not bool(model.online_mask(t)[0])
    assert model.online_mask(t).tolist() == [model.online(c, t) for c in range(3)]
    assert model.online(0, t - 0.1) and model.offline_at(0, t - 0.1) > t - 0.1
    model.phase[:] = model.phase[0]  # nobody else online: the next one is a whole off-window later
    assert model.next_online(t) > t + 0.7 and model.online_mask(model.next_online(t)).all()


def test_fault_rates_must_leave_room_for_success() -> None:
    """crash + hang + dropout >= 1 is a config error; so is hang without a task timeout."""
    with pytest.raises(ConfigError, match="faults: crash \\+ hang \\+ dropout must be < 1, got 1"):
        small_config("faults.crash=0.5", "faults.dropout=0.5")
    with pytest.raises(ConfigError, match=r"resilience\.task_timeout_s: must be set when faults\.hang > 0"):
        small_config("faults.hang=0.1")


def test_byzantine_clients_are_a_fixed_seeded_share_that_scales_every_update() -> None:
    """faults.byzantine picks round(share x N) clients from the seed; they send -f (sign flip) or +f (scale)."""
    from flasync.clients.simulated.faults import FaultModel
    from flasync.config import FaultsConfig

    model = FaultModel(FaultsConfig(byzantine=0.1), seed=3, num_clients=200)
    again = FaultModel(FaultsConfig(byzantine=0.1), seed=3, num_clients=200)
    assert len(model.attackers) == 20 and model.attackers == again.attackers
    attacker = next(iter(model.attackers))
    honest = next(c for c in range(200) if c not in model.attackers)
    assert model.attack_factor(attacker) == -20.0 and model.attack_factor(honest) == 1.0
    scaling = FaultModel(FaultsConfig(byzantine=0.1, attack="scale", attack_factor=5.0), seed=3, num_clients=200)
    assert scaling.attack_factor(attacker) == 5.0
    assert not FaultModel(FaultsConfig(), seed=3, num_clients=200).attackers
