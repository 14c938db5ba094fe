"""Checkpoints and exact resume: in process, from periodic checkpoints, and after SIGINT/SIGTERM of the CLI."""

from __future__ import annotations

import asyncio
import io
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlflow
import pytest
import torch

import flasync
from flasync.config import load_config
from flasync.core.errors import CheckpointError
from flasync.runtime import checkpoint
from flasync.testing import MeanOfDeltas, MemoryTracker, small_config
from flasync.tracking.store import prepare_sqlite_store
from tests.conftest import NEEDS_DP_ACCOUNTING, interrupt_at

ROOT = Path(flasync.__file__).resolve().parents[1]
FAULTY = ("faults.crash=0.2", "faults.hang=0.1", "faults.dropout=0.05", "resilience.task_timeout_s=3")
TOPK = "codec.upload=[{kind: topk, ratio: 0.05}]"


async def _interrupt_at(
    config: flasync.RunConfig, version: int, resume: checkpoint.ResumePoint | None = None, **kwargs: Any
) -> MemoryTracker:
    """Run ``config`` and request a stop once ``version`` was aggregated; return the tracker it wrote to."""
    tracker, _ = await interrupt_at(config, version, resume, **kwargs)
    assert tracker.status == "KILLED"
    return tracker


def _resume(tracker: MemoryTracker) -> flasync.RunSummary:
    config, state = checkpoint.decode(checkpoint.latest(tracker.artifacts))
    return flasync.run(config, resume=checkpoint.ResumePoint(None, state))


async def _resumes_exactly(
    config: flasync.RunConfig, at: int, fields: tuple[str, ...]
) -> tuple[flasync.RunSummary, flasync.RunSummary]:
    """Run ``config`` whole, and stopped at version ``at`` then resumed: same weights and ``fields``."""
    full = await flasync.Federation(config).run()
    tracker = await _interrupt_at(config, at)
    _, state = checkpoint.decode(checkpoint.latest(tracker.artifacts))
    assert at <= state["version"] < config.stop.max_versions
    resumed = await asyncio.to_thread(_resume, tracker)
    assert resumed.weights_sha256 == full.weights_sha256
    for field in fields:
        assert getattr(resumed, field) == getattr(full, field), field
    return full, resumed


@pytest.mark.parametrize(
    ("server", "overrides"),
    [
        ({"kind": "fedbuff", "buffer_size": 4, "concurrency": 8}, (*FAULTY, TOPK)),
        (
            {"kind": "fedasync", "concurrency": 8},
            ("faults.availability.period_s=4", "faults.availability.online_fraction=0.6"),
        ),
        (
            {"kind": "fedavg", "clients_per_round": 5},
            (
                *FAULTY,
                TOPK,
                "resilience.over_selection=0.4",
                "resilience.round_quorum=0.8",
                "resilience.round_deadline_s=2.5",
            ),
        ),
        ({"kind": "fedbuff", "buffer_size": 4, "concurrency": 8}, (*FAULTY, TOPK, "scaffold.enabled=true")),
        (
            {"kind": "fedavg", "clients_per_round": 5},
            ("scaffold.enabled=true", "resilience.over_selection=0.4", "resilience.round_quorum=0.8"),
        ),
        pytest.param(
            {"kind": "fedbuff", "buffer_size": 4, "concurrency": 8},
            (*FAULTY, "privacy.enabled=true", "privacy.noise_multiplier=0.5", "privacy.clip_norm=2"),
            marks=NEEDS_DP_ACCOUNTING,
        ),
        # No faults: tasks dispatched together run as one group (flasync.clients.simulated.client.CohortClients), in
        # flight at the
        # checkpoint with their residuals.
        ({"kind": "fedbuff", "buffer_size": 4, "concurrency": 8}, ("executor.kind=vectorized", TOPK)),
    ],
    ids=[
        "fedbuff-faults-topk",
        "fedasync-availability",
        "fedavg-quorum-deadline",
        "fedbuff-scaffold-faults-topk",
        "fedavg-scaffold-quorum",
        "fedbuff-private-faults",
        "fedbuff-groups-vectorized-topk",
    ],
)
@pytest.mark.slow
async def test_stop_and_resume_gives_the_uninterrupted_weights(
    server: dict[str, Any], overrides: tuple[str, ...]
) -> None:
    """A run stopped mid-way and resumed from its checkpoint ends with the uninterrupted run's weights and counts."""
    config = small_config("stop.max_versions=16", *overrides, server=server)
    fields = ("tasks_dispatched", "updates_accepted", "updates_failed", "tasks_timed_out", "simulated_s")
    await _resumes_exactly(config, 5, fields)


