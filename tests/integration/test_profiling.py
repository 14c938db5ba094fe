"""The run profile of controlled runs: stragglers, payload bytes, artifacts, plots, tiers, and switching it off."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

import flasync
from flasync.core.errors import RunInterrupted
from flasync.core.events import (
    Aggregated,
    EdgeForwarded,
    UpdateReceived,
    UpdateUploaded,
)
from flasync.observe.plots import render_plots
from flasync.observe.profiling import headline
from flasync.runtime import checkpoint
from flasync.testing import EventRecorder, MemoryTracker, small_config


async def test_slow_client_is_named_first_straggler() -> None:
    """A client with a fixed 3x slowdown is the first straggler, about 3x the median, in profile and summary."""
    config = small_config(
        "population.num_clients=8",
        "population.speed={kind: constant, seconds_per_step: 0.05}",
        "population.slow_clients={5: 3.0}",
        "stop.max_versions=3",
        server={"kind": "fedavg", "clients_per_round": 8},
    )
    federation = flasync.Federation(config)
    summary = await federation.run()
    assert federation.profile is not None
    first = federation.profile["clients"]["stragglers"][0]
    assert first["client_id"] == 5
    assert first["times_median"] == pytest.approx(3.0, rel=0.15)
    assert summary.stragglers[0] == 5
    rows = federation.profile["time"]["per_version"]
    assert all(row["straggler_wait_sim_s"] > 0 for row in rows)


async def test_profiled_bytes_are_the_encoded_payload_lengths() -> None:
    """Bytes in the profile (total, per client, per tier, per version) and its metrics are the payloads' lengths."""
    tracker = MemoryTracker()
    config = small_config(codec={"upload": [{"kind": "topk", "ratio": 0.1}, {"kind": "int8"}]})
    federation = flasync.Federation(config, tracker=tracker)
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    assert federation.profile is not None
    comm = federation.profile["communication"]
    uploads = recorder.of(UpdateUploaded)
    total = sum(len(e.payload) for e in uploads)
    assert comm["upload_bytes"] == total == summary.upload_bytes
    assert comm["per_tier"]["client"]["upload_bytes"] == total
    per_client: dict[int, int] = {}
    for event in uploads:
        per_client[event.client_id] = per_client.get(event.client_id, 0) + len(event.payload)
    assert comm["upload_bytes_per_client"]["max"] == max(per_client.values())
    received = {e.task_id for e in recorder.of(UpdateReceived)}
    rows = federation.profile["time"]["per_version"]
    assert sum(r["upload_bytes"] for r in rows) == sum(len(e.payload) for e in uploads if e.task_id in received)
    assert comm["download_bytes"] == summary.download_bytes
    assert comm["upload_compression"] > 5
    assert headline(federation.profile)["client_upload_bytes"] == float(total)
    assert not [key for key in tracker.metric_keys() if key.startswith("profile/") and "/version/" not in key]
    keys = tracker.metric_keys()
    assert "profile/version/versions" not in keys  # a constant 1: not a series
    # What server/version/* logs at the same steps is not logged twice; profile.json keeps it.
    for field in ("updates", "aggregate_s", "simulated_s", "staleness_mean"):
        assert f"server/version/{field}" in keys and f"profile/version/{field}" not in keys
        assert all(field in row for row in rows)
    assert {"profile/version/wall_s", "profile/version/idle_s", "profile/version/compute_s"} <= keys
    server_updates = dict(tracker.history("server/version/updates"))
    assert server_updates == {int(row["version"]): row["updates"] for row in rows}


