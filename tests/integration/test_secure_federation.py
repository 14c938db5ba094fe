"""Secure aggregation in whole runs: FedBuff's buffers and FedAvg's rounds through SecAgg+ with simulated clients.

The server side of each group holds masked ring vectors only (an instrumented SecAggServer checks them), the model
steps on the unmasked weighted sum, dropouts are recovered or abandon their group, and runs repeat and resume
bit for bit.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from typing import Any

import mlflow
import numpy as np
import pytest
import torch
from scipy import stats

import flasync
from flasync.cli import main
from flasync.core.errors import TrainingError
from flasync.core.events import (
    ClientFailed,
    ClientTimedOut,
    ModelPublished,
    SecureGroupClosed,
    TaskAssigned,
    UpdateUploaded,
)
from flasync.runtime import checkpoint
from flasync.runtime.prepare import RunInputs
from flasync.secure import GroupOutcome, GroupParams, SecAggServer, WeightedEncoding
from flasync.secure.messages import UnmaskRequest, UnmaskResponse
from flasync.secure.ring import RingVector
from flasync.server import receiver
from flasync.testing import EventRecorder, MemoryTracker, small_config
from tests.conftest import interrupt_at

pytestmark = pytest.mark.timeout(120)

_ON = "secure_aggregation.enabled=true"
_FEDBUFF = "server={kind: fedbuff, buffer_size: 5, concurrency: 8, example_weight: equal}"
_FEDAVG = "server={kind: fedavg, clients_per_round: 5}"
_BITS = 32


def _bound_step(group: int, clip: float = 1.0) -> float:
    """Return the rounding bound of one encoded coordinate: ``0.5 / scale`` (see :class:`FixedPoint`)."""
    return 0.5 / (((1 << (_BITS - 1)) - 1) // math.ceil(group * clip))


async def _weights_at_one(*overrides: str) -> tuple[torch.Tensor, list[SecureGroupClosed]]:
    """Run to version 1 and return its weights (from its checkpoint) and the secure groups' ends it saw."""
    tracker = MemoryTracker()
    config = small_config(*overrides, "stop.max_versions=2", "checkpoint.every_versions=1")
    federation = flasync.Federation(config, tracker=tracker)
    recorder = EventRecorder(federation.bus)
    await federation.run()
    states = [checkpoint.decode(data)[1] for name, data in tracker.artifacts.items() if name.startswith("checkpoints/")]
    (state,) = [state for state in states if state["version"] == 1]
    first = [g for g in recorder.of(SecureGroupClosed) if g.version == 0]
    return state["weights"], first


@pytest.mark.slow
@pytest.mark.parametrize("server", [_FEDBUFF, _FEDAVG])
async def test_the_first_version_is_the_plain_one_within_the_quantization_bound(server: str) -> None:
    """Plain and secure runs from one seed, no dropouts: version 1 steps on the same clients' updates (the first K
    to finish, or the round's cohort), so the weights differ only by the fixed-point rounding of the K weighted
    updates and of their weights, ``|dS| <= K q_v`` and ``|dE| <= K q_w``, over the divisor ``E``: the model steps
    by ``lr * S / E`` (SGD, lr 1) and the deltas stay far inside the clipping range."""
    plain, none = await _weights_at_one(server)
    secure, groups = await _weights_at_one(server, _ON)
    assert not none and len(groups) == 1
    (group,) = groups
    k = len(group.survivors)
    assert k == 5 and not group.dropped
    e = group.example_weight  # the unmasked sum of the members' example weights (each scaled into [0, 1])
    q_v, q_w = _bound_step(k), _bound_step(k)
    pseudo_gradient = (plain - secure).abs()
    # |S'/E' - S/E| <= (|dS| + |S/E| |dE|) / (E - |dE|), with |S/E| bounded by the plain step plus the difference.
    step = (plain - small_init(server)).abs()
    bound = (k * q_v + step * k * q_w) / (e - k * q_w)
    float32 = 4 * torch.finfo(torch.float32).eps * (plain.abs() + step)  # both runs round their sums and the step
    assert bool((pseudo_gradient <= bound + float32).all()), float((pseudo_gradient - bound - float32).max())
    assert float(pseudo_gradient.max()) > 0.0  # the secure run really went through the ring


def small_init(server: str) -> torch.Tensor:
    """Return the small config's initial weights (version 0), as a run prepares them."""
    return RunInputs(small_config(server)).prepare().initial