@pytest.mark.slow
async def test_a_resumed_run_can_be_interrupted_and_resumed_again() -> None:
    """Stop, resume, stop again, resume again: still the uninterrupted weights."""
    config = small_config("stop.max_versions=14", *FAULTY, TOPK)
    full = await flasync.Federation(config).run()
    first = await _interrupt_at(config, 4)
    _, state = checkpoint.decode(checkpoint.latest(first.artifacts))
    second = await _interrupt_at(config, 9, resume=checkpoint.ResumePoint(None, state))
    _, again = checkpoint.decode(checkpoint.latest(second.artifacts))
    assert state["version"] < again["version"] < 14
    assert (await asyncio.to_thread(_resume, second)).weights_sha256 == full.weights_sha256


def _held_mean(weights: torch.Tensor, server: Any) -> MeanOfDeltas:
    return MeanOfDeltas(weights, server.buffer_size)


@pytest.mark.slow
async def test_a_user_aggregator_resumes_exactly() -> None:
    """A run with a user rule, stopped and resumed with the rule, ends at the uninterrupted weights; without the
    rule the checkpoint is refused."""
    config = small_config("stop.max_versions=12")
    full = await flasync.Federation(config, aggregator=_held_mean).run()
    tracker = await _interrupt_at(config, 5, aggregator=_held_mean)
    config, state = checkpoint.decode(checkpoint.latest(tracker.artifacts))
    assert state["aggregator"]["kind"] == "custom" and state["aggregator"]["rule"] == "MeanOfDeltas"
    resume = checkpoint.ResumePoint(None, state)
    resumed = await asyncio.to_thread(flasync.run, config, resume=resume, aggregator=_held_mean)
    assert resumed.weights_sha256 == full.weights_sha256
    with pytest.raises(CheckpointError, match="holds a 'custom' aggregator, this run a buffered one"):
        await flasync.Federation(config, resume=resume).run()


@pytest.mark.slow
def test_periodic_checkpoints_resume_exactly() -> None:
    """Every N versions a checkpoint is written; resuming from the last one reproduces the end of the run."""
    config = small_config("stop.max_versions=14", "checkpoint.every_versions=5", *FAULTY, TOPK)
    tracker = MemoryTracker()
    full = flasync.run(config, tracker=tracker)
    _, state = checkpoint.decode(checkpoint.latest(tracker.artifacts))
    assert state["version"] == 10
    assert tracker.history("checkpoint/bytes")  # one metric per checkpoint written
    assert _resume(tracker).weights_sha256 == full.weights_sha256


def test_checkpoint_holds_only_plain_values_and_loads_with_weights_only() -> None:
    """The file is torch.save of tensors and plain values; torch.load(weights_only=True) reads it."""
    tracker = MemoryTracker()
    flasync.run(small_config("stop.max_versions=6", "checkpoint.every_versions=5", TOPK), tracker=tracker)
    data = checkpoint.latest(tracker.artifacts)
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    assert loaded["format"] == checkpoint.FORMAT
    # The state's own bytes, under their checksum, load with weights_only=True too.
    state = torch.load(io.BytesIO(loaded["state"].numpy().tobytes()), weights_only=True)
    assert set(state) == set(checkpoint.decode(data)[1])
    assert state["version"] == 5
    # One entry per component, each its own state_dict().
    assert {"weights", "aggregator", "sampler", "registry", "accounting", "intake", "policy", "clock"} <= set(state)
    assert {"participation_clients", "participation_counts", "in_flight", "bases"} <= set(state["registry"])
    assert "rng" in state["sampler"]
    assert state["residuals"]["values"].shape[0] == len(state["residuals"]["ids"]) > 0
    assert state["aggregator"]["kind"] == "buffered" and "optimizer" in state["aggregator"]


@pytest.mark.parametrize("data", [b"", b"not a checkpoint", b"PK\x03\x04garbage"])
def test_unreadable_checkpoints_are_one_line_errors(data: bytes) -> None:
    """Garbage is refused with CheckpointError, never unpickled."""
    with pytest.raises(CheckpointError) as info:
        checkpoint.decode(data)
    assert "\n" not in str(info.value)


def test_a_pickled_object_is_refused() -> None:
    """A file holding an arbitrary Python object does not load (weights_only)."""
    buffer = io.BytesIO()
    torch.save({"format": 1, "state": {}, "config": "", "evil": Path("/")}, buffer)
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        checkpoint.decode(buffer.getvalue())


