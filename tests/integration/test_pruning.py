"""Model pruning end to end: the mask holds on the server and in every update, bytes fall with density, resume."""

from __future__ import annotations

import asyncio
import io
import math
from typing import Any

import pytest
import torch

import flasync
from flasync.codecs import decode
from flasync.core.events import UpdateUploaded
from flasync.runtime import checkpoint
from flasync.testing import EventRecorder, MemoryTracker, small_config
from tests.conftest import interrupt_at

NUM_PARAMS = 64 * 32 + 32 + 32 * 10 + 10  # the small config's MLP
WEIGHT_MATRICES = (64 * 32, 32 * 10)  # pruned each on its own; the biases are kept


def _config(density: float | None, *overrides: str, every: int = 4) -> flasync.RunConfig:
    model: dict[str, Any] = {"kind": "mlp", "hidden": [32]}
    if density is not None:
        model["prune"] = {"target_density": density, "every_versions": every}
    return small_config("stop.max_versions=16", *overrides, model=model)


async def test_pruned_weights_stay_zero_on_the_server_and_in_every_update() -> None:
    """Each weight matrix keeps exactly ceil(0.2 numel) values; every update trained on a pruned model is zero where
    the final model is pruned."""
    tracker = MemoryTracker()
    federation = flasync.Federation(_config(0.2), tracker=tracker)
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    flat = torch.load(io.BytesIO(tracker.artifacts["weights.pt"]), weights_only=True)["flat"]
    pruned = flat == 0
    assert int(pruned.sum()) == sum(n - math.ceil(0.2 * n) for n in WEIGHT_MATRICES)
    after = [e for e in recorder.of(UpdateUploaded) if e.base_version >= 4]
    assert after
    for event in after:
        delta = decode(event.payload, expected_elements=NUM_PARAMS)
        assert bool((delta[pruned] == 0).all())
    assert summary.accuracy > 0.3  # still learning after the pruning at version 4


@pytest.mark.slow
def test_bytes_fall_with_density() -> None:
    """Uploads and downloads shrink as the density falls (sparse after the first pruning)."""
    runs = [flasync.run(_config(d)) for d in (None, 0.5, 0.2, 0.05)]
    uploads = [s.upload_bytes / s.updates_accepted for s in runs]
    downloads = [s.download_bytes / s.tasks_dispatched for s in runs]
    assert uploads == sorted(uploads, reverse=True) and len(set(uploads)) == 4
    assert downloads == sorted(downloads, reverse=True) and len(set(downloads)) == 4


@pytest.mark.slow
def test_a_pruned_run_is_deterministic() -> None:
    """The same pruned config gives the same weights twice."""
    assert flasync.run(_config(0.2)).weights_sha256 == flasync.run(_config(0.2)).weights_sha256


@pytest.mark.slow
def test_a_resumed_run_keeps_the_mask() -> None:
    """Resumed from the checkpoint after the first pruning, a run ends with the uninterrupted weights."""
    config = _config(0.2, "checkpoint.every_versions=6", every=5)
    tracker = MemoryTracker()
    full = flasync.run(config, tracker=tracker)
    _, state = checkpoint.decode(checkpoint.latest(tracker.artifacts))
    assert state["version"] == 12 and state["prune_mask"]["events"] == 2
    resumed = flasync.run(config, resume=checkpoint.ResumePoint(None, state))
    assert resumed.weights_sha256 == full.weights_sha256


@pytest.mark.slow
async def test_a_run_stopped_before_pruning_and_resumed_prunes_on_schedule() -> None:
    """A run stopped (SIGINT) before the first pruning holds no mask; the resumed run prunes when the schedule says."""
    config = _config(0.2, every=5)
    full = await flasync.Federation(config).run()
    tracker, _ = await interrupt_at(config, 2)
    _, state = checkpoint.decode(checkpoint.latest(tracker.artifacts))
    assert state["version"] < 5 and state["prune_mask"]["mask"] is None
    resumed = await asyncio.to_thread(flasync.run, config, resume=checkpoint.ResumePoint(None, state))
    assert resumed.weights_sha256 == full.weights_sha256


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (("executor.kind=vectorized",), "model.prune: needs executor.kind = 'thread' or 'auto', not 'vectorized'"),
        (("scaffold.enabled=true",), "model.prune: cannot be combined with scaffold.enabled"),
    ],
)
def test_unsupported_combinations_are_one_line_errors(overrides: tuple[str, ...], expected: str) -> None:
    """Pruning with vectorized cohorts or SCAFFOLD is refused before the run, naming the field."""
    with pytest.raises(flasync.ConfigError, match=expected):
        _config(0.2, *overrides)