class _CuriousIntake:
    """Builds each group's server side so that it records what it receives: every masked input, every round-3
    answer (with the request it answers and the group's threshold)."""

    def __init__(self) -> None:
        self.masked: list[RingVector] = []
        self.answers: list[tuple[UnmaskRequest, dict[int, UnmaskResponse], int]] = []

    def server(self, params: GroupParams, observe: Any = None) -> SecAggServer:
        """Return a group's server side, instrumented (in place of ``SecAggServer(params, observe)``)."""
        answers = self.answers

        class Curious(SecAggServer):
            def unmask(self, request: UnmaskRequest, responses: Mapping[int, UnmaskResponse]) -> GroupOutcome:
                answers.append((request, dict(responses), self.params.threshold))
                return super().unmask(request, responses)

        return Curious(params, lambda client, vector: self.masked.append(vector.copy()))


def _top_byte_uniform(vector: RingVector, alpha: float = 1e-4) -> bool:
    """Tell whether the top bytes of a ring vector pass a chi-square test of uniformity over 256 values at level
    ``alpha`` (a fixed false-positive rate; the vectors are drawn from the seed, so the verdict repeats)."""
    top = (vector >> np.uint64(_BITS - 8)).astype(np.int64)
    counts = np.bincount(top, minlength=256)
    return bool(stats.chisquare(counts).pvalue > alpha)


