"""Compression end to end: real bytes on the wire, error feedback, spilling residuals, bad payloads."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import flasync
import flasync.clients.simulated.client
import flasync.training.jobs
import flasync.training.local
from flasync.core.events import ModelPublished, UpdateRejected, UpdateUploaded
from flasync.testing import EventRecorder, MemoryTracker, small_config

TOPK_EF = [{"kind": "topk", "ratio": 0.01, "error_feedback": True}]


def _config(*overrides: str, upload: list[dict[str, Any]] | None = None, **sections: Any) -> flasync.RunConfig:
    codec = {"upload": upload if upload is not None else TOPK_EF}
    return small_config("tracking.log_level=debug", "tracking.metrics=all", *overrides, codec=codec, **sections)


async def test_upload_bytes_are_the_compressed_payloads() -> None:
    """With top-k 1%, logged upload bytes are the payload lengths, >= 30x below dense."""
    tracker = MemoryTracker()
    federation = flasync.Federation(_config(), tracker=tracker)
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    uploads = recorder.of(UpdateUploaded)
    assert summary.upload_bytes == sum(len(e.payload) for e in uploads)
    assert summary.upload_compression >= 30
    assert min(v for _, v in tracker.history("client/compression")) >= 30
    assert tracker.history("client/residual_norm")


@pytest.mark.slow
def test_error_feedback_runs_are_deterministic() -> None:
    """Top-k with error feedback gives the same weights with 1 and 3 threads."""
    one = flasync.run(_config("executor.workers=1"))
    three = flasync.run(_config("executor.workers=3"))
    assert one.weights_sha256 == three.weights_sha256


@pytest.mark.slow
def test_spilling_residuals_does_not_change_results(tmp_path: Any) -> None:
    """Residuals spilled to disk (2 kept in memory) give the same weights as residuals all in memory."""
    in_memory = flasync.run(_config())
    spilled = flasync.run(_config("codec.max_residuals_in_memory=2", f"codec.residual_dir={tmp_path}"))
    assert spilled.weights_sha256 == in_memory.weights_sha256
    assert list(tmp_path.iterdir()) == []  # spill files are removed at the end


@pytest.mark.slow
def test_error_feedback_beats_no_feedback() -> None:
    """Top-k 1% learns better with error feedback than without it."""
    overrides = ("stop.max_versions=40",)
    with_ef = flasync.run(_config(*overrides))
    without = flasync.run(_config(*overrides, upload=[{"kind": "topk", "ratio": 0.01, "error_feedback": False}]))
    assert with_ef.accuracy > without.accuracy


@pytest.mark.slow
def test_int8_is_about_four_times_smaller() -> None:
    """int8 uploads are about a quarter of dense float32 uploads."""
    dense = flasync.run(_config(upload=[]))
    int8 = flasync.run(_config(upload=[{"kind": "int8", "chunk": 256}]))
    assert 3.5 < dense.upload_bytes / int8.upload_bytes <= 4.0
    assert int8.accuracy > 0.5


@pytest.mark.slow
async def test_lossy_download_is_decoded_once_per_version() -> None:
    """An fp16 download halves download bytes; every version is published once."""
    federation = flasync.Federation(small_config(codec={"download": [{"kind": "fp16"}]}))
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    dense = await flasync.Federation(small_config()).run()
    assert summary.download_bytes < 0.51 * dense.download_bytes
    assert recorder.count(ModelPublished) == summary.versions + 1


@pytest.mark.slow
async def test_malformed_payloads_are_rejected_and_the_run_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Truncated, oversized and garbage payloads are dropped with reason 'decode'; the run completes."""
    original = flasync.training.jobs.train_job
    calls = {"n": 0}

    def corrupting(*args: Any, **kwargs: Any) -> flasync.training.jobs.TrainedUpdate:
        trained = original(*args, **kwargs)
        calls["n"] += 1
        bad = {1: trained.payload[:-3], 2: trained.payload + b"\0", 3: b"not an update at all"}.get(calls["n"] % 7)
        if bad is None:
            return trained
        return flasync.training.jobs.TrainedUpdate(
            result=trained.result,
            payload=bad,
            encode_s=trained.encode_s,
            extra=trained.extra,
            finished=trained.finished,
        )

    monkeypatch.setattr(flasync.clients.simulated.client, "train_job", corrupting)
    federation = flasync.Federation(_config())
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    rejected = recorder.of(UpdateRejected)
    assert summary.versions == 12
    assert summary.updates_dropped == len(rejected) > 0
    assert {e.reason for e in rejected} == {"decode"}


@pytest.mark.slow
async def test_unexpected_uploads_are_rejected_without_side_effects() -> None:
    """An upload for a task the server never assigned is rejected as 'unexpected' and changes nothing else."""
    federation = flasync.Federation(small_config())
    recorder = EventRecorder(federation.bus)
    published = federation.bus.subscribe(ModelPublished, policy="drop_oldest")

    async def intruder() -> None:
        await published.receive()
        await federation.bus.publish(
            UpdateUploaded(
                task_id=10**6,
                client_id=flasync.core.events.ClientId(3),
                base_version=flasync.core.events.Version(0),
                num_samples=10,
                payload=b"\0" * 64,
                train_loss=0.0,
                simulated_s=0.0,
                sent_wall_s=0.0,
            )
        )

    async with asyncio.TaskGroup() as tg:
        tg.create_task(intruder())
        summary = await federation.run()
    reference = await flasync.Federation(small_config()).run()
    assert [e.reason for e in recorder.of(UpdateRejected)] == ["unexpected"]
    assert summary.weights_sha256 == reference.weights_sha256


async def test_diverged_client_fails_without_poisoning_its_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client whose training produces NaN fails its task; its residual is left as it was."""
    original = flasync.training.local.train
    calls = {"n": 0}

    def diverging(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 5:
            result.delta[0] = float("nan")
        return result

    monkeypatch.setattr(flasync.training.jobs, "train", diverging)
    federation = flasync.Federation(_config())
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    (failed,) = recorder.of(flasync.core.events.ClientFailed)
    assert "NaN or Inf" in failed.error
    assert summary.updates_failed == 1
    assert summary.accuracy == summary.accuracy  # finite: no NaN reached the model


@pytest.mark.parametrize(
    "stage",
    [{"kind": "fp16"}, {"kind": "bf16"}, {"kind": "int8"}, {"kind": "int8", "stochastic": False}],
    ids=["fp16", "bf16", "int8-stochastic", "int8-nearest"],
)
@pytest.mark.parametrize("direction", ["upload", "download"])
def test_every_value_encoder_works_in_both_directions(stage: dict[str, Any], direction: str) -> None:
    """Each stage valid for downloads encodes uploads and downloads (a stochastic one draws from its own stream)."""
    config = small_config("stop.max_versions=3", codec={direction: [stage]})
    first, second = flasync.run(config), flasync.run(config)
    dense = flasync.run(small_config("stop.max_versions=3"))
    assert first.versions == 3 and first.weights_sha256 == second.weights_sha256
    moved = first.download_bytes if direction == "download" else first.upload_bytes
    assert moved < 0.51 * (dense.download_bytes if direction == "download" else dense.upload_bytes)
