"""Update validation in runs: a poisoned update refused by the server without touching aggregation."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch

import flasync
from flasync.core.events import ClientFailed, ClientId, TaskAssigned, UpdateRejected, UpdateUploaded, Version
from flasync.testing import EventRecorder, small_config


# ------------------------------------------------------------------------------------------- through the server
async def _run_with_intruder(config: flasync.RunConfig, make_event: Any, victim: int = 20) -> tuple[str, list[Any]]:
    """Run, publishing ``make_event(task, federation)`` for task ``victim`` as soon as it is assigned."""
    federation = flasync.Federation(config)
    recorder = EventRecorder(federation.bus)
    assigned = federation.bus.subscribe(TaskAssigned, policy="drop_oldest", capacity=1024)

    async def intrude() -> None:
        async for task in assigned:
            if task.task_id == victim:
                await federation.bus.publish(make_event(task, federation))
                return

    intruder = asyncio.create_task(intrude())
    summary = await federation.run()
    intruder.cancel()
    return summary.weights_sha256, recorder.events


def _poison(values: torch.Tensor) -> Any:
    def make(task: TaskAssigned, federation: flasync.Federation) -> UpdateUploaded:
        server = federation.server
        assert server is not None
        payload = server.intake.codec.encode(values(server.intake.num_params)).payload
        return UpdateUploaded(
            task_id=task.task_id,
            client_id=task.client_id,
            base_version=task.base_version,
            num_samples=10,
            payload=payload,
            train_loss=0.0,
            simulated_s=task.simulated_s,
            sent_wall_s=0.0,
        )

    return make


def _dropout(task: TaskAssigned, federation: flasync.Federation) -> ClientFailed:
    return ClientFailed(
        task_id=task.task_id,
        client_id=ClientId(task.client_id),
        base_version=Version(task.base_version),
        error="left",
        simulated_s=task.simulated_s,
        kind="dropout",
    )


@pytest.mark.parametrize(
    ("overrides", "values", "reason"),
    [
        (("resilience.max_update_norm=50",), lambda n: torch.full((n,), 10.0), "norm"),
        (
            ("resilience.zscore_threshold=6", "resilience.zscore_min_history=3"),
            lambda n: torch.full((n,), 10.0),
            "zscore",
        ),
        ((), lambda n: torch.full((n,), math.nan), "non_finite"),
    ],
)
async def test_a_refused_update_leaves_aggregation_unchanged(overrides: Any, values: Any, reason: str) -> None:
    """A poisoned upload is refused with its reason, and the run ends exactly as if that client had left.

    Both runs close the victim's task at the same moment without aggregating anything for it; equal final weights
    show the refused update changed no aggregator state.
    """
    config = small_config(*overrides, "stop.max_versions=6")
    poisoned_sha, events = await _run_with_intruder(config, _poison(values))
    dropout_sha, _ = await _run_with_intruder(config, _dropout)
    rejected = [e for e in events if isinstance(e, UpdateRejected) and e.task_id == 20]
    assert [e.reason for e in rejected][:1] == [reason]
    assert poisoned_sha == dropout_sha
    # The real client's later upload for the same task is refused as unexpected, not aggregated twice.
    assert [e.reason for e in rejected][1:] in ([], ["unexpected"])


async def test_an_unknown_base_version_is_refused_and_changes_nothing() -> None:
    """An upload naming a version never published is refused without closing the task: the run is unchanged."""
    config = small_config("stop.max_versions=6")

    def forged(task: TaskAssigned, federation: flasync.Federation) -> UpdateUploaded:
        event = _poison(lambda n: torch.zeros(n))(task, federation)
        return UpdateUploaded(
            task_id=event.task_id,
            client_id=event.client_id,
            base_version=Version(999),
            num_samples=event.num_samples,
            payload=event.payload,
            train_loss=0.0,
            simulated_s=event.simulated_s,
            sent_wall_s=0.0,
        )

    forged_sha, events = await _run_with_intruder(config, forged)
    clean = await flasync.Federation(config).run()
    assert [e.reason for e in events if isinstance(e, UpdateRejected)] == ["unknown_version"]
    assert forged_sha == clean.weights_sha256


async def test_an_update_whose_norm_overflows_cannot_break_the_default_run() -> None:
    """One client's finite but overflowing update is refused in the default config; the model stays finite."""
    config = small_config("stop.max_versions=6")

    def overflowing(task: TaskAssigned, federation: flasync.Federation) -> UpdateUploaded:
        return _poison(lambda n: torch.full((n,), 3e38))(task, federation)

    sha, events = await _run_with_intruder(config, overflowing)
    dropout_sha, _ = await _run_with_intruder(config, _dropout)
    rejected = [e for e in events if isinstance(e, UpdateRejected) and e.task_id == 20]
    assert [e.reason for e in rejected][:1] == ["non_finite"]
    assert sha == dropout_sha  # as if the client had left: nothing of it reached the model


@pytest.mark.slow
def test_a_run_whose_every_update_is_refused_says_so_a_few_times_then_fails(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every update refused alike (a norm bound no client meets; before: ~2,800 info lines before the one error):
    REFUSAL_LINES info lines, the last saying the rest are debug lines; every refusal is still counted, and the run
    ends with its one error naming the reason."""
    from flasync.server.receiver import REFUSAL_LINES

    config = small_config("resilience.max_update_norm=1e-9", "stop.max_versions=50", "tracking.log_level=info")
    with pytest.raises(flasync.core.errors.TrainingError, match=r"all refused \(norm x\d+\)"):
        flasync.run(config)
    output = capsys.readouterr()
    lines = [line for line in (output.out + output.err).splitlines() if "server.rejected" in line]
    assert len(lines) == REFUSAL_LINES
    assert "further refusals for this reason are logged at debug level" in lines[-1]
