"""Central differential privacy in whole runs: epsilon logged per version, determinism, rules that cannot be private."""

from __future__ import annotations

import math

import pytest

from flasync.core.errors import ConfigError
from flasync.runtime.federation import Federation
from flasync.testing import MemoryTracker, small_config
from tests.conftest import NEEDS_DP_ACCOUNTING

pytestmark = [pytest.mark.timeout(60), NEEDS_DP_ACCOUNTING]


# ----------------------------------------------------------------------------------------------- whole runs
@pytest.mark.parametrize("server", ["fedbuff", "fedavg"])
@pytest.mark.slow
async def test_a_private_run_logs_epsilon_per_version_and_is_deterministic(server: str) -> None:
    """Epsilon per version as a metric, in the summary and the params; the same seed, the same weights."""
    kind = "{kind: fedavg, clients_per_round: 4}" if server == "fedavg" else "{kind: fedbuff, buffer_size: 4}"
    overrides = ["privacy.enabled=true", "privacy.target_epsilon=5", f"server={kind}", "stop.max_versions=8"]
    trackers = [MemoryTracker(), MemoryTracker()]
    summaries = [await Federation(small_config(*overrides), tracker=t).run() for t in trackers]
    first, tracker = summaries[0], trackers[0]
    assert first.weights_sha256 == summaries[1].weights_sha256
    history = tracker.history("server/privacy/epsilon")
    assert [step for step, _ in history] == list(range(1, first.versions + 1))
    values = [value for _, value in history]
    assert values == sorted(values) and values[-1] == pytest.approx(first.privacy_epsilon)
    assert first.privacy_epsilon == pytest.approx(5.0, rel=0.02)  # calibrated for the 8 versions it ran
    assert tracker.params["privacy.resolved.noise_multiplier"] > 0
    plain = await Federation(small_config(*overrides[2:])).run()
    assert plain.weights_sha256 != first.weights_sha256  # the noise is really added
    assert math.isnan(plain.privacy_epsilon)


def test_a_custom_aggregation_rule_cannot_be_private() -> None:
    """A user's rule would publish sums without noise: Federation refuses the pair with one line."""
    from flasync.runtime.build import make_aggregator

    with pytest.raises(ConfigError, match=r"^privacy\.enabled: .*custom"):
        Federation(small_config("privacy.enabled=true", "privacy.noise_multiplier=1"), aggregator=make_aggregator)
