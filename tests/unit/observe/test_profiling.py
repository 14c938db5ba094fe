"""The run profile: pure summaries of records, and profiles of controlled runs."""

from __future__ import annotations

import itertools
import json
import math
import random
import tracemalloc
from typing import Any

import pytest

import flasync
from flasync.config import DiagnosticsConfig
from flasync.core.bus import EventBus
from flasync.core.events import (
    Aggregated,
    AlertRaised,
    ClientId,
    EdgeForwarded,
    Evaluated,
    ModelPublished,
    RunFinished,
    TaskAssigned,
    TaskDiagnosis,
    TasksAssigned,
    UpdateReceived,
    UpdatesReceived,
    UpdatesUploaded,
    UpdateUploaded,
    Version,
)
from flasync.core.quantiles import StreamSummary, Thinned, counted_percentile
from flasync.observe.plots import render_plots
from flasync.observe.profiling import Instrumentation, Profiler, VersionRows, build_profile, headline, quantiles
from flasync.testing import EventRecorder, MemoryTracker, NullLog, small_config
from flasync.training.diagnostics import AlertMonitor


def test_quantiles_interpolate() -> None:
    """p50/p90 interpolate linearly between order statistics."""
    summary = quantiles([float(v) for v in range(11)])
    assert summary == {"p50": 5.0, "p90": 9.0, "max": 10.0, "mean": 5.0, "count": 11.0}
    assert quantiles([]) is None


def _feed(profiler: Profiler) -> None:
    """One sync round of three clients (simulated tasks of 1, 2 and 6 s) producing version 1."""
    profiler.observe(ModelPublished(version=Version(0), simulated_s=0.0, download_bytes=100, encode_s=0.5))
    for task_id, (client, train_s) in enumerate([(0, 1.0), (1, 2.0), (2, 6.0)]):
        cid = ClientId(client)
        profiler.observe(
            TaskAssigned(task_id=task_id, client_id=cid, participation=0, base_version=Version(0), simulated_s=0.0)
        )
        profiler.observe(
            UpdateUploaded(
                task_id=task_id,
                client_id=cid,
                base_version=Version(0),
                num_samples=10,
                payload=b"x" * (10 + client),
                train_loss=1.0,
                simulated_s=train_s,
                sent_wall_s=0.0,
                compute_s=1.0,
                encode_s=0.25,
                sim_train_s=train_s,
                sim_download_s=0.0,
                sim_upload_s=0.0,
                download_bytes=100,
            )
        )
        profiler.observe(
            UpdateReceived(
                task_id=task_id,
                client_id=cid,
                base_version=Version(0),
                version=Version(0),
                staleness=0,
                upload_bytes=10 + client,
                simulated_s=train_s,
                decode_s=0.5,
                queue_wait_s=0.125,
            )
        )
    profiler.observe(ModelPublished(version=Version(1), simulated_s=6.0, download_bytes=100, encode_s=0.5))
    profiler.observe(
        Aggregated(version=Version(1), num_updates=3, mean_staleness=0.0, aggregate_s=1.0, simulated_s=6.0, wall_s=10.0)
    )
    profiler.observe(RunFinished(reason="max_versions", versions=1, updates_accepted=3, simulated_s=6.0, wall_s=10.0))


def test_build_profile_breaks_down_a_round() -> None:
    """The breakdown sums the round's costs; idle is the rest of the wall interval; sync straggler wait = max - p50."""
    profiler = Profiler("sync")
    _feed(profiler)
    profile = build_profile(profiler.finish(), mode="sync", num_params=4, dense_bytes=40, stragglers=2)
    (row,) = profile["time"]["per_version"]
    assert row["compute_s"] == 3.0
    assert row["encode_s"] == 3 * 0.25 + 0.5  # clients' uploads + the published download of version 1
    assert row["decode_s"] == 1.5 and row["queue_wait_s"] == 0.375 and row["aggregate_s"] == 1.0
    assert row["idle_s"] == 10.0 - (1.5 + 1.0 + 0.5)
    assert row["straggler_wait_sim_s"] == 6.0 - 2.0
    assert row["upload_bytes"] == 33 and row["download_bytes"] == 300
    stragglers = profile["clients"]["stragglers"]
    assert [s["client_id"] for s in stragglers] == [2, 1]
    assert stragglers[0]["times_median"] == 3.0
    comm = profile["communication"]
    assert comm["upload_bytes"] == 33 and comm["download_bytes"] == 300
    assert comm["per_tier"] == {"client": {"upload_bytes": 33, "download_bytes": 300}}
    assert comm["upload_compression"] == pytest.approx(40 * 3 / 33)
    assert profile["staleness"]["histogram"] == {"0": 3}
    figures = headline(profile)
    assert figures["time_idle_s"] == 7.0 and figures["client_upload_bytes"] == 33.0


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
    [(_, logged_rss)] = tracker.history("run/finished/peak_rss_bytes")
    assert logged_rss > 0  # the run.finished event carries it too, not only summary.json


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