# ------------------------------------------------------------------------------------------ the command line
CONFIG = """
seed: 3
data: {kind: digits}
partition: {kind: iid}
model: {kind: mlp, hidden: [32]}
population: {num_clients: 20, speed: {kind: lognormal, sigma: 0.5}}
client: {epochs: 2, batch_size: 16, lr: 0.1}
server: {kind: fedbuff, buffer_size: 4, concurrency: 8}
eval: {every_versions: 2}
stop: {max_versions: 24}
faults: {crash: 0.3, hang: 0.1}
resilience: {task_timeout_s: 3.0}
codec: {upload: [{kind: topk, ratio: 0.05}]}
checkpoint: {every_versions: 10}
tracking: {log_model: false}
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def _run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flasync", "run", *args, "--no-system-metrics"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _interrupt_cli(tmp_path: Path, store: str, sig: signal.Signals) -> tuple[int, str]:
    """Start the CLI, send ``sig`` once version 6 was evaluated, return its exit status and stderr.

    SIGINT goes to the whole process group, as Ctrl-C in a terminal does (the metric writer child gets it too).
    """
    process = subprocess.Popen(
        [sys.executable, "-m", "flasync", "run", "cfg.yaml", "--tracking-uri", store, "--no-system-metrics"],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert process.stdout is not None
    lines: list[str] = []
    for line in process.stdout:
        lines.append(line)
        if "server.eval" in line and re.search(r"\bversion=([6-9]|\d\d)\b", line):
            if sig == signal.SIGINT:
                os.killpg(process.pid, sig)
            else:
                process.send_signal(sig)
            break
    rest, _ = process.communicate(timeout=120)
    return process.returncode, "".join(lines) + rest


@pytest.fixture(scope="module")
def cli_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working folder with the config, shared by the command-line tests (one MLflow store, created once)."""
    folder = tmp_path_factory.mktemp("cli")
    (folder / "cfg.yaml").write_text(CONFIG)
    return folder


def _store(folder: Path) -> str:
    return f"sqlite:///{folder / 'store' / 'mlflow.db'}"


@pytest.mark.slow
def test_sigint_then_resume_gives_the_uninterrupted_sha(cli_dir: Path) -> None:
    """SIGINT: exit 130, run KILLED with a checkpoint; --resume continues the same run to the same sha256."""
    tmp_path, store = cli_dir, _store(cli_dir)
    status, output = _interrupt_cli(tmp_path, store, signal.SIGINT)
    assert status == 130, output
    assert "writer_process_lost" not in output  # Ctrl-C reaches the writer child too: it must not look lost
    last = output.strip().splitlines()[-1]
    match = re.fullmatch(
        r"flasync: interrupted \(SIGINT\); checkpoint checkpoints/[ab]\.pt in MLflow run (\w+); "
        r"resume with: python -m flasync run --resume \1",
        last,
    )
    assert match, last
    assert len(re.findall(r"^flasync run stopped \(SIGINT\) at version \d+: accuracy ", output, re.MULTILINE)) == 1
    assert "flasync: SIGINT received; stopping (checkpoint, flush, MLflow run KILLED)" in output
    run_id = match.group(1)
    client = mlflow.MlflowClient(store)
    killed = client.get_run(run_id)
    assert killed.info.status == "KILLED"
    steps_before = [m.step for m in client.get_metric_history(run_id, "server/eval/accuracy")]
    assert steps_before and max(steps_before) < 24

    resumed = _run_cli(tmp_path, "--resume", run_id, "--tracking-uri", store)
    assert resumed.returncode == 0, resumed.stderr
    # The counts are the whole run's; the wall seconds and the rate this process's, and the summary says so.
    assert re.search(r"updates +\d+ accepted, .*/s in this process\)", resumed.stdout), resumed.stdout
    assert re.search(r"time +wall [\d.]+ s in this process, simulated", resumed.stdout), resumed.stdout
    sha = re.search(r"weights sha256  ([0-9a-f]{64})", resumed.stdout)
    assert sha is not None
    uninterrupted = flasync.run(load_config(tmp_path / "cfg.yaml", ["tracking.enabled=false"]))
    assert sha.group(1) == uninterrupted.weights_sha256

    finished = client.get_run(run_id)
    assert finished.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run_id, "server/eval/accuracy")]
    assert set(steps_before) < set(steps) and max(steps) == 24  # metrics of both parts, in one run
    runs = client.search_runs([finished.info.experiment_id])
    assert run_id in [r.info.run_id for r in runs]
    assert "RUNNING" not in [r.info.status for r in runs]