async def test_profile_json_and_plots_are_artifacts() -> None:
    """profile.json and the SVG plots are logged, non-empty (no bytes plot for a dense run); the profile carries
    every section."""
    tracker = MemoryTracker()
    summary = await flasync.Federation(small_config(), tracker=tracker).run()
    profile = json.loads(tracker.artifacts["profile.json"])
    assert profile.keys() >= {"time", "clients", "communication", "staleness", "memory", "diagnostics", "evaluations"}
    assert len(profile["time"]["per_version"]) == summary.versions
    assert profile["memory"]["peak_rss_bytes"] > 0 and profile["memory"]["model_bytes"] > 0
    assert profile["memory"]["training_call_peak_bytes"]["max"] > profile["memory"]["model_bytes"]
    plots = {k: v for k, v in tracker.artifacts.items() if k.startswith("plots/")}
    assert set(plots) == {f"plots/{name}.svg" for name in ("accuracy", "staleness", "time_breakdown", "client_times")}
    assert all(image.startswith(b"<svg ") and len(image) > 1000 for image in plots.values())
    assert summary.peak_rss_bytes > 0 and 0 <= summary.server_idle_fraction <= 1
    assert int(tracker.tags["finished.peak_rss_bytes"]) > 0  # the run's tags carry it too, not only summary.json


@pytest.mark.slow
async def test_plots_of_a_long_run_stay_readable_and_only_say_something() -> None:
    """Beyond 60 versions each bar is the mean of consecutive versions (at most 60 bars); the bytes plot is drawn
    only when an update's size varies (top-k here), not for a dense run whose bars would all be alike; the staleness
    histogram only when staleness varies (not for FedAvg's rounds)."""
    from flasync.observe.plots import _binned

    tracker = MemoryTracker()
    await flasync.Federation(small_config("stop.max_versions=80", "eval.every_versions=40"), tracker=tracker).run()
    profile = json.loads(tracker.artifacts["profile.json"])
    rows = profile["time"]["per_version"]
    assert len(rows) == 80
    bars = _binned(rows, 60)
    assert len(bars) == 40 and all(b["versions"] == 2 for b in bars)
    assert sum(b["compute_s"] for b in bars) == pytest.approx(sum(r["compute_s"] for r in rows))
    plots = render_plots(profile)
    assert set(plots) == {f"{name}.svg" for name in ("accuracy", "staleness", "time_breakdown", "client_times")}
    assert all(image.startswith(b"<svg ") and len(image) > 1000 for image in plots.values())
    sparse = MemoryTracker()
    config = small_config("stop.max_versions=8", "codec.upload=[{kind: topk, ratio: 0.05}]")
    await flasync.Federation(config, tracker=sparse).run()
    assert "bytes.svg" in render_plots(json.loads(sparse.artifacts["profile.json"]))
    rounds = MemoryTracker()
    fedavg = small_config("stop.max_versions=3", server={"kind": "fedavg", "clients_per_round": 5})
    await flasync.Federation(fedavg, tracker=rounds).run()
    assert "staleness.svg" not in render_plots(json.loads(rounds.artifacts["profile.json"]))  # one bar: staleness 0


@pytest.mark.slow
async def test_torch_profiler_trace_is_an_artifact() -> None:
    """diagnostics.torch_profiler_tasks=1 logs one Chrome trace of a local training call."""
    tracker = MemoryTracker()
    await flasync.Federation(
        small_config("diagnostics.torch_profiler_tasks=1", "stop.max_versions=1", "diagnostics.plots=false"),
        tracker=tracker,
    ).run()
    traces = [k for k in tracker.artifacts if k.startswith("torch_profiler/")]
    assert len(traces) == 1
    assert "traceEvents" in json.loads(tracker.artifacts[traces[0]])


@pytest.mark.slow
async def test_no_instrumentation_switch() -> None:
    """With profile off and level off, nothing subscribes and no profile is written; weights are unchanged."""
    tracker = MemoryTracker()
    federation = flasync.Federation(small_config("diagnostics.profile=false", "diagnostics.level=off"), tracker=tracker)
    bare = await federation.run()
    assert federation.profile is None and "profile.json" not in tracker.artifacts
    assert math.isnan(bare.server_idle_fraction)
    instrumented = await flasync.Federation(small_config("diagnostics.level=full")).run()
    assert bare.weights_sha256 == instrumented.weights_sha256


