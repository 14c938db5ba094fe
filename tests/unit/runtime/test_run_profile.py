"""Where each segment of a run puts its profile."""

from __future__ import annotations

from flasync.runtime.run_profile import profile_artifact, segment


def test_a_finished_segment_is_profile_json_and_a_stopped_one_names_its_versions() -> None:
    """profile.json for a segment that finished (or a profile without a segment); profile-v<a>-v<b>.json if stopped."""
    assert profile_artifact({"segment": segment(first_version=6, last_version=10, stopped=False)}) == "profile.json"
    assert profile_artifact({}) == "profile.json"
    stopped = {"segment": segment(first_version=0, last_version=7, stopped=True)}
    assert profile_artifact(stopped) == "profile-v0-v7.json"