@pytest.mark.slow
def test_sigterm_exits_143_and_kills_the_run(cli_dir: Path) -> None:
    """SIGTERM: exit 143, every metric so far flushed, a checkpoint written, the run KILLED (no RUNNING left), its
    config.yaml stored."""
    tmp_path, store = cli_dir, _store(cli_dir)
    status, output = _interrupt_cli(tmp_path, store, signal.SIGTERM)
    assert status == 143, output
    run_id = re.findall(r"MLflow run (\w+)", output)[-1]
    client = mlflow.MlflowClient(store)
    run = client.get_run(run_id)
    assert run.info.status == "KILLED"
    slots = {a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")}
    assert slots and slots <= set(checkpoint.CHECKPOINT_SLOTS)
    # The config is logged once the run is open, not at its end: a killed run has it too.
    assert "config.yaml" in {a.path for a in client.list_artifacts(run.info.run_id)}
    # The last evaluation printed before the signal is in the store.
    printed = [int(v) for v in re.findall(r"server\.eval .*?\bversion=(\d+)", output)]
    logged = [m.step for m in client.get_metric_history(run.info.run_id, "server/eval/accuracy")]
    assert printed and set(printed) <= set(logged)


TREE_FAULTY = (
    "faults.crash=0.2",
    "faults.hang=0.05",
    "resilience.task_timeout_s=3",
    "resilience.max_update_norm=50",
    "resilience.clip_update_norm=5",
    "checkpoint.every_versions=3",
)


@pytest.mark.parametrize("fanout", [[4], [2, 2]], ids=["depth1", "depth2"])
@pytest.mark.slow
async def test_a_tree_with_faults_validation_and_timeouts_resumes_exactly(fanout: list[int]) -> None:
    """HierFAVG with 20% crashing clients, hangs timed out at the edges, validation and clipping: stopped by a
    signal and resumed from its checkpoint, it ends with the uninterrupted run's weights and counts."""
    config = small_config(
        "stop.max_versions=9",
        *TREE_FAULTY,
        server={"kind": "fedavg", "clients_per_round": 8},
        topology={"kind": "tree", "fanout": fanout, "kappa2": 2},
    )
    fields = ("updates_accepted", "updates_failed", "tasks_timed_out", "tasks_dispatched", "versions")
    full, resumed = await _resumes_exactly(config, 4, fields)
    assert full.updates_failed > 0 and full.tasks_timed_out > 0  # the faults really happened, at the edges
    counts = {key: value for key, value in full.tiers.items() if not key.endswith("_s")}  # not wall seconds
    assert {key: resumed.tiers[key] for key in counts} == counts


@pytest.mark.parametrize(
    "topology",
    [
        {"kind": "tree", "fanout": [4], "buffer_size": 3, "max_wait_s": 0.5},
        {"kind": "tree", "fanout": [2, 2], "buffer_size": 2, "max_wait_s": 0.3, "codec": [{"kind": "fp16"}]},
        {"kind": "tree", "fanout": [2, 2], "buffer_size": 1},
    ],
    ids=["buffered", "depth2-deadlines-fp16", "depth2-relays"],
)
@pytest.mark.slow
async def test_an_async_tree_resumes_exactly(topology: dict[str, Any]) -> None:
    """FedBuff over edges with slow links: partials and relayed uploads in transit, edge deadlines and queued
    messages are in the checkpoint; the resumed run ends with the uninterrupted run's weights and counts."""
    slow = {"latency_s": 0.05, "upload_bytes_per_s": 2e5, "download_bytes_per_s": 2e5}
    config = small_config(
        "stop.max_versions=10",
        "faults.crash=0.1",
        "resilience.max_update_norm=50",
        "checkpoint.every_versions=3",
        topology={**topology, "link": slow},
    )
    await _resumes_exactly(config, 4, ("updates_accepted", "updates_dropped", "updates_failed", "tasks_dispatched"))


@pytest.fixture(scope="module")
def written() -> tuple[bytes, flasync.RunConfig, dict[str, Any]]:
    """A real checkpoint of a run with tasks in flight, its config and state."""
    tracker = MemoryTracker()
    flasync.run(small_config("stop.max_versions=6", "checkpoint.every_versions=5", *FAULTY), tracker=tracker)
    data = checkpoint.latest(tracker.artifacts)
    config, state = checkpoint.decode(data)
    return data, config, state


def test_flipped_bytes_are_caught_by_the_checksum(written: tuple[bytes, flasync.RunConfig, dict[str, Any]]) -> None:
    """64 bytes flipped inside the state are a one-line 'corrupt' error, however they change the tensors."""
    data = bytearray(written[0])
    middle = len(data) // 2
    for offset in range(64):
        data[middle + offset] ^= 0xFF
    with pytest.raises(CheckpointError, match=r"corrupt|not a readable") as info:
        checkpoint.decode(bytes(data))
    assert "\n" not in str(info.value)


def _broken(state: dict[str, Any], path: str, value: object) -> dict[str, Any]:
    import copy

    broken = copy.deepcopy(state)
    keys = path.split(".")
    target = broken
    for key in keys[:-1]:
        target = target[int(key)] if isinstance(target, list) else target[key]
    if value is KeyError:
        del target[keys[-1]]
    else:
        target[keys[-1]] = value
    return broken


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("version", -5, r"version: must be in \[0, \d+\], got -5"),
        ("version", "7", r"version: must be an integer"),
        ("weights", [1.0, 2.0], r"weights: must be a 1-D floating-point tensor"),
        ("aggregator", KeyError, r"aggregator: missing or not a mapping"),
        ("aggregator.kind", "magic", r"aggregator\.kind: unknown kind 'magic'"),
        ("sampler.rng", 3, r"sampler\.rng"),
        ("clock.now", float("inf"), r"clock\.now: must be a finite number"),
        ("registry.in_flight.0.client_id", 10**6, r"registry\.in_flight\[0\]\.client_id: must be in"),
        ("registry.in_flight.0.base_version", 99, r"registry\.in_flight\[0\]\.base_version: must be in"),
        ("registry.snapshot_version", KeyError, r"registry\.snapshot_version: must be an integer"),
        ("accounting.failure_streak", -1, r"accounting\.failure_streak: must be in \[0, \d+\], got -1"),
        ("registry.num_clients", "8", r"registry\.num_clients: missing or not an integer"),
        ("registry.participation_clients", torch.zeros(0, dtype=torch.int64), r"participation_counts: not one count"),
        ("registry.participation_counts", torch.tensor([1.5]), r"registry\.participation_counts: must be a 1-D int"),
    ],
)
def test_every_bad_field_is_a_one_line_error_naming_it(
    written: tuple[bytes, flasync.RunConfig, dict[str, Any]], path: str, value: object, message: str
) -> None:
    """A checkpoint written with a wrong field (the checksum is right) is refused before any run is touched."""
    _, config, state = written
    assert state["registry"]["in_flight"]  # the faulty run has tasks in flight to break
    data = checkpoint.encode(_broken(state, path, value), config)
    with pytest.raises(CheckpointError, match=message) as info:
        checkpoint.decode(data)
    assert "\n" not in str(info.value)


