"""Run names: the config's template filled in with the seed, the start time and an id, or a name of what ran."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

from flasync.config import load_config
from flasync.runtime.naming import run_name

STARTED = datetime(2026, 1, 5, 14, 30, 0, tzinfo=UTC)


def test_default_name_says_aggregator_data_seed_and_id() -> None:
    """Without tracking.run_name the name is <aggregator>-<data>-seed<seed>-<id>."""
    config = load_config(None, ["seed=7"])
    assert run_name(config, started=STARTED, run_id="a1b2c3") == "fedbuff-digits-seed7-a1b2c3"
    assert run_name(config, started=STARTED, run_id="a1b2c3", custom=True) == "fedbuff-custom-seed7-a1b2c3"


def test_template_fields_are_filled_in_with_utc_time() -> None:
    """{seed}, {time} (UTC, whatever the start's zone) and {id} are filled in; a literal {{ stays a brace."""
    config = load_config(None, ["seed=3", "tracking.run_name=int8-seed{seed}-{time}-{id}-{{x}}"])
    east = STARTED.astimezone(timezone(timedelta(hours=2)))
    assert run_name(config, started=east, run_id="ff") == "int8-seed3-20260105-143000-ff-{x}"


def test_repeated_runs_of_one_config_get_different_names() -> None:
    """Two starts a second apart give two names (the example configs' template)."""
    config = load_config(None, ["tracking.run_name=fedbuff-seed{seed}-{time}"])
    first = run_name(config, started=STARTED, run_id="00")
    assert first == "fedbuff-seed0-20260105-143000"
    assert first != run_name(config, started=STARTED + timedelta(seconds=1), run_id="00")