@pytest.mark.slow
async def test_hierarchy_bytes_per_tier() -> None:
    """With edges, the profile counts client uploads at tier client and the edges' forwards at their own tier."""
    config = small_config(topology={"kind": "tree", "fanout": [4], "buffer_size": 2})
    federation = flasync.Federation(config)
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    assert federation.profile is not None
    tiers = federation.profile["communication"]["per_tier"]
    forwarded = recorder.of(EdgeForwarded)
    assert tiers["client"]["upload_bytes"] == sum(len(e.payload) for e in recorder.of(UpdateUploaded))
    assert tiers["edge1"]["upload_bytes"] == sum(len(e.payload) for e in forwarded) > 0
    assert tiers["edge1"]["forwards"] == len(forwarded)
    rows = federation.profile["time"]["per_version"]
    assert len(rows) == summary.versions and sum(r["updates"] for r in rows) > 0


async def test_vectorized_cohorts_are_profiled_and_diagnosed() -> None:
    """Clients trained together in a vectorized cohort carry timings, bytes and update norms like solo ones."""
    federation = flasync.Federation(small_config("executor.kind=vectorized", "stop.max_versions=4"))
    recorder = EventRecorder(federation.bus)
    await federation.run()
    assert federation.profile is not None
    uploads = recorder.of(UpdateUploaded)
    assert all(e.diagnosis is not None and e.diagnosis.update_norm > 0 for e in uploads)
    assert federation.profile["communication"]["upload_bytes"] == sum(len(e.payload) for e in uploads)
    assert federation.profile["diagnostics"]["update_norm"]["count"] == len(uploads)


async def test_a_stopped_run_and_its_resumed_segment_each_log_their_profile() -> None:
    """A run stopped at version k logs profile-v0-v<k>.json and its profile/version/* series up to k; resumed into
    the same tracking run, it logs profile.json of its own versions and keeps the stopped segment's file."""
    config = small_config("stop.max_versions=10", "checkpoint.every_versions=2")
    tracker = MemoryTracker()
    federation = flasync.Federation(config, tracker=tracker)
    aggregated = federation.bus.subscribe(Aggregated, policy="drop_oldest")
    task = asyncio.create_task(federation.run())
    async for event in aggregated:
        if event.version >= 4:
            federation.request_stop("SIGINT")
            break
    with pytest.raises(RunInterrupted):
        await task
    assert tracker.status == "KILLED" and "profile.json" not in tracker.artifacts
    [(name, data)] = [(k, v) for k, v in tracker.artifacts.items() if k.startswith("profile")]
    stopped = json.loads(data)
    last = stopped["segment"]["last_version"]
    assert stopped["segment"] == {"first_version": 0, "last_version": last, "stopped": True} and last >= 4
    assert name == f"profile-v0-v{last}.json"
    assert [row["version"] for row in stopped["time"]["per_version"]] == list(range(1, last + 1))
    assert {step for step, _ in tracker.history("profile/version/wall_s")} == set(range(1, last + 1))

    resumed_config, state = checkpoint.decode(checkpoint.latest(tracker.artifacts))
    resume = checkpoint.ResumePoint(tracker.run_id, state)
    await flasync.Federation(resumed_config, tracker=tracker, resume=resume).run()
    assert tracker.status == "FINISHED" and json.loads(tracker.artifacts[name]) == stopped
    finished = json.loads(tracker.artifacts["profile.json"])
    first = int(state["version"])
    assert finished["segment"] == {"first_version": first, "last_version": 10, "stopped": False}
    assert [row["version"] for row in finished["time"]["per_version"]] == list(range(first + 1, 11))
    assert {step for step, _ in tracker.history("profile/version/wall_s")} == set(range(1, 11))
