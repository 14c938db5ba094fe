"""The tracker a run's config asks for (flasync.runtime.tracked)."""

from __future__ import annotations

from pathlib import Path

from flasync.runtime import tracked
from flasync.testing import small_config


def test_the_tracker_follows_the_tracking_section(tmp_path: Path) -> None:
    """The store and the system monitor's interval come from the config (the CLI and the runtime build it alike)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = small_config("tracking.enabled=true", f"tracking.uri={uri}", "tracking.system_metrics_interval_s=0.25")
    tracker = tracked.mlflow_tracker(config)
    assert tracker.tracking_uri == uri
    assert tracker.system_metrics_interval_s == 0.25
    assert tracked.mlflow_tracker(small_config("tracking.enabled=true")).system_metrics_interval_s == 2.0
