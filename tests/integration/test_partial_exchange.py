"""Partial-model exchange end to end: only the named tensors travel, the rest stays at its initial values."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

import flasync
from flasync.codecs import HEADER
from flasync.core.events import UpdateUploaded
from flasync.runtime.prepare import RunInputs
from flasync.testing import EventRecorder, MemoryTracker, small_config
from flasync.training.exchange import PartialFactory

HEAD = ["layers.2.weight", "layers.2.bias"]
HEAD_VALUES = 32 * 10 + 10  # the small config's MLP: 64 -> 32 -> 10


def _model(**fields: Any) -> dict[str, Any]:
    return {"kind": "mlp", "hidden": [32], **fields}


@pytest.mark.slow
async def test_a_filtered_exchange_sends_exactly_the_named_tensors() -> None:
    """Each upload and download carries the head's 330 values (dense float32), nothing of the frozen layer."""
    tracker = MemoryTracker()
    federation = flasync.Federation(
        small_config("tracking.log_model=false", model=_model(exchange=["layers.2"])), tracker=tracker
    )
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    uploads = recorder.of(UpdateUploaded)
    assert uploads and {len(e.payload) for e in uploads} == {HEADER.size + 4 * HEAD_VALUES}
    assert summary.upload_bytes == len(uploads) * (HEADER.size + 4 * HEAD_VALUES)
    assert summary.download_bytes == summary.tasks_dispatched * (HEADER.size + 4 * HEAD_VALUES)
    whole_federation = flasync.Federation(small_config())
    whole_recorder = EventRecorder(whole_federation.bus)
    whole = await whole_federation.run()
    assert {len(e.payload) for e in whole_recorder.of(UpdateUploaded)} == {
        HEADER.size + 4 * (64 * 32 + 32 + HEAD_VALUES)
    }
    assert whole.download_bytes == whole.tasks_dispatched * (HEADER.size + 4 * (64 * 32 + 32 + HEAD_VALUES))


async def test_the_server_keeps_the_frozen_tensors_at_their_initial_values() -> None:
    """The final model's frozen layer equals the run's initial one bit for bit; the exchanged head has trained."""
    config = small_config(model=_model(exchange=HEAD))
    factory = RunInputs(config).prepare().factory
    assert isinstance(factory, PartialFactory)
    tracker = MemoryTracker()
    summary = await flasync.Federation(config, tracker=tracker).run()
    saved = torch.load(io.BytesIO(tracker.artifacts["weights.pt"]), weights_only=True)
    assert saved["flat"].numel() == HEAD_VALUES
    state = saved["state_dict"]
    assert torch.equal(state["layers.0.weight"], factory.state["layers.0.weight"])
    assert torch.equal(state["layers.0.bias"], factory.state["layers.0.bias"])
    assert not torch.equal(state["layers.2.weight"], factory.state["layers.2.weight"])
    assert torch.equal(torch.cat([state["layers.2.weight"].reshape(-1), state["layers.2.bias"]]), saved["flat"])
    assert summary.accuracy > 0.3  # a linear head on fixed random features still learns digits


@pytest.mark.slow
def test_a_partial_run_is_deterministic() -> None:
    """The same partial config gives the same weights twice and with 1 or 3 worker threads."""
    config = small_config(model=_model(exchange=["*.bias", "layers.2"]))
    one = flasync.run(config)
    again = flasync.run(config)
    three = flasync.run(small_config("executor.workers=3", model=_model(exchange=["*.bias", "layers.2"])))
    assert one.weights_sha256 == again.weights_sha256 == three.weights_sha256


@pytest.mark.slow
async def test_top_k_with_error_feedback_works_on_the_exchanged_vector() -> None:
    """Top-k with error feedback compresses the exchanged part only: smaller than its dense uploads, residuals kept."""
    codec = {"upload": [{"kind": "topk", "ratio": 0.1, "error_feedback": True}]}
    tracker = MemoryTracker()
    config = small_config("tracking.log_level=debug", "tracking.metrics=all", model=_model(exchange=HEAD), codec=codec)
    federation = flasync.Federation(config, tracker=tracker)
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    uploads = recorder.of(UpdateUploaded)
    assert uploads and max(len(e.payload) for e in uploads) < (HEADER.size + 4 * HEAD_VALUES) / 3
    assert tracker.history("client/residual_norm")
    assert summary.accuracy > 0.2
    assert (await flasync.Federation(config).run()).weights_sha256 == summary.weights_sha256


@pytest.mark.slow
def test_scaffold_and_privacy_run_on_the_exchanged_vector() -> None:
    """SCAFFOLD's variates and DP's clipped, noised sum have the exchanged vector's length: both runs complete."""
    fedavg = {"kind": "fedavg", "clients_per_round": 5}
    scaffold = flasync.run(small_config("scaffold.enabled=true", model=_model(exchange=HEAD), server=fedavg))
    private = flasync.run(
        small_config(
            "privacy.enabled=true",
            "privacy.noise_multiplier=0.5",
            "privacy.clip_norm=1.0",
            model=_model(exchange=HEAD),
            server=fedavg,
        )
    )
    assert scaffold.versions == private.versions == 12
    assert scaffold.upload_bytes < flasync.run(small_config("scaffold.enabled=true", server=fedavg)).upload_bytes / 5


@pytest.mark.slow
def test_a_lora_adapter_run_exchanges_the_adapters_and_the_saved_head() -> None:
    """model.adapter sends A, B of each targeted layer and the saved head: (64 + 32) * r + 330 values an upload."""
    adapter = {"kind": "lora", "r": 4, "target": ["layers.0"], "modules_to_save": ["layers.2"]}
    config = small_config(model=_model(adapter=adapter))
    tracker = MemoryTracker()
    summary = flasync.run(config, tracker=tracker)
    assert summary.download_bytes == summary.tasks_dispatched * (HEADER.size + 4 * ((64 + 32) * 4 + HEAD_VALUES))
    assert summary.accuracy > 0.3
    # The logged model is the plain MLP, the trained adapters merged into the layer they adapt.
    state = torch.load(io.BytesIO(tracker.artifacts["weights.pt"]), weights_only=True)["state_dict"]
    assert list(state) == ["layers.0.weight", "layers.0.bias", "layers.2.weight", "layers.2.bias"]
    factory = RunInputs(config).prepare().factory
    assert isinstance(factory, PartialFactory)
    initial = factory.state["base_model.model.layers.0.base_layer.weight"]
    assert not torch.equal(state["layers.0.weight"], initial)
    assert torch.equal(state["layers.0.bias"], factory.state["base_model.model.layers.0.base_layer.bias"])