def _repacked(data: bytes, **fields: object) -> bytes:
    """Return a checkpoint's bytes with outer fields replaced, its checksum left as it was written."""
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    loaded.update(fields)
    buffer = io.BytesIO()
    torch.save(loaded, buffer)
    return buffer.getvalue()


def test_the_checksum_covers_the_config_and_the_version_fields(
    written: tuple[bytes, flasync.RunConfig, dict[str, Any]],
) -> None:
    """A learning rate edited in the checkpoint's config text (before: accepted, the run finished at accuracy 0.1),
    or another flasync version written in, is a one-line 'corrupt' error."""
    data = written[0]
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    assert "lr:" in loaded["config"]
    edited = loaded["config"].replace("lr: ", "lr: 5.0 #", 1)
    for changed in (_repacked(data, config=edited), _repacked(data, flasync="0.0.0")):
        with pytest.raises(CheckpointError, match="corrupt: the sha256 of its config and") as info:
            checkpoint.decode(changed)
        assert "\n" not in str(info.value)


def test_a_checkpoint_of_the_previous_format_still_reads(
    written: tuple[bytes, flasync.RunConfig, dict[str, Any]],
) -> None:
    """Format 3 (its sha256 over the state's bytes only) resumes as before."""
    import hashlib

    loaded = torch.load(io.BytesIO(written[0]), weights_only=True)
    state_bytes = loaded["state"].numpy().tobytes()
    old = _repacked(written[0], format=3, state_sha256=hashlib.sha256(state_bytes).hexdigest())
    config, state = checkpoint.decode(old)
    assert config == written[1] and state["version"] == written[2]["version"]
    with pytest.raises(CheckpointError, match="format 2 is not supported"):
        checkpoint.decode(_repacked(written[0], format=2))


def test_a_checkpoint_with_one_participation_counter_per_client_still_reads(
    written: tuple[bytes, flasync.RunConfig, dict[str, Any]],
) -> None:
    """A registry state of one counter per client (``participations``, as checkpoints held before the counters of
    the clients dispatched to) decodes and fits its population; a count out of range, a client out of range or the
    wrong population size is refused."""
    _, config, state = written
    registry = state["registry"]
    dense = torch.zeros(registry["num_clients"], dtype=torch.int64)
    dense[registry["participation_clients"]] = registry["participation_counts"]
    old = {k: v for k, v in registry.items() if not k.startswith("participation_") and k != "num_clients"}
    _, decoded = checkpoint.decode(checkpoint.encode({**state, "registry": {**old, "participations": dense}}, config))
    checkpoint.check_fits(decoded, num_params=state["weights"].numel(), num_clients=config.population.num_clients)
    with pytest.raises(CheckpointError, match=r"registry\.num_clients: \d+ clients, but the run's population has"):
        checkpoint.check_fits(decoded, num_params=state["weights"].numel(), num_clients=len(dense) + 1)
    far = registry["participation_clients"].clone()
    far[-1] = registry["num_clients"]
    with pytest.raises(CheckpointError, match=r"registry\.participation_clients: ids must be in \[0, "):
        checkpoint.decode(checkpoint.encode({**state, "registry": {**registry, "participation_clients": far}}, config))
    for bad in (-1, 2**62):
        dense[0] = bad
        with pytest.raises(CheckpointError, match=r"registry\.participation_counts: must be in \[0, "):
            checkpoint.decode(checkpoint.encode({**state, "registry": {**old, "participations": dense}}, config))


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("version", 2**62, r"version: must be in \[0, 9007199254740992\]"),
        ("version", 7, r"version: 7 is past the run's stop.max_versions 6"),
        ("accounting.stats.updates_accepted", -3, r"accounting\.stats\.updates_accepted: must be in \[0, "),
        ("accounting.stats.upload_bytes", 2**62, r"accounting\.stats\.upload_bytes: must be in \[0, "),
        ("accounting.stats.cloud_aggregate_s", float("inf"), r"accounting\.stats\.cloud_aggregate_s: must be in"),
    ],
    ids=["huge-version", "past-stop", "negative-count", "huge-bytes", "infinite-seconds"],
)
def test_every_count_is_bounded(
    written: tuple[bytes, flasync.RunConfig, dict[str, Any]], path: str, value: object, message: str
) -> None:
    """A version beyond the run's stop rule or a count out of range (before: version 2**62 was accepted and the run
    finished at version 4611686018427387905) is a one-line error naming the field."""
    _, config, state = written
    with pytest.raises(CheckpointError, match=message) as info:
        checkpoint.decode(checkpoint.encode(_broken(state, path, value), config))
    assert "\n" not in str(info.value)