@pytest.mark.slow
async def test_the_server_holds_only_uniform_masked_vectors_and_never_both_shares_of_a_client(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every masked input the server receives looks uniform in the ring (a client's plain encoding does not), and in
    round 3 it gets, per client, shares of its seed or of its key, never both, and no share of a survivor's key."""
    intake = _CuriousIntake()
    monkeypatch.setattr("flasync.secure.group.SecAggServer", intake.server)
    overrides = (_FEDBUFF, _ON, "secure_aggregation.dropout=0.2", "stop.max_versions=6")
    federation = flasync.Federation(small_config(*overrides))
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    groups = recorder.of(SecureGroupClosed)
    assert recorder.count(UpdateUploaded) == 0  # no float delta ever reached the server's intake
    assert len(intake.masked) >= sum(len(g.survivors) for g in groups)  # abandoned groups' inputs too
    assert len(intake.masked) >= 25 and all(_top_byte_uniform(v) for v in intake.masked)
    delta = torch.randn(intake.masked[0].shape[0] - 1, generator=torch.Generator().manual_seed(0)) * 0.01
    plain = WeightedEncoding.create(_BITS, 1.0, 5).encode(delta, 1.0)
    assert not _top_byte_uniform(plain)  # the test sees an unmasked encoding for what it is
    recovered = 0
    for request, responses, threshold in intake.answers:
        seeds = {u for r in responses.values() for u in r.seed_shares}
        keys = {u for r in responses.values() for u in r.key_shares}
        assert not seeds & keys and seeds <= request.survivors and keys <= request.dropped
        for u in request.survivors:
            assert sum(u in r.key_shares for r in responses.values()) < threshold
        recovered += len(keys)
    assert recovered > 0 and summary.versions == 6


@pytest.mark.slow
async def test_members_whose_availability_window_closes_drop_out_and_the_run_finishes() -> None:
    """Short availability windows: members go offline while they wait for their buffer or during its protocol; each
    such member drops out (its task failed as offline), its group recovers it or is abandoned, and the run still
    reaches its versions (a window ending within rounding of a dispatch once stalled such a run)."""
    availability = "faults.availability={period_s: 5, online_fraction: 0.8}"
    federation = flasync.Federation(small_config(_FEDBUFF, _ON, availability, "stop.max_versions=8"))
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    groups = recorder.of(SecureGroupClosed)
    offline = [f for f in recorder.of(ClientFailed) if f.kind == "offline"]
    assert summary.versions == 8 and len(groups) == 8 + sum(g.abandoned for g in groups)
    assert any(g.abandoned for g in groups) and sum(g.recovered for g in groups) > 0
    # secure_aggregation.dropout is 0: every member that dropped out did so because its window closed.
    assert federation.config.secure_aggregation.dropout == 0.0 and sum(len(g.dropped) for g in groups) > 0
    assert offline  # and tasks whose window closed during training failed as offline, as in any run


@pytest.mark.slow
def test_windows_too_short_for_a_group_end_the_run_with_its_reason_and_a_few_warnings(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Windows of 1.2 s in 2: members go offline before their buffer's protocol ends, so every group is abandoned.
    The run ends with the server's no-progress error naming the reason (it once stalled instead, the clock stuck at a
    window's end), and only the first few abandoned groups are warnings, the last saying the rest are debug lines."""
    overrides = (_FEDBUFF, _ON, "faults.availability={period_s: 2, online_fraction: 0.6}", "tracking.log_level=info")
    with pytest.raises(TrainingError, match="secagg_abandoned"):
        flasync.run(small_config(*overrides, "stop.max_versions=10"))
    output = capsys.readouterr()
    warnings = [line for line in (output.out + output.err).splitlines() if "secagg.abandoned" in line]
    assert len(warnings) == receiver._ABANDONED_PRINTED
    assert "further abandoned groups at debug level" in warnings[-1]


@pytest.mark.slow
@pytest.mark.parametrize("server", [_FEDBUFF, _FEDAVG])
async def test_dropouts_are_recovered_or_abandon_their_group_and_the_run_finishes(server: str) -> None:
    """With a third of the members dropping, groups with at most D dropouts are unmasked (recoveries counted), the
    others are abandoned (counted, no step on them), and the run reaches its versions."""
    tracker = MemoryTracker()
    config = small_config(server, _ON, "secure_aggregation.dropout=0.3", "stop.max_versions=10")
    federation = flasync.Federation(config, tracker=tracker)
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    groups = recorder.of(SecureGroupClosed)
    abandoned = [g for g in groups if g.abandoned]
    recovered = sum(g.recovered for g in groups)
    assert abandoned and recovered > 0 and summary.versions == 10
    assert len(groups) == summary.versions + len(abandoned)  # each unmasked group made one version, no other did
    assert all(len(g.dropped) > config.secure_aggregation.max_dropouts for g in abandoned)
    assert sum(value for _, value in tracker.history("secagg/abandoned")) == len(abandoned)
    assert sum(value for _, value in tracker.history("secagg/recovered")) == recovered
    assert len({step for step, _ in tracker.history("secagg/share_bytes")}) == summary.versions
    assert summary.updates_failed >= sum(len(g.dropped) for g in groups)


@pytest.mark.slow
@pytest.mark.parametrize("server", [_FEDBUFF, _FEDAVG])
async def test_a_secure_run_repeats_bit_for_bit_with_one_or_two_workers(server: str) -> None:
    """Same seed, same weights: twice, and with a second training worker. The run's upload bytes are the protocol's
    (no float update is uploaded), its download bytes the models' and the protocol's."""
    federations = [
        flasync.Federation(small_config(server, _ON, "stop.max_versions=5", *workers))
        for workers in ((), (), ("executor.workers=2",))
    ]
    recorder = EventRecorder(federations[0].bus)
    runs = [await federation.run() for federation in federations]
    assert len({run.weights_sha256 for run in runs}) == 1
    plain = await flasync.Federation(small_config(server, "stop.max_versions=5")).run()
    assert plain.weights_sha256 != runs[0].weights_sha256
    groups = recorder.of(SecureGroupClosed)
    models = sum(recorder.of(ModelPublished)[0].download_bytes for _ in recorder.of(TaskAssigned))
    assert runs[0].upload_bytes == sum(sum(g.upload_bytes.values()) for g in groups) > 0
    assert runs[0].download_bytes == models + sum(sum(g.download_bytes.values()) for g in groups)


@pytest.mark.slow
@pytest.mark.parametrize("server", [_FEDBUFF, _FEDAVG])
async def test_a_client_holding_its_update_is_handed_no_task_until_its_group_ends(server: str) -> None:
    """Every client's next task comes after its previous one ended: in a group's end (its update held until then),
    a failure or a time-out; with crashes, hangs and a time limit that stops once the update is held."""
    faults = ("faults.crash=0.1", "faults.hang=0.05", "resilience.task_timeout_s=5")
    federation = flasync.Federation(small_config(server, _ON, "stop.max_versions=8", *faults))
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    open_task: dict[int, int] = {}
    grouped = 0
    for event in recorder.events:
        if isinstance(event, TaskAssigned):
            assert int(event.client_id) not in open_task, f"client {event.client_id} got a task while busy"
            open_task[int(event.client_id)] = event.task_id
        elif isinstance(event, SecureGroupClosed):
            for task in event.members:
                assert open_task.pop(int(task.client_id)) == task.task_id  # it was holding its update
                grouped += 1
        elif isinstance(event, ClientFailed | ClientTimedOut):
            assert open_task.pop(int(event.client_id)) == event.task_id
    assert summary.versions == 8 and grouped >= 8 * 4
    assert summary.updates_failed + summary.tasks_timed_out > 0


@pytest.mark.slow
async def test_a_run_stopped_with_a_half_full_buffer_resumes_exactly() -> None:
    """Stopped while clients hold updates for the next buffer, the checkpoint keeps them and the resumed run ends
    with the uninterrupted run's weights."""
    config = small_config(_FEDBUFF, _ON, "stop.max_versions=8")
    full = await flasync.Federation(config).run()
    tracker, _ = await interrupt_at(config, 3)
    saved, state = checkpoint.decode(checkpoint.latest(tracker.artifacts))
    assert 3 <= state["version"] < 8 and state["secure_aggregation"]["waiting"]  # a buffer half full
    resumed = await asyncio.to_thread(flasync.run, saved, resume=checkpoint.ResumePoint(None, state))
    assert resumed.weights_sha256 == full.weights_sha256 and resumed.versions == full.versions


_CLI = [  # flasync.testing.small_config's settings, tracked
    "--set", "model.hidden=[32]",
    "--set", "population.num_clients=20",
    "--set", "client.epochs=2",
    "--set", "client.batch_size=16",
    "--set", "tracking.log_model=false",
    "--no-system-metrics",
]  # fmt: skip


@pytest.mark.slow
def test_flasync_run_with_the_section_logs_the_protocols_figures(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``flasync run`` with [secure_aggregation] on: the secagg/* metrics per version in the MLflow store."""
    args = ["run", *_CLI, "--set", "secure_aggregation.enabled=true", "--set", "stop.max_versions=4"]
    status = main([*args, "--tracking-uri", store])
    out = capsys.readouterr().out
    assert status == 0, out
    client = mlflow.MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("flasync").experiment_id])  # type: ignore[union-attr]
    metrics = run.data.metrics
    for phase in ("advertise", "share", "mask", "unmask"):
        assert metrics[f"secagg/{phase}_bytes"] > 0 and metrics[f"secagg/{phase}_s"] > 0
    assert "secagg/cpu_s" in metrics and metrics["secagg/abandoned"] == 0.0
    assert [m.step for m in client.get_metric_history(run.info.run_id, "secagg/mask_bytes")] == [0, 1, 2, 3]
    assert run.data.params["secure_aggregation.enabled"] == "True"


class _MeanOfSums:
    """A user's rule that works from sums: the server SGD step (lr 1) on each group's weighted mean."""

    partial_sums = True  # it says it works from sums: secure aggregation may hand it each group's sum

    def __init__(self, weights: torch.Tensor, server: Any) -> None:
        self.weights, self.sums, self.example_weight, self.partials = weights, torch.zeros_like(weights), 0.0, 0

    def add(self, delta: torch.Tensor, *, staleness: int, num_samples: int, base: torch.Tensor) -> float:
        raise AssertionError("secure aggregation hands the rule no single update")

    def add_partial(self, weighted_sum: torch.Tensor, *, example_weight: float, staleness: int) -> float:
        assert staleness == 0  # the members weighted themselves
        self.sums += weighted_sum
        self.example_weight += example_weight
        self.partials += 1
        return 1.0

    def ready(self) -> bool:
        return self.partials >= 1  # each sum is a whole buffer

    def step(self) -> None:
        self.weights.sub_(self.sums / self.example_weight)
        self.sums.zero_()
        self.example_weight, self.partials = 0.0, 0

    def count(self) -> int:
        return self.partials

    @property
    def nbytes(self) -> int:
        return 4 * self.sums.numel()

    def state_dict(self) -> dict[str, Any]:
        return {"sums": self.sums.clone(), "example_weight": self.example_weight, "partials": self.partials}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sums = state["sums"].clone()
        self.example_weight, self.partials = float(state["example_weight"]), int(state["partials"])


def test_a_user_rule_that_does_not_say_it_works_from_sums_is_refused() -> None:
    """A custom aggregation rule would see only each group's sum: without partial_sums = True it is refused when the
    federation is built, in one line naming it."""

    def norm_filter(weights: torch.Tensor, server: Any) -> Any:
        return _MeanOfSums(weights, server)

    with pytest.raises(flasync.ConfigError, match=r"^secure_aggregation\.enabled: the aggregator .*norm_filter would"):
        flasync.Federation(small_config(_FEDAVG, _ON), aggregator=norm_filter)
    flasync.Federation(small_config(_FEDAVG), aggregator=norm_filter)  # without secure aggregation: taken


@pytest.mark.slow
@pytest.mark.parametrize("server", [_FEDAVG, _FEDBUFF], ids=["fedavg", "fedbuff"])
async def test_a_user_rule_working_from_sums_steps_on_each_groups_sum(server: str) -> None:
    """A rule saying partial_sums = True gets one sum a group (never an update) and makes the model the built-in
    mean makes from the same sums."""
    config = small_config(server, _ON, "stop.max_versions=3")
    mine = flasync.Federation(config, aggregator=_MeanOfSums)
    theirs = flasync.Federation(config)
    assert (await mine.run()).versions == 3 and (await theirs.run()).versions == 3
    assert mine.weights is not None and theirs.weights is not None
    assert torch.allclose(mine.weights, theirs.weights, atol=1e-6)
