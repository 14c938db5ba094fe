"""The run profile: pure summaries of records, quantiles and the profiler fed by hand."""

from __future__ import annotations

import itertools
import math
import random
import tracemalloc
from typing import Any

import pytest

from flasync.config import DiagnosticsConfig
from flasync.core.bus import EventBus
from flasync.core.events import (
    Aggregated,
    AlertRaised,
    ClientId,
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
from flasync.observe.profiling import Instrumentation, Profiler, VersionRows, build_profile, headline, quantiles
from flasync.testing import EventRecorder, NullLog
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


def test_a_batch_of_tasks_on_several_models_counts_each_ones_download() -> None:
    """Tasks handed out together on models of different sizes (and on a model whose size is not known) count each
    client's download and the run's as the same tasks one by one do."""
    together, alone = Profiler("async"), Profiler("async")
    sizes = {0: 400, 1: 1_000}
    tasks = [
        TaskAssigned(
            task_id=k, client_id=ClientId(k % 3), participation=k // 3, base_version=Version(v), simulated_s=0.0
        )
        for k, v in enumerate([0, 0, 1, 2, 1, 0, 1])
    ]
    for profiler in (together, alone):
        for version, size in sizes.items():
            profiler.observe(
                ModelPublished(version=Version(version), simulated_s=0.0, download_bytes=size, encode_s=0.0)
            )
    together.observe_many(tasks)
    together.observe_many([])
    for task in tasks:
        alone.observe(task)
    assert together.records.clients == alone.records.clients
    assert {c: r.download_bytes for c, r in together.records.clients.items()} == {0: 1_400, 1: 1_400, 2: 1_400}
    assert together.records.downloads == alone.records.downloads == 7
    assert together.records.download_tiers == alone.records.download_tiers == {"client": 4_200}


def test_batches_past_the_summaries_capacity_keep_the_samples_one_at_a_time_keeps() -> None:
    """Batches of tasks, uploads and receipts of 5,000 updates (past the 4,096 values a summary keeps, so its random
    stream replaces kept values) leave the same per-client totals, kept samples and rows as the events one by one."""
    n, clients = 5_000, 37
    publish = ModelPublished(version=Version(0), simulated_s=0.0, download_bytes=1_000, encode_s=0.0)
    tasks = [
        TaskAssigned(
            task_id=k, client_id=ClientId(k % clients), participation=0, base_version=Version(0), simulated_s=0.0
        )
        for k in range(n)
    ]
    uploads = [
        UpdateUploaded(
            task_id=k,
            client_id=ClientId(k % clients),
            base_version=Version(0),
            num_samples=10,
            payload=bytes(8 + k % 5),
            train_loss=0.5,
            simulated_s=1.0,
            sent_wall_s=0.0,
            compute_s=0.001 * (k % 97),
            encode_s=0.0001 * (k % 13),
            sim_train_s=0.1 * (k % 31),
            sim_download_s=0.01 * (k % 7),
            sim_upload_s=0.02 * (k % 11),
            peak_mem_bytes=1_000 + k,
            download_bytes=1_000,
        )
        for k in range(n)
    ]
    received = [
        UpdateReceived(
            task_id=k,
            client_id=ClientId(k % clients),
            base_version=Version(0),
            version=Version(0),
            staleness=k % 3,
            upload_bytes=8 + k % 5,
            simulated_s=1.0,
            decode_s=0.001 * (k % 5),
            queue_wait_s=0.002 * (k % 3),
        )
        for k in range(n)
    ]
    together, alone = Profiler("sync"), Profiler("sync")
    for profiler in (together, alone):
        profiler.observe(publish)
    for members in (tasks, uploads, received):
        for first in range(0, n, 1_000):
            together.observe_many(members[first : first + 1_000])
        for event in members:
            alone.observe(event)
    aggregated = Aggregated(
        version=Version(1), num_updates=n, mean_staleness=1.0, aggregate_s=0.0, simulated_s=2.0, wall_s=0.1
    )
    records = []
    for profiler in (together, alone):
        profiler.observe(aggregated)
        records.append(profiler.finish())
    for name in ("sim_task_s", "sim_train_s", "compute_s", "encode_s", "peak_mem_bytes"):
        kept = [getattr(r, name) for r in records]
        assert kept[0].count == n and kept[0]._sample == kept[1]._sample and kept[0].total == kept[1].total
    assert records[0].clients == records[1].clients
    assert records[0].downloads == records[1].downloads == n
    assert records[0].download_tiers == records[1].download_tiers == {"client": 1_000 * n}
    profiles = [build_profile(r, mode="sync", num_params=4, dense_bytes=32) for r in records]
    assert profiles[0] == profiles[1]


def _random_stream(rng: random.Random, n: int) -> list[list[Any]]:
    """Batches of tasks, uploads and receipts of ``n`` updates: tiers mixed, some uploads never received, some receipts
    of unknown tasks or repeated task ids, and receipts of one batch spread over consecutive versions."""
    batches: list[list[Any]] = []
    task_id = 0
    for version in range(n // 40):
        size = rng.choice([1, 2, 5, 40, 90])
        ids = [task_id + k for k in range(size)]
        task_id += size
        if rng.random() < 0.2:
            ids[-1] = ids[0]  # a task id uploaded twice
        clients = [ClientId(rng.randrange(30)) for _ in ids]
        batches.append(
            [
                TaskAssigned(task_id=t, client_id=c, participation=0, base_version=Version(version), simulated_s=0.0)
                for t, c in zip(ids, clients, strict=True)
            ]
        )
        batches.append(
            [
                UpdateUploaded(
                    task_id=t,
                    client_id=c,
                    base_version=Version(version),
                    num_samples=10,
                    payload=bytes(rng.randrange(1, 40)),
                    extra=bytes(rng.choice([0, 3])),
                    train_loss=0.5,
                    simulated_s=1.0,
                    sent_wall_s=0.0,
                    tier=rng.choice(["client", "client", "edge-a"]),
                    compute_s=rng.random(),
                    encode_s=rng.random() * 1e-3,
                    sim_train_s=rng.expovariate(1.0),
                    sim_download_s=rng.random() * 0.1,
                    sim_upload_s=rng.random() * 0.2,
                    peak_mem_bytes=rng.randrange(1 << 20),
                    download_bytes=rng.randrange(1 << 12),
                )
                for t, c in zip(ids, clients, strict=True)
            ]
        )
        received = [t for t in ids if rng.random() < 0.9] + [10**9 + task_id]  # the last was never uploaded
        batches.append(
            [
                UpdateReceived(
                    task_id=t,
                    client_id=ClientId(0),
                    base_version=Version(version),
                    version=Version(version + (k * 3 // len(received))),
                    staleness=rng.randrange(4),
                    upload_bytes=1,
                    simulated_s=1.0,
                    decode_s=rng.random() * 1e-2,
                    queue_wait_s=rng.random() * 1e-3,
                )
                for k, t in enumerate(received)
            ]
        )
        batches.append(
            [
                Aggregated(
                    version=Version(version + 1),
                    num_updates=size,
                    mean_staleness=0.0,
                    aggregate_s=rng.random(),
                    simulated_s=float(version),
                    wall_s=float(version + 1),
                )
            ]
        )
    return batches


@pytest.mark.parametrize(("seed", "mode", "in_flight"), [(0, "sync", 65_536), (1, "async", 65_536), (2, "sync", 64)])
@pytest.mark.slow
def test_random_batches_leave_the_records_of_their_events_one_by_one(
    seed: int, mode: str, in_flight: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random batches (past the summaries' capacity, and past the bound on uploads waiting for their version when it is
    small) leave exactly the records, samples and profile that observing their events one by one leaves."""
    monkeypatch.setattr("flasync.observe.profiling._IN_FLIGHT", in_flight)
    together, alone = Profiler(mode), Profiler(mode)
    for profiler in (together, alone):
        profiler.observe(ModelPublished(version=Version(0), simulated_s=0.0, download_bytes=64))
    for batch in _random_stream(random.Random(seed), 10_000):
        together.observe_many(batch)
        for event in batch:
            alone.observe(event)
    records = [together.finish(), alone.finish()]
    assert records[0].pending == records[1].pending
    assert records[0].dropped_pending == records[1].dropped_pending
    assert (records[0].dropped_pending > 0) == (in_flight < 1_000)
    assert records[0].clients == records[1].clients
    assert records[0].tier_uploads == records[1].tier_uploads
    assert records[0].staleness == records[1].staleness
    assert records[0].rows.rows() == records[1].rows.rows()
    for name in ("sim_task_s", "sim_train_s", "compute_s", "encode_s", "peak_mem_bytes"):
        kept = [getattr(r, name) for r in records]
        assert kept[0].count > 4_096
        assert (kept[0].count, kept[0].total, kept[0].max) == (kept[1].count, kept[1].total, kept[1].max)
        assert kept[0]._sample == kept[1]._sample
    assert records[0].rng.getstate() == records[1].rng.getstate()
    profiles = [build_profile(r, mode=mode, num_params=4, dense_bytes=32) for r in records]
    assert profiles[0] == profiles[1]


def test_events_published_one_by_one_are_profiled_as_the_profiler_observes_them() -> None:
    """Tasks, uploads, receipts and versions published one by one reach the instrumentation's profiler, through the
    handler it keeps per event class, with exactly the records that observing each event directly leaves."""
    bus, through_bus, _, _ = _instrumented()
    direct = Profiler("sync")
    for batch in _random_stream(random.Random(5), 10_000):
        for event in batch:
            bus.publish_nowait(event)
            direct.observe(event)
    records = [through_bus.finish(), direct.finish()]
    assert records[0].clients == records[1].clients and records[0].pending == records[1].pending
    assert records[0].downloads == records[1].downloads > 0
    assert records[0].sim_task_s._sample == records[1].sim_task_s._sample
    profiles = [build_profile(r, mode="sync", num_params=4, dense_bytes=32) for r in records]
    assert profiles[0] == profiles[1]


@pytest.mark.parametrize(("seed", "mode"), [(3, "sync"), (4, "async")])
def test_lone_event_handlers_record_what_batches_of_one_record(seed: int, mode: str) -> None:
    """Tasks and receipts handed one by one to the profiler's per-class handlers (a buffered server's lone events),
    between batches that fold into the same versions, leave exactly the records, samples and rows that the same
    events as batches of one leave."""
    rng = random.Random(seed)
    alone, batched = Profiler(mode), Profiler(mode)
    for profiler in (alone, batched):
        profiler.observe(ModelPublished(version=Version(0), simulated_s=0.0, download_bytes=64))
    for batch in _random_stream(rng, 10_000):
        if rng.random() < 0.3:
            alone.observe_many(batch)
        else:
            for event in batch:
                alone.handler(type(event))(event)
        for event in batch:
            batched.observe_many([event])
    records = [alone.finish(), batched.finish()]
    assert records[0].clients == records[1].clients and records[0].downloads == records[1].downloads > 0
    assert records[0].download_tiers == records[1].download_tiers
    assert records[0].pending == records[1].pending and records[0].staleness == records[1].staleness
    assert records[0].rows.rows() == records[1].rows.rows() and records[0].rows.rows()
    assert records[0].rng.getstate() == records[1].rng.getstate()
    profiles = [build_profile(r, mode=mode, num_params=4, dense_bytes=32) for r in records]
    assert profiles[0] == profiles[1]


class _SortingProfiler(Profiler):
    """The profiler as it closed rows before it kept the versions made in order: every aggregated open version
    before the new one, found and sorted on each version."""

    def _aggregated(self, event: Aggregated) -> None:
        r = self.records
        version = int(event.version)
        for done in sorted(v for v in r.open_versions if v < version and r.open_versions[v].aggregated):
            self._close(done)
        self._version = max(self._version, version)
        rec = r.open_versions[version]
        rec.aggregate_s += event.aggregate_s
        rec.wall_s = event.wall_s
        rec.simulated_s = event.simulated_s
        rec.aggregated = True

    def finish(self) -> Any:
        r = self.records
        for version in sorted(v for v in r.open_versions if r.open_versions[v].aggregated):
            self._close(version)
        return r


@pytest.mark.parametrize(("seed", "mode"), [(6, "sync"), (7, "async")])
def test_versions_made_out_of_order_or_twice_close_the_rows_a_sort_over_open_versions_closes(
    seed: int, mode: str
) -> None:
    """Versions made in order, out of order and twice, published and evaluated, through the profiler's per-class
    handlers, close the same rows at the same times as sorting the open versions on every version did."""
    rng = random.Random(seed)
    kept, sorting = Profiler(mode), _SortingProfiler(mode)
    events: list[Any] = []
    for batch in _random_stream(rng, 4_000):
        for event in batch:
            events.append(event)
            if isinstance(event, Aggregated) and rng.random() < 0.5:
                version = max(0, int(event.version) + rng.randrange(-3, 3))
                events.append(ModelPublished(version=Version(version), simulated_s=0.0, download_bytes=8, encode_s=0.1))
                events.append(
                    Evaluated(version=Version(version), accuracy=0.5, loss=1.0, simulated_s=0.0, wall_s=0.0, eval_s=0.2)
                )
                events.append(
                    Aggregated(
                        version=Version(version),
                        num_updates=1,
                        mean_staleness=0.0,
                        aggregate_s=rng.random(),
                        simulated_s=1.0,
                        wall_s=rng.random() * 100,
                    )
                )
    for event in events:
        kept.handler(type(event))(event)
        sorting.observe(event)
        if isinstance(event, Aggregated):
            assert kept.records.rows.rows() == sorting.records.rows.rows()
    records = [kept.finish(), sorting.finish()]
    assert not records[0].made and len(records[0].rows.rows()) > 25
    assert records[0].rows.rows() == records[1].rows.rows()
    profiles = [build_profile(r, mode=mode, num_params=4, dense_bytes=32) for r in records]
    assert profiles[0] == profiles[1]