def test_nan_weights_are_refused_when_read(written: tuple[bytes, flasync.RunConfig, dict[str, Any]]) -> None:
    """Weights holding NaN are refused with the checkpoint, before anything runs."""
    _, config, state = written
    weights = state["weights"].clone()
    weights[3] = math.nan
    with pytest.raises(CheckpointError, match="checkpoint field weights: holds NaN or Inf"):
        checkpoint.decode(checkpoint.encode(_broken(state, "weights", weights), config))


async def test_a_checkpoint_that_does_not_fit_the_model_is_refused_before_the_run_is_touched(
    written: tuple[bytes, flasync.RunConfig, dict[str, Any]],
) -> None:
    """A checkpoint whose weights are not the config's model's length is refused in one line before the tracking
    run is resumed or any state is loaded."""
    _, config, state = written
    other = config.model_copy(update={"model": config.model.model_copy(update={"hidden": (9,)})})
    tracker = MemoryTracker()
    resume = checkpoint.ResumePoint("run-to-resume", state)
    with pytest.raises(CheckpointError, match=r"checkpoint field weights: \d+ parameters, but the run's model has"):
        await flasync.Federation(other, tracker=tracker, resume=resume).run()
    assert tracker.run_id is None and not tracker.metrics  # never resumed, nothing logged