async def test_no_instrumentation_switch() -> None:
    """With profile off and level off, nothing subscribes and no profile is written; weights are unchanged."""
    tracker = MemoryTracker()
    federation = flasync.Federation(small_config("diagnostics.profile=false", "diagnostics.level=off"), tracker=tracker)
    bare = await federation.run()
    assert federation.profile is None and "profile.json" not in tracker.artifacts
    assert math.isnan(bare.server_idle_fraction)
    instrumented = await flasync.Federation(small_config("diagnostics.level=full")).run()
    assert bare.weights_sha256 == instrumented.weights_sha256


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


def test_profiles_and_diagnostics_share_one_percentile_definition() -> None:
    """Profile quantiles, streamed summaries and diagnostics interpolate linearly between ranks, as numpy does."""
    import numpy as np

    from flasync.core.quantiles import percentile
    from flasync.observe.profiling import quantiles

    values = [5.0, 1.0, 4.0, 2.0, 10.0, 3.0]
    stream = StreamSummary(16, random.Random(0))
    for value in values:
        stream.add(value)
    for p in (0.1, 0.5, 0.9):
        assert percentile(sorted(values), p) == pytest.approx(float(np.quantile(values, p)))
        assert stream.quantile(p) == percentile(sorted(values), p)
    assert quantiles(values) == stream.summary()
    counts = {0: 3, 1: 5, 4: 1, 9: 2}
    expanded = sorted(v for v, n in counts.items() for _ in range(n))
    for p in (0.0, 0.1, 0.5, 0.77, 0.9, 1.0):
        assert counted_percentile(counts, p) == pytest.approx(percentile(expanded, p))


def test_stream_summary_is_exact_up_to_capacity_then_a_bounded_uniform_sample() -> None:
    """Quantiles are exact while every value fits; beyond, the sample stays at capacity and near the true quantiles."""
    exact = StreamSummary(1000, random.Random(1))
    for value in range(1000):
        exact.add(float(value))
    assert exact.summary() == quantiles([float(v) for v in range(1000)])

    stream = StreamSummary(2000, random.Random(1))
    for value in range(200_000):
        stream.add(float(value % 1000))
    summary = stream.summary()
    assert summary is not None
    assert len(stream.sample) == 2000
    assert (summary["count"], summary["max"], summary["mean"]) == (200_000.0, 999.0, 499.5)
    assert summary["p50"] == pytest.approx(500, abs=40)
    assert summary["p90"] == pytest.approx(900, abs=30)
    again = StreamSummary(2000, random.Random(1))
    for value in range(200_000):
        again.add(float(value % 1000))
    assert again.sample == stream.sample  # the same generator keeps the same values


def test_thinned_series_stays_bounded_evenly_spaced_and_ends_with_the_latest() -> None:
    """Every item up to capacity; then every 2^k-th, never more than capacity (+ the latest)."""
    series: Thinned[int] = Thinned(8)
    for item in range(5):
        series.add(item)
    assert series.items() == [0, 1, 2, 3, 4]
    for item in range(5, 100):
        series.add(item)
    kept = series.items()
    assert len(kept) <= 9 and kept[0] == 0 and kept[-1] == 99
    steps = {b - a for a, b in itertools.pairwise(kept[:-1])}
    assert len(steps) == 1  # evenly spaced (the latest aside)


def test_version_rows_merge_in_pairs_and_keep_exact_totals() -> None:
    """Past capacity, neighbouring rows merge: at most capacity rows, every version covered once, sums unchanged."""
    rows = VersionRows(capacity=4)
    for v in range(1, 12):
        rows.add(
            {
                "version": float(v),
                "versions": 1.0,
                "updates": 2.0,
                "wall_s": 1.0,
                "compute_s": float(v),
                "staleness_mean": float(v % 3),
                "simulated_s": 10.0 * v,
            }
        )
    kept = rows.rows()
    assert len(kept) <= 4
    assert sum(r["versions"] for r in kept) == 11
    assert sum(r["compute_s"] for r in kept) == sum(range(1, 12))
    assert kept[-1]["version"] == 11.0 and kept[-1]["simulated_s"] == 110.0
    stale_total = sum(r["staleness_mean"] * r["updates"] for r in kept)
    assert stale_total == pytest.approx(sum(2.0 * (v % 3) for v in range(1, 12)))


