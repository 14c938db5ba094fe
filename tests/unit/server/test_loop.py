"""The server loop without a federation: versions, stop requests, evaluation, checkpoints and exact resume."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from flasync.core.errors import TrainingError
from flasync.core.events import Aggregated, ModelPublished, RunFinished
from flasync.server import INTERRUPTED
from flasync.testing import EventRecorder, ScriptedClients, ServerHarness

pytestmark = pytest.mark.timeout(30)


def _clients(bus: Any, clock: Any) -> ScriptedClients:
    # Each client's delta depends on who it is and which model it started from: order matters to the result.
    return ScriptedClients(
        bus,
        clock,
        4,
        delta=lambda task: (
            torch.arange(4, dtype=torch.float32) * 0.01 * (1 + int(task.client_id)) + 0.001 * int(task.base_version)
        ),
    )


async def test_the_loop_publishes_each_version_and_finishes() -> None:
    """max_versions versions are published after the initial model; RunFinished says why the run ended."""
    harness = ServerHarness(max_versions=4, clients=_clients)
    events = EventRecorder(harness.bus)
    stats = await harness.run()
    assert [e.version for e in events.of(ModelPublished)] == [0, 1, 2, 3, 4]
    assert [e.num_updates for e in events.of(Aggregated)] == [2, 2, 2, 2]
    (finished,) = events.of(RunFinished)
    assert finished.reason == stats.stop_reason == "max_versions"


async def test_evaluation_runs_on_the_initial_model_and_every_version() -> None:
    """The injected evaluator sees the initial model and each version (eval_every = 1); the stats keep the last."""
    seen: list[float] = []

    def accuracy(weights: torch.Tensor) -> float:
        seen.append(float(weights.sum()))
        return 0.5

    harness = ServerHarness(max_versions=3, evaluate=accuracy, clients=_clients)
    stats = await harness.run()
    assert seen[0] == 0.0 and len(seen) == 4
    assert stats.accuracy == 0.5 and stats.evaluated_version == 3


async def test_a_stop_request_ends_the_run_with_a_state_to_resume_from() -> None:
    """request_stop mid-run captures the state; a new server loaded from it ends with the uninterrupted weights."""
    full = ServerHarness(max_versions=6, concurrency=3, clients=_clients)
    await full.run()

    stopped = ServerHarness(max_versions=6, concurrency=3, clients=_clients)
    aggregated = stopped.bus.subscribe(Aggregated)

    async def stop_at_two() -> None:
        async for event in aggregated:
            if event.version == 2:
                stopped.server.request_stop("SIGINT")
                return

    watcher = asyncio.create_task(stop_at_two())
    stats = await stopped.run()
    await watcher
    assert stats.stop_reason == INTERRUPTED
    state = stopped.server.interrupted_state
    assert state is not None and state["version"] == 2 and state["registry"]["in_flight"]

    resumed = ServerHarness(max_versions=6, concurrency=3, clients=_clients)
    resumed.server.load_state_dict(state)  # the clock's reading is part of it
    assert resumed.clock.now() == state["clock"]["now"] > 0
    await resumed.run()
    assert torch.equal(resumed.weights, full.weights)
    assert resumed.server.stats.updates_accepted == full.server.stats.updates_accepted


async def test_a_checkpoint_is_offered_every_n_versions_but_not_at_the_end() -> None:
    """on_checkpoint gets the state at versions 2 and 4 of 5 (the last version is the result, not a restart)."""
    harness = ServerHarness(max_versions=5, clients=_clients)
    harness.server.rules = type(harness.server.rules)(max_versions=5, checkpoint_every=2)
    taken: list[int] = []
    harness.server.on_checkpoint = lambda state: taken.append(state["version"])
    await harness.run()
    assert taken == [2, 4]


async def test_a_genuinely_broken_client_population_fails_the_run() -> None:
    """When every task fails with a training error, the loop raises once the streak limit is reached."""
    harness = ServerHarness(
        max_versions=3,
        failure_limit=5,
        clients=lambda bus, clock: ScriptedClients(bus, clock, 4, fail=lambda task: "error"),
    )
    with pytest.raises(ExceptionGroup) as caught:
        await harness.run()
    assert caught.group_contains(TrainingError, match="the last 5 client tasks all failed", depth=2)


async def test_a_global_model_that_turns_non_finite_ends_the_run() -> None:
    """A server step that overflows the weights to Inf stops the run with the reason, before anyone trains on it."""
    from flasync.aggregation import BufferedAggregator, ConstantStaleness, EqualExampleWeight, ServerOptimizer

    harness = ServerHarness(
        max_versions=3,
        aggregator=lambda weights: BufferedAggregator(
            weights,
            size=2,
            optimizer=ServerOptimizer.sgd(weights, lr=1e38),
            staleness=ConstantStaleness(),
            example_weight=EqualExampleWeight(),
        ),
        clients=lambda bus, clock: ScriptedClients(bus, clock, 4, delta=lambda task: torch.full((4,), 100.0)),
    )
    with pytest.raises(ExceptionGroup) as caught:
        await harness.run()
    assert caught.group_contains(TrainingError, match="the global model has NaN or Inf after the server step", depth=2)
    assert harness.server.stats.versions == 0