@pytest.mark.slow
@pytest.mark.parametrize("how", ["bad-field", "other-model"])
def test_resuming_from_a_corrupt_checkpoint_leaves_the_run_untouched(
    written: tuple[bytes, flasync.RunConfig, dict[str, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    how: str,
) -> None:
    """--resume of a run whose checkpoint was tampered with, or does not fit its config's model (before: NaN weights
    and wrong shapes turned a KILLED run into FAILED): exit 2, one line, the run still KILLED."""
    from flasync.cli import main

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    prepare_sqlite_store(uri)  # the store's schema from flasync's seed, not MLflow's migrations (seconds of CPU)
    client = mlflow.MlflowClient(uri)
    artifacts = (tmp_path / "artifacts").as_uri()  # not ./mlruns
    run_id = client.create_run(client.create_experiment("resume", artifact_location=artifacts)).info.run_id
    _, config, state = written
    artifact = tmp_path / "checkpoints" / "latest.pt"
    artifact.parent.mkdir()
    if how == "bad-field":
        artifact.write_bytes(checkpoint.encode(_broken(state, "version", -5), config))
        expected = f"checkpoint field version: must be in [0, {checkpoint.MAX_COUNT}], got -5"
    else:
        other = config.model_copy(update={"model": config.model.model_copy(update={"hidden": (9,)})})
        artifact.write_bytes(checkpoint.encode(state, other))
        expected = f"checkpoint field weights: {state['weights'].numel()} parameters, but the run's model has"
    client.log_artifact(run_id, str(artifact), "checkpoints")
    client.set_terminated(run_id, "KILLED")
    assert main(["run", "--resume", run_id, "--tracking-uri", uri]) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("flasync")]
    assert len(said) == 1 and said[0].startswith(f"flasync: error: {expected}"), said
    assert client.get_run(run_id).info.status == "KILLED"


@pytest.mark.slow
def test_a_killed_run_is_marked_failed_and_resumed_to_the_uninterrupted_weights(tmp_path: Path) -> None:
    """SIGKILL leaves the run RUNNING; mark-failed finds its process gone and marks it FAILED; --resume continues
    from the last periodic checkpoint to the uninterrupted sha256. The checkpoint was in the store only after the
    metrics it covers, and after the resume every evaluation step is in the store exactly once."""
    # Long enough that two checkpoints reach the store before the run ends: training does not wait for the MLflow run
    # to be created, and checkpoints wait for it (and their upload may lag on a busy machine).
    versions = 400
    (tmp_path / "cfg.yaml").write_text(CONFIG.replace("max_versions: 24", f"max_versions: {versions}"))
    store = _store(tmp_path)
    prepare_sqlite_store(store)  # an existing store: the run opens early in the training
    process = subprocess.Popen(
        [sys.executable, "-m", "flasync", "run", "cfg.yaml", "--tracking-uri", store, "--no-system-metrics"],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    run_id = journal_id = None
    for line in process.stdout:
        found = re.search(r"run_id=(\w{32})", line)
        run_id = run_id or (found.group(1) if found else None)
        named = re.search(r"run\.started +run=(\w{32})", line)
        journal_id = journal_id or (named.group(1) if named else None)
        if run_id and "server.eval" in line and re.search(r"\bversion=(1[2-9]|[2-9]\d|\d{3,})\b", line):
            client = mlflow.MlflowClient(store)
            # Both slots exist: the second write began after the first ended, so one of them is whole even if the
            # kill lands in the middle of an upload.
            if len(client.list_artifacts(run_id, "checkpoints")) == 2:
                process.kill()
                break
    rest, _ = process.communicate(timeout=60)
    assert run_id is not None, rest[-2000:]
    # A run that ends by itself ended before two checkpoints were in the store (a store lagging behind training).
    assert process.returncode == -signal.SIGKILL, f"exit {process.returncode} before the kill: {rest[-2000:]}"
    client = mlflow.MlflowClient(store)
    assert client.get_run(run_id).info.status == "RUNNING"  # nothing ended it
    saved = checkpoint.fetch(run_id, store).state
    saved_version = int(saved["version"])
    before = [m.step for m in client.get_metric_history(run_id, "server/eval/accuracy")]
    assert set(range(2, saved_version + 1, 2)) <= set(before)  # the metrics the checkpoint covers came first

    marked = subprocess.run(
        [sys.executable, "-m", "flasync", "tracking", "mark-failed", "--tracking-uri", store],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert marked.returncode == 0, marked.stderr
    assert f"{run_id}  FAILED" in marked.stdout
    assert client.get_run(run_id).info.status == "FAILED"

    # The resumed run stops 10 versions past what the killed one reached (stop.* may change on resume): the
    # uninterrupted run to compare with is as short.
    last = max(max(before), saved_version) + 10
    stop = f"stop.max_versions={last}"
    # The id printed before training started names the run: its journal was retired once a checkpoint reached the
    # store, and the MLflow run carries the id as a tag.
    assert journal_id is not None and not (tmp_path / "mlruns" / "spool" / f"{journal_id}.jsonl").exists()
    resumed = _run_cli(tmp_path, "--resume", journal_id, "--tracking-uri", store, "--set", stop)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    sha = re.search(r"weights sha256  ([0-9a-f]{64})", resumed.stdout)
    config = load_config(tmp_path / "cfg.yaml", ["tracking.enabled=false", stop])
    assert sha is not None and sha.group(1) == flasync.run(config).weights_sha256
    assert client.get_run(run_id).info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run_id, "server/eval/accuracy")]
    assert sorted(steps) == list(range(0, last + 1, 2)), f"killed at {max(before)}, resumed from {saved_version}"


SLOW_MLFLOW = """
import os, sys, time


class _SlowMlflow:
    # Delays the first import of MLflow: the writer process takes that long to open the run.
    def find_spec(self, name, path=None, target=None):
        if name == "mlflow":
            sys.meta_path.remove(self)
            time.sleep(float(os.environ["FLASYNC_TEST_MLFLOW_IMPORT_S"]))
        return None


if os.environ.get("FLASYNC_TEST_MLFLOW_IMPORT_S"):
    sys.meta_path.insert(0, _SlowMlflow())
"""


@pytest.mark.slow
def test_a_run_killed_before_its_mlflow_run_opened_resumes_from_its_journal(tmp_path: Path) -> None:
    """SIGKILL while the MLflow run is still being opened (its writer process held up importing MLflow): no run is
    in the store, but the journal holds the run's metrics and checkpoints; --resume with the id printed before
    training started replays it into a new MLflow run and continues to the uninterrupted run's weights, every
    evaluation step in the store once; the next start named the journal before it was replayed."""
    versions = 400
    (tmp_path / "cfg.yaml").write_text(CONFIG.replace("max_versions: 24", f"max_versions: {versions}"))
    (tmp_path / "hooks").mkdir()
    (tmp_path / "hooks" / "sitecustomize.py").write_text(SLOW_MLFLOW)
    store = _store(tmp_path)
    prepare_sqlite_store(store)
    env = _env()
    env["PYTHONPATH"] = f"{tmp_path / 'hooks'}{os.pathsep}{env['PYTHONPATH']}"
    env["FLASYNC_TEST_MLFLOW_IMPORT_S"] = "90"
    process = subprocess.Popen(
        [sys.executable, "-m", "flasync", "run", "cfg.yaml", "--tracking-uri", store, "--no-system-metrics"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    journal_id = None
    for line in process.stdout:
        named = re.search(r"run\.started +run=(\w{32})", line)
        journal_id = journal_id or (named.group(1) if named else None)
        assert "run.opened" not in line
        if journal_id and "server.eval" in line and re.search(r"\bversion=(2[4-9]|[3-9]\d|\d{3,})\b", line):
            process.kill()
            break
    rest, _ = process.communicate(timeout=60)
    assert journal_id is not None and process.returncode == -signal.SIGKILL, rest[-2000:]
    client = mlflow.MlflowClient(store)
    assert client.search_runs([e.experiment_id for e in client.search_experiments()]) == []
    journal = tmp_path / "mlruns" / "spool" / f"{journal_id}.jsonl"
    assert journal.is_file()

    told = _run_cli(tmp_path, "--tracking-uri", store, "--set", "stop.max_versions=2")
    assert f"run {journal_id} was killed" in told.stderr and f"--resume {journal_id}" in told.stderr, told.stderr

    stop = f"stop.max_versions={40}"
    resumed = _run_cli(tmp_path, "--resume", journal_id, "--tracking-uri", store, "--set", stop)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"run {journal_id}'s journal {journal} replayed into MLflow run" in resumed.stderr
    sha = re.search(r"weights sha256  ([0-9a-f]{64})", resumed.stdout)
    config = load_config(tmp_path / "cfg.yaml", ["tracking.enabled=false", stop])
    assert sha is not None and sha.group(1) == flasync.run(config).weights_sha256
    run_id = re.search(r"MLflow run +(\w{32})", resumed.stdout)
    assert run_id is not None and not journal.exists()
    assert client.get_run(run_id.group(1)).info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run_id.group(1), "server/eval/accuracy")]
    assert sorted(steps) == list(range(0, 41, 2))


@pytest.mark.slow
def test_resuming_a_run_whose_process_is_alive_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A RUNNING run owned by a live process (here: this one) is not resumed by a second process."""
    from flasync.cli import main
    from flasync.core.owner import owner_tags

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    prepare_sqlite_store(uri)  # the store's schema from flasync's seed, not MLflow's migrations (seconds of CPU)
    client = mlflow.MlflowClient(uri)
    artifacts = (tmp_path / "artifacts").as_uri()  # not ./mlruns
    experiment_id = client.create_experiment("owned", artifact_location=artifacts)
    run_id = client.create_run(experiment_id, tags=owner_tags()).info.run_id
    tracker = MemoryTracker()
    flasync.run(small_config("stop.max_versions=6", "checkpoint.every_versions=5"), tracker=tracker)
    artifact = tmp_path / "checkpoints" / "latest.pt"
    artifact.parent.mkdir()
    artifact.write_bytes(checkpoint.latest(tracker.artifacts))
    client.log_artifact(run_id, str(artifact), "checkpoints")
    assert main(["run", "--resume", run_id, "--tracking-uri", uri]) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("flasync")]
    assert len(said) == 1 and f"MLflow run {run_id} is still running (process {os.getpid()}" in said[0]
    assert client.get_run(run_id).info.status == "RUNNING"


@pytest.mark.slow
def test_a_checkpoint_cut_short_falls_back_to_the_other_slot(tmp_path: Path) -> None:
    """Checkpoints alternate between two artifacts; when the newer one was cut short (a kill during its upload), the
    run resumes from the older, whole one; with none whole, the error names what is wrong."""
    tracker = MemoryTracker()
    flasync.run(small_config("stop.max_versions=9", "checkpoint.every_versions=2"), tracker=tracker)
    slots = {name: tracker.artifacts[name] for name in checkpoint.CHECKPOINT_SLOTS}
    versions = {name: int(checkpoint.decode(data)[1]["version"]) for name, data in slots.items()}
    assert sorted(versions.values()) == [6, 8]
    newer = max(versions, key=versions.__getitem__)
    older = min(versions, key=versions.__getitem__)
    cut = {newer: slots[newer][: len(slots[newer]) // 2], older: slots[older]}
    name, _, state = checkpoint.newest(cut.items())
    assert (name, int(state["version"])) == (older, 6)

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    prepare_sqlite_store(uri)  # the store's schema from flasync's seed, not MLflow's migrations (seconds of CPU)
    client = mlflow.MlflowClient(uri)
    artifacts = (tmp_path / "artifacts").as_uri()  # not ./mlruns
    run_id = client.create_run(client.create_experiment("cut", artifact_location=artifacts)).info.run_id
    for artifact, data in cut.items():
        local = tmp_path / artifact
        local.parent.mkdir(exist_ok=True)
        local.write_bytes(data)
        client.log_artifact(run_id, str(local), "checkpoints")
    assert checkpoint.fetch(run_id, uri).artifact == older
    with pytest.raises(CheckpointError, match="checkpoint"):
        checkpoint.newest([(newer, cut[newer])])