def _feed_async(profiler: Profiler, first_version: int, versions: int, clients: int = 200) -> None:
    """FedBuff-like traffic: 10 uploads per version from a fixed population, an evaluation every version."""
    task = first_version * 10
    for v in range(first_version, first_version + versions):
        profiler.observe(ModelPublished(version=Version(v), simulated_s=float(v), download_bytes=100, encode_s=0.01))
        for _ in range(10):
            cid = ClientId(task % clients)
            profiler.observe(
                TaskAssigned(task_id=task, client_id=cid, participation=0, base_version=Version(v), simulated_s=0.0)
            )
            profiler.observe(
                UpdateUploaded(
                    task_id=task,
                    client_id=cid,
                    base_version=Version(v),
                    num_samples=10,
                    payload=b"x" * 50,
                    train_loss=1.0,
                    simulated_s=float(v),
                    sent_wall_s=0.0,
                    compute_s=0.001 * (task % 7),
                    encode_s=0.001,
                    sim_train_s=1.0 + task % 5,
                    sim_download_s=0.1,
                    sim_upload_s=0.1,
                    download_bytes=100,
                )
            )
            profiler.observe(
                UpdateReceived(
                    task_id=task,
                    client_id=cid,
                    base_version=Version(v),
                    version=Version(v),
                    staleness=task % 3,
                    upload_bytes=50,
                    simulated_s=float(v),
                    decode_s=0.001,
                    queue_wait_s=0.001,
                )
            )
            task += 1
        profiler.observe(
            Aggregated(
                version=Version(v + 1),
                num_updates=10,
                mean_staleness=1.0,
                aggregate_s=0.01,
                simulated_s=float(v + 1),
                wall_s=0.1 * (v + 1),
            )
        )
        profiler.observe(
            Evaluated(
                version=Version(v + 1), accuracy=0.5, loss=1.0, simulated_s=float(v + 1), wall_s=0.1 * v, eval_s=0.01
            )
        )


@pytest.mark.slow
def test_profiler_memory_does_not_grow_with_updates() -> None:
    """A long run's records stay bounded: 40,000 more updates from the same clients add almost nothing.

    (The records used to keep every task: about 1 KiB per update, 100 MiB here.)
    """
    profiler = Profiler()
    tracemalloc.start()
    try:
        _feed_async(profiler, 0, 2_000)  # past every bound (4,096 values per summary, 1,024 rows)
        before = tracemalloc.get_traced_memory()[0]
        _feed_async(profiler, 2_000, 4_000)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 256 * 1024, f"records grew by {grown} bytes over 40,000 updates"
    records = profiler.finish()
    assert not records.pending
    profile = build_profile(records, mode="async", num_params=10, dense_bytes=60)
    assert profile["versions"] == 6_000
    assert profile["clients"]["tasks_completed"] == 60_000
    assert profile["clients"]["participants"] == 200
    assert len(profile["time"]["per_version"]) <= 1024
    assert profile["time"]["totals"]["aggregate_s"] == pytest.approx(60.0)
    assert profile["communication"]["upload_bytes"] == 60_000 * 50
    assert profile["staleness"]["summary"]["count"] == 60_000
    assert profile["staleness"]["summary"]["p50"] == 1.0
    assert len(profile["evaluations"]) <= 1025 and profile["evaluations"][-1]["version"] == 6_000


def _instrumented() -> tuple[Any, Any, EventRecorder, NullLog]:
    bus, log = EventBus(), NullLog()
    recorder = EventRecorder(bus)
    profiler = Profiler("sync")
    Instrumentation(bus, profiler=profiler, monitor=AlertMonitor(DiagnosticsConfig()), log=log, now=lambda: 1.0)
    return bus, profiler, recorder, log


def test_a_batch_is_profiled_and_alerted_as_its_events_one_by_one() -> None:
    """Tasks, uploads (a NaN and an exploding one among them) and receipts sent as three batches leave the profile,
    the alerts and the log lines that the same events sent one by one leave."""
    n = 8
    tasks = [
        TaskAssigned(task_id=k, client_id=ClientId(k), participation=0, base_version=Version(0), simulated_s=0.0)
        for k in range(n)
    ]
    norms = [1.0, 1.1, 0.9, 1.0, 1.2, math.nan, 50.0, 1.0]
    uploads = [
        UpdateUploaded(
            task_id=k,
            client_id=ClientId(k),
            base_version=Version(0),
            num_samples=10 + k,
            payload=bytes(16 + k),
            train_loss=0.5,
            simulated_s=2.0,
            sent_wall_s=0.0,
            compute_s=0.01 * k,
            diagnosis=TaskDiagnosis(update_norm=norms[k], update_finite=not math.isnan(norms[k])),
        )
        for k in range(n)
    ]
    received = [
        UpdateReceived(
            task_id=k,
            client_id=ClientId(k),
            base_version=Version(0),
            version=Version(0),
            staleness=0,
            upload_bytes=16 + k,
            simulated_s=2.0,
        )
        for k in range(n)
    ]
    together, alone = _instrumented(), _instrumented()
    for batch, members in ((TasksAssigned, tasks), (UpdatesUploaded, uploads), (UpdatesReceived, received)):
        together[0].publish_nowait(batch.of(tuple(members)))
        for event in members:
            alone[0].publish_nowait(event)
    for bus, *_ in (together, alone):
        bus.publish_nowait(
            Aggregated(
                version=Version(1), num_updates=n, mean_staleness=0.0, aggregate_s=0.0, simulated_s=2.0, wall_s=0.1
            )
        )
    profiles = [
        build_profile(profiler.finish(), mode="sync", num_params=4, dense_bytes=32)
        for _, profiler, _, _ in (together, alone)
    ]
    assert profiles[0] == profiles[1]
    alerts = [[(a.kind, a.client_id) for a in recorder.of(AlertRaised)] for _, _, recorder, _ in (together, alone)]
    assert alerts[0] == alerts[1] == [("nan", 5), ("exploding_update", 6)]
    assert together[3].records == alone[3].records
