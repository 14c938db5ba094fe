"""The runtime end to end: determinism, events, embedding, summaries, bad data and models."""

from __future__ import annotations

import asyncio
import io
import json
import math
import re
import time
from pathlib import Path
from typing import Any

import mlflow
import mlflow.pytorch
import numpy as np
import pytest
import torch
import uvloop
from mlflow.entities import ViewType
from torch import nn

import flasync
from flasync import tracking
from flasync.core.clock import VirtualClock
from flasync.core.errors import ConfigError, DataError, TrainingError
from flasync.core.events import (
    Aggregated,
    ClientFailed,
    Evaluated,
    ModelPublished,
    RunFinished,
    TaskAssigned,
    UpdateReceived,
    UpdateRejected,
    UpdateUploaded,
)
from flasync.data import ArrayData
from flasync.observe.summary import weights_sha256
from flasync.runtime import tracked
from flasync.runtime.build import make_aggregator
from flasync.server import ServerStats
from flasync.testing import EventRecorder, MeanOfDeltas, MemoryTracker, UntrainableModel, small_config
from flasync.tracking.store import prepare_sqlite_store
from tests.conftest import Focal

SUMMARY_KEYS = {
    "accuracy",
    "loss",
    "updates_accepted",
    "updates_dropped",
    "versions",
    "wall_s",
    "simulated_s",
    "upload_bytes",
    "download_bytes",
    "weights_sha256",
}


def _sha(*overrides: str, **kwargs: Any) -> str:
    return flasync.run(small_config(*overrides), **kwargs).weights_sha256


@pytest.mark.slow
def test_same_seed_same_weights() -> None:
    """Two runs with one seed end with bit-identical weights."""
    assert _sha() == _sha()


@pytest.mark.slow
def test_thread_count_does_not_change_weights() -> None:
    """1 and 3 executor threads give the same weights under the virtual clock."""
    assert _sha("executor.workers=1") == _sha("executor.workers=3")


@pytest.mark.slow
def test_other_seed_other_weights() -> None:
    """Another seed gives other weights."""
    assert _sha("seed=0") != _sha("seed=1")


def test_event_loop_implementation_does_not_change_weights() -> None:
    """The stdlib asyncio loop and uvloop give the same weights."""
    config = small_config("stop.max_versions=30", server={"kind": "fedasync", "concurrency": 6})
    on_asyncio = asyncio.run(flasync.Federation(config).run()).weights_sha256
    on_uvloop = uvloop.run(flasync.Federation(config).run()).weights_sha256
    assert on_asyncio == on_uvloop


@pytest.mark.parametrize(
    "server",
    [
        {"kind": "fedavg", "clients_per_round": 5},
        {"kind": "fedbuff", "buffer_size": 3, "concurrency": 6},
        {"kind": "fedasync", "alpha": 0.5, "concurrency": 6},
    ],
)
@pytest.mark.slow
def test_every_aggregator_is_deterministic(server: dict[str, Any]) -> None:
    """FedAvg, FedBuff and FedAsync each reproduce their weights with 1 and 2 threads."""
    first = flasync.run(small_config("executor.workers=1", server=server))
    second = flasync.run(small_config("executor.workers=2", server=server))
    assert first.weights_sha256 == second.weights_sha256
    assert first.versions == 12


async def test_summary_has_the_documented_keys() -> None:
    """The summary (and summary.json) carries the documented keys with consistent values."""
    tracker = MemoryTracker()
    summary = await flasync.Federation(small_config(), tracker=tracker).run()
    data = summary.to_dict()
    assert data.keys() >= SUMMARY_KEYS
    assert data["versions"] == 12
    assert data["updates_accepted"] == 12 * 4
    assert data["simulated_s"] > 0 and data["wall_s"] > 0
    import json

    assert json.loads(tracker.artifacts["summary.json"]) == data


async def test_tracker_is_prepared_before_the_data_and_finished_after_bad_data() -> None:
    """The runtime calls prepare() first; data that cannot be used ends the tracker before any run starts."""
    tracker = MemoryTracker()
    await flasync.Federation(small_config("stop.max_versions=1"), tracker=tracker).run()
    assert tracker.prepared and tracker.status == "FINISHED"
    failed = MemoryTracker()
    with pytest.raises(DataError, match=r"population\.num_clients: 5000 clients"):
        await flasync.Federation(small_config("population.num_clients=5000"), tracker=failed).run()
    assert failed.prepared and failed.run_id is None and failed.status is None


async def test_wall_clock_times_count_from_the_federation_start() -> None:
    """Under the wall clock, the evaluations' times and the summary's simulated_s share one origin."""
    tracker = MemoryTracker()
    summary = await flasync.Federation(small_config("clock=wall", "stop.max_versions=4"), tracker=tracker).run()
    evaluations = [value for _, value in tracker.history("server/eval/simulated_s")]
    assert evaluations and evaluations == sorted(evaluations)
    assert evaluations[-1] <= summary.simulated_s <= summary.wall_s + 0.5


async def test_the_summary_says_how_long_the_first_update_took() -> None:
    """first_update_s: real seconds from the federation's start to its first accepted update, in the summary and
    summary.json, and kept by a checkpoint's counters."""
    tracker = MemoryTracker()
    summary = await flasync.Federation(small_config("stop.max_versions=3"), tracker=tracker).run()
    assert 0 < summary.first_update_s < summary.wall_s
    assert json.loads(tracker.artifacts["summary.json"])["first_update_s"] == summary.first_update_s
    resumed = ServerStats.from_state(ServerStats(first_update_s=0.25).to_state())
    assert resumed.first_update_s == 0.25  # kept by a checkpoint: a resumed run's first update is the original's
    assert math.isnan(ServerStats().first_update_s)


async def test_bus_carries_the_run_as_events() -> None:
    """Observers on the bus see every published version, task, update and the end of the run."""
    federation = flasync.Federation(small_config())
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    assert recorder.dropped == 0
    assert recorder.count(ModelPublished) == summary.versions + 1
    assert recorder.count(Aggregated) == summary.versions
    assert recorder.count(TaskAssigned) == summary.tasks_dispatched
    assert recorder.count(UpdateReceived) == summary.updates_accepted
    assert recorder.count(UpdateUploaded) >= summary.updates_accepted
    assert recorder.count(Evaluated) >= 1
    (finished,) = recorder.of(RunFinished)
    assert finished.versions == summary.versions
    versions = [e.version for e in recorder.of(ModelPublished)]
    assert versions == list(range(summary.versions + 1))


async def test_staleness_is_counted_in_versions() -> None:
    """With C > K, updates arrive stale; staleness is version_now - base_version."""
    federation = flasync.Federation(small_config("server.buffer_size=2", "server.concurrency=10"))
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    received = recorder.of(UpdateReceived)
    assert all(e.staleness == e.version - e.base_version for e in received)
    assert max(e.staleness for e in received) > 0
    assert summary.staleness_max == max(e.staleness for e in received)


@pytest.mark.slow
async def test_max_staleness_drops_and_counts() -> None:
    """Updates older than max_staleness are rejected as stale and counted as dropped."""
    federation = flasync.Federation(
        small_config("server.buffer_size=2", "server.concurrency=10", "server.max_staleness=0")
    )
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    rejected = recorder.of(UpdateRejected)
    assert summary.updates_dropped == len(rejected) > 0
    assert {e.reason for e in rejected} == {"stale"}
    assert all(e.staleness == 0 for e in recorder.of(UpdateReceived))


async def test_fedbuff_with_everyone_at_tau_zero_is_fedavg() -> None:
    """FedBuff with K = C = N, sample weights and tau = 0 produces FedAvg's first version (up to summation order)."""
    n = 10
    population = {"num_clients": n, "speed": {"kind": "constant"}}
    fedbuff = flasync.Federation(
        small_config(
            "stop.max_versions=1",
            population=population,
            server={
                "kind": "fedbuff",
                "buffer_size": n,
                "concurrency": n,
                "example_weight": "samples",
                "staleness": {"kind": "constant"},
            },
        )
    )
    fedavg = flasync.Federation(
        small_config("stop.max_versions=1", population=population, server={"kind": "fedavg", "clients_per_round": n})
    )
    recorder = EventRecorder(fedbuff.bus)
    await fedbuff.run()
    await fedavg.run()
    assert {e.staleness for e in recorder.of(UpdateReceived)} == {0}
    assert fedbuff.weights is not None and fedavg.weights is not None
    torch.testing.assert_close(fedbuff.weights, fedavg.weights, rtol=0, atol=1e-6)


async def test_runs_inside_a_running_loop_without_blocking_it() -> None:
    """Federation.run() is awaited in an existing loop, which keeps serving other tasks throughout."""
    ticks: list[float] = []
    stop = asyncio.Event()

    async def heartbeat() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    async with asyncio.TaskGroup() as tg:
        tg.create_task(heartbeat())
        summary = await flasync.Federation(small_config("stop.max_versions=20")).run()
        stop.set()
    assert summary.versions == 20
    gaps = np.diff(ticks)
    # A loop blocked by training or MLflow would show gaps of the whole run; 2 s is generous for a shared machine.
    assert len(ticks) > 5 and gaps.max() < 2.0
    assert asyncio.get_running_loop().is_running()


async def test_wall_clock_runs_the_same_code() -> None:
    """The wall clock runs a federation in real time and reports real seconds."""
    summary = await flasync.Federation(small_config("clock=wall", "stop.max_versions=4")).run()
    assert summary.versions == 4
    assert summary.simulated_s == pytest.approx(summary.wall_s, rel=0.5)


async def test_virtual_time_is_simulated_durations_not_wall_time() -> None:
    """Under the virtual clock, simulated seconds follow the speed model, far beyond the wall time."""
    config = small_config(population={"num_clients": 20, "speed": {"kind": "constant", "seconds_per_step": 10.0}})
    summary = await flasync.Federation(config).run()
    assert summary.simulated_s > 100 * summary.wall_s


async def test_custom_dataset_and_model_factory() -> None:
    """Any torch Dataset of (x, y) pairs and any nn.Module factory train through the Python API."""

    class Blobs(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
        def __init__(self, n: int) -> None:
            g = torch.Generator().manual_seed(0)
            self.y = torch.randint(0, 3, (n,), generator=g)
            self.x = torch.randn(n, 5, generator=g) + 3.0 * nn.functional.one_hot(self.y, 5).float()

        def __len__(self) -> int:
            return len(self.y)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            return self.x[i], int(self.y[i])

    def factory() -> nn.Module:
        return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))

    tracker = MemoryTracker()
    summary = await flasync.Federation(
        small_config("stop.max_versions=30"), dataset=Blobs(600), model_factory=factory, tracker=tracker
    ).run()
    assert summary.accuracy > 0.9
    (dataset,) = tracker.datasets
    assert dataset["name"] == "custom" and dataset["profile"]["features"] == 5 and dataset["profile"]["classes"] == 3
    assert tracker.run_name is not None and tracker.run_name.startswith("fedbuff-custom-seed0-")


async def test_clients_with_no_samples_are_a_data_error() -> None:
    """More clients than samples is a DataError before any run starts."""
    data = ArrayData(x=torch.randn(30, 4), y=torch.randint(0, 2, (30,)), num_classes=2)
    tracker = MemoryTracker()
    with pytest.raises(DataError, match="client"):
        await flasync.Federation(small_config("population.num_clients=50"), dataset=data, tracker=tracker).run()
    assert tracker.run_id is None


async def test_model_factory_that_raises_is_a_config_error() -> None:
    """A model factory that raises is reported as a ConfigError and starts no run."""

    def broken() -> nn.Module:
        raise RuntimeError("no weights today")

    tracker = MemoryTracker()
    with pytest.raises(ConfigError, match="model factory failed: RuntimeError: no weights today"):
        await flasync.Federation(small_config(), model_factory=broken, tracker=tracker).run()
    assert tracker.run_id is None


async def test_model_with_wrong_output_is_a_config_error() -> None:
    """A model whose output is not (batch, classes) logits is refused."""
    with pytest.raises(ConfigError, match="expected \\(2, 10\\) logits"):
        await flasync.Federation(small_config(), model_factory=lambda: nn.Linear(64, 3)).run()


async def test_every_client_failing_ends_the_run_failed() -> None:
    """A run whose every client task fails stops with TrainingError and ends FAILED."""

    tracker = MemoryTracker()
    federation = flasync.Federation(small_config(), model_factory=UntrainableModel, tracker=tracker)
    recorder = EventRecorder(federation.bus)
    with pytest.raises(TrainingError, match="client tasks all failed; the last error: RuntimeError: cannot train"):
        await federation.run()
    assert tracker.status == "FAILED"
    assert recorder.count(ClientFailed) >= 30


async def test_cancelled_run_ends_killed() -> None:
    """Cancelling the run's task ends its tracking run as KILLED."""
    tracker = MemoryTracker()
    federation = flasync.Federation(small_config("clock=wall", "stop.max_versions=100000"), tracker=tracker)
    published = federation.bus.subscribe(ModelPublished, policy="drop_oldest")
    task = asyncio.create_task(federation.run())
    await published.receive()
    await published.receive()  # a version was aggregated: training is under way
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert tracker.status == "KILLED"


@pytest.mark.slow
def test_a_run_whose_mlflow_run_cannot_be_opened_stops_and_says_why(tmp_path: Path) -> None:
    """Training starts while the MLflow run is opened; a deleted experiment stops the federation (it would run 100,000
    versions) and is raised, and no MLflow run is left."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    prepare_sqlite_store(uri)  # the store's schema from flasync's seed, not MLflow's migrations (seconds of CPU)
    client = mlflow.MlflowClient(uri)
    gone = client.create_experiment("gone")
    client.delete_experiment(gone)
    config = small_config(
        "tracking.enabled=true", "tracking.experiment=gone", "tracking.log_model=false", "stop.max_versions=100000"
    )
    with pytest.raises(tracking.ExperimentDeletedError, match="deleted"):
        flasync.run(config, tracker=tracking.MlflowTracker(uri))
    assert client.search_runs([gone], run_view_type=ViewType.ALL) == []


async def test_metrics_keys_are_bounded_and_stepped() -> None:
    """Metric keys do not grow with clients; per-update figures step by update, per-version by version."""
    tracker = MemoryTracker()
    summary = await flasync.Federation(small_config("tracking.log_level=debug"), tracker=tracker).run()
    keys = tracker.metric_keys()
    assert len(keys) < 120  # event fields, profile headline figures and the per-version breakdown
    assert not any(str(i) in key.split(".")[-1] for key in keys for i in range(20) if key.endswith(f"_{i}"))
    for key in (
        "client/samples",
        "client/loss",
        "server/update/staleness",
        "profile/version/compute_s",
        "profile/version/queue_wait_s",
        "server/version/aggregate_s",
        "server/version/versions_per_s",
        "server/version/simulated_s",
        "server/version/wall_s",
        "server/eval/accuracy",
        "server/eval/loss",
    ):
        assert key in keys, key
    assert [step for step, _ in tracker.history("server/version/aggregate_s")] == list(range(1, 13))
    staleness_steps = [step for step, _ in tracker.history("server/update/staleness")]
    assert staleness_steps == list(range(1, summary.updates_accepted + 1))
    assert tracker.history("server/eval/accuracy")[-1][1] == pytest.approx(summary.accuracy)


async def test_logged_bytes_are_payload_lengths() -> None:
    """Upload bytes in metrics and summary are the real lengths of the encoded payloads."""
    tracker = MemoryTracker()
    federation = flasync.Federation(small_config(), tracker=tracker)
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    uploads = recorder.of(UpdateUploaded)
    assert summary.upload_bytes == sum(len(e.payload) for e in uploads)
    params = sum(p.numel() for p in flasync.training.models.MLP(64, (32,), 10).parameters())
    assert tracker.tags["constant/client/upload_bytes"] == str(24 + 4 * params)  # dense: every update's size


@pytest.mark.slow
async def test_per_update_figures_that_never_change_are_tags_not_series() -> None:
    """A per-update figure constant all run long (a dense codec's bytes) is one tag, not a series; one that varies
    (samples of unequal partitions, staleness of FedBuff, the bytes of a top-k codec with int8 values) is a whole
    series, a row per update."""
    dense, sparse = MemoryTracker(), MemoryTracker()
    summary = await flasync.Federation(small_config("tracking.log_level=debug"), tracker=dense).run()
    codec = {"upload": [{"kind": "topk", "ratio": 0.1}, {"kind": "int8"}]}
    await flasync.Federation(small_config("tracking.log_level=debug", codec=codec), tracker=sparse).run()
    assert {"constant/client/upload_bytes", "constant/client/download_bytes"} <= set(dense.tags)
    assert "client/upload_bytes" not in dense.metric_keys()
    assert "constant/client/samples" not in dense.tags and "constant/server/update/staleness" not in dense.tags
    assert len(dense.history("server/update/staleness")) == summary.updates_accepted
    assert len({v for _, v in dense.history("client/samples")}) > 1
    assert "constant/client/upload_bytes" not in sparse.tags
    assert len({v for _, v in sparse.history("client/upload_bytes")}) > 1


async def test_final_weights_artifact_matches_the_summary() -> None:
    """weights.pt loads with weights_only=True and hashes to the summary's sha256."""
    tracker = MemoryTracker()
    summary = await flasync.Federation(small_config(), tracker=tracker).run()
    saved = torch.load(io.BytesIO(tracker.artifacts["weights.pt"]), weights_only=True)
    assert weights_sha256(saved["flat"]) == summary.weights_sha256
    assert list(saved["state_dict"]) == ["layers.0.weight", "layers.0.bias", "layers.2.weight", "layers.2.bias"]
    assert torch.equal(torch.cat([t.reshape(-1) for t in saved["state_dict"].values()]), saved["flat"])
    assert b"server:" in tracker.artifacts["config.yaml"]


@pytest.mark.slow
def test_a_tracked_run_exports_its_model_ahead_for_the_trained_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a tracked run trains, the writer process is asked to export the model's structure: the builder,
    arguments (no weights) and input example the trained model is logged with at the end, which loads to the run's
    final weights."""
    calls: dict[str, tuple[str, dict[str, Any], np.ndarray]] = {}
    prepare, start = tracking.MlflowTracker.prepare_model_from, tracking.MlflowTracker.start_model_from

    def prepare_model_from(self: tracking.MlflowTracker, builder: str, kwargs: Any, *, input_example: Any) -> None:
        calls["prepare"] = (builder, dict(kwargs), input_example)
        prepare(self, builder, kwargs, input_example=input_example)

    def start_model_from(self: tracking.MlflowTracker, builder: str, kwargs: Any, **options: Any) -> Any:
        calls["start"] = (builder, dict(kwargs), options["input_example"])
        return start(self, builder, kwargs, **options)

    monkeypatch.setattr(tracking.MlflowTracker, "prepare_model_from", prepare_model_from)
    monkeypatch.setattr(tracking.MlflowTracker, "start_model_from", start_model_from)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    summary = flasync.run(small_config("tracking.enabled=true", f"tracking.uri={uri}", "tracking.log_model=true"))
    (ahead, ahead_kwargs, ahead_example), (builder, kwargs, example) = calls["prepare"], calls["start"]
    assert ahead == builder and ahead_kwargs == {**kwargs, "weights": None} and kwargs["weights"]
    assert np.array_equal(ahead_example, example)
    client = mlflow.MlflowClient(uri)
    [logged] = client.search_logged_models([client.get_run(summary.run_id).info.experiment_id])
    assert str(logged.status) == "READY"
    saved = torch.load(client.download_artifacts(summary.run_id, "weights.pt", str(tmp_path)), weights_only=True)
    model = flasync.training.models.MLP(64, [32], 10)
    model.load_state_dict(saved["state_dict"])
    x = torch.from_numpy(example)
    assert torch.allclose(mlflow.pytorch.load_model(logged.artifact_location)(x), model(x), atol=1e-6)


@pytest.mark.slow
def test_the_next_tracked_run_of_a_model_logs_it_from_the_export_the_first_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first tracked run of a config keeps its model's export and marks it for that config: the next run's writer
    preloads no exporter, and its model, written into the kept export, loads to the next run's final weights."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    config = small_config("tracking.enabled=true", f"tracking.uri={uri}", "tracking.log_model=true")
    assert "flasync.tracking._model:warm_up" in tracked.preload(config)
    flasync.run(config)
    assert tracked.preload(config) == ("flasync.tracking._model",)
    assert len(list((tmp_path / "cache" / "flasync" / "model-exports").glob("*/export.json"))) == 1
    summary = flasync.run(config)
    client = mlflow.MlflowClient(uri)
    [logged] = client.search_logged_models(
        [client.get_run(summary.run_id).info.experiment_id], filter_string=f"source_run_id = '{summary.run_id}'"
    )
    assert str(logged.status) == "READY"
    assert {Path(a.path).name for a in client.list_logged_model_artifacts(logged.model_id, "data")} == {"model.pt2"}
    saved = torch.load(client.download_artifacts(summary.run_id, "weights.pt", str(tmp_path)), weights_only=True)
    model = flasync.training.models.MLP(64, [32], 10)
    model.load_state_dict(saved["state_dict"])
    x = torch.randn(2, 64)
    assert torch.allclose(mlflow.pytorch.load_model(logged.artifact_location)(x), model(x), atol=1e-6)


async def test_params_and_tags() -> None:
    """Params are the flattened config; tags name aggregator, mode, clock, seed and version."""
    tracker = MemoryTracker()
    await flasync.Federation(small_config("seed=7"), tracker=tracker).run()
    assert tracker.params["server.buffer_size"] == 4
    assert tracker.params["seed"] == 7
    assert tracker.tags["aggregator"] == "fedbuff"
    assert tracker.tags["mode"] == "async"
    assert tracker.tags["clock"] == "virtual"
    assert tracker.tags["seed"] == "7"
    assert tracker.tags["flasync.version"] == flasync.__version__


@pytest.mark.slow
async def test_runs_are_named_and_record_their_data_set() -> None:
    """A run without a name is named for what ran (aggregator, data, seed) plus a suffix telling reruns apart; its
    training data is a dataset input whose digest tells data sets apart and whose profile gives the sizes."""
    first, second, other = MemoryTracker(), MemoryTracker(), MemoryTracker()
    await flasync.Federation(small_config("seed=7"), tracker=first).run()
    await flasync.Federation(small_config("seed=7"), tracker=second).run()
    await flasync.Federation(small_config("seed=7", "data.test_fraction=0.3"), tracker=other).run()
    assert first.run_name is not None and second.run_name is not None
    assert re.fullmatch(r"fedbuff-digits-seed7-[0-9a-f]{6}", first.run_name)
    assert first.run_name != second.run_name
    (data,) = first.datasets
    assert data["name"] == "digits" and data["source"] == "sklearn.datasets.load_digits"
    assert data["context"] == "training"
    profile = data["profile"]
    assert (profile["features"], profile["classes"], profile["clients"]) == (64, 10, 20)
    assert profile["rows"] + profile["test_rows"] == 1797
    assert data["digest"] == second.datasets[0]["digest"] != other.datasets[0]["digest"]
    named = MemoryTracker()
    await flasync.Federation(small_config("tracking.run_name=mine"), tracker=named).run()
    assert named.run_name == "mine"


def test_injected_clock_is_used() -> None:
    """A clock passed to the Federation drives the run."""
    clock = VirtualClock(start=1000.0)
    flasync.run(small_config("stop.max_versions=2"), clock=clock)
    assert clock.now() > 1000.0 and clock.fired > 0


@pytest.mark.slow
async def test_standard_metrics_leave_out_the_per_update_details() -> None:
    """tracking.metrics = standard keeps the required per-update figures and the timings' per-version sums; all adds
    the details, every update's timings among them."""
    standard, full = MemoryTracker(), MemoryTracker()
    await flasync.Federation(small_config("tracking.log_level=debug"), tracker=standard).run()
    await flasync.Federation(small_config("tracking.log_level=debug", "tracking.metrics=all"), tracker=full).run()
    details = {
        "client/encode_s",
        "client/sim_train_s",
        "client/train_s",
        "server/update/decode_s",
        "server/update/queue_wait_s",
        "server/update/staleness_weight",
    }
    assert not details & set(standard.metric_keys())
    assert details <= set(full.metric_keys())
    required = {"client/loss", "client/samples", "server/update/staleness"}
    assert required <= set(standard.metric_keys())
    sums = {"profile/version/encode_s", "profile/version/compute_s", "profile/version/queue_wait_s"}
    assert sums <= set(standard.metric_keys())


# ---------------------------------------------------------------------------------------------- your own strategy


def _recording(size: int) -> tuple[list[MeanOfDeltas], Any]:
    built: list[MeanOfDeltas] = []

    def factory(weights: torch.Tensor, server: Any) -> MeanOfDeltas:
        built.append(MeanOfDeltas(weights, size))
        return built[-1]

    return built, factory


async def test_a_user_aggregator_steps_each_fedavg_round() -> None:
    """Under FedAvg rounds the rule gets each update (staleness 0, the round's base) and steps once a round."""
    built, factory = _recording(size=10**6)  # never ready: rounds do not ask
    config = small_config("stop.max_versions=4", server={"kind": "fedavg", "clients_per_round": 5})
    federation = flasync.Federation(config, aggregator=factory)
    summary = await federation.run()
    (rule,) = built
    assert summary.versions == 4 and rule.steps == [5, 5, 5, 5]
    assert all(staleness == 0 and samples > 0 and shaped for staleness, samples, shaped in rule.adds)
    assert all(rule.base_is_current)
    assert federation.weights is not None and not torch.equal(federation.weights, rule.initial)
    assert summary.weights_sha256 != (await flasync.Federation(config).run()).weights_sha256


async def test_a_user_aggregator_decides_when_async_slots_make_a_version() -> None:
    """Under FedBuff slots a version is made as soon as the rule says it is ready; staleness reaches it."""
    built, factory = _recording(size=3)
    summary = await flasync.Federation(small_config("stop.max_versions=6"), aggregator=factory).run()
    (rule,) = built
    assert summary.versions == 6 and rule.steps == [3] * 6
    assert max(staleness for staleness, _, _ in rule.adds) > 0


@pytest.mark.parametrize(
    "server",
    [
        {"kind": "fedavg", "clients_per_round": 5},
        {"kind": "fedbuff", "buffer_size": 3, "concurrency": 6},
        {"kind": "fedasync", "concurrency": 6},
    ],
    ids=["fedavg", "fedbuff", "fedasync"],
)
@pytest.mark.slow
def test_the_built_in_rule_passed_as_a_user_rule_gives_the_same_weights(server: dict[str, Any]) -> None:
    """make_aggregator passed as the factory reproduces the configured run bit for bit (the seam adds nothing)."""
    config = small_config(server=server)
    assert flasync.run(config, aggregator=make_aggregator).weights_sha256 == flasync.run(config).weights_sha256


@pytest.mark.slow
def test_a_custom_objective_changes_the_run_and_is_deterministic() -> None:
    """Focal loss ends at other weights than cross-entropy, the same ones twice; the run is tagged with it."""
    tracker = MemoryTracker()
    focal = flasync.run(small_config(), objective=Focal(), tracker=tracker).weights_sha256
    assert focal == flasync.run(small_config(), objective=Focal()).weights_sha256
    assert focal != flasync.run(small_config()).weights_sha256
    assert tracker.tags["objective"] == "Focal"


async def test_user_rules_are_tagged() -> None:
    """The run's tags name the aggregator factory; the config's kind stays the aggregator tag."""
    tracker = MemoryTracker()
    _, factory = _recording(size=4)
    await flasync.Federation(small_config("stop.max_versions=2"), aggregator=factory, tracker=tracker).run()
    assert tracker.tags["aggregator"] == "fedbuff"
    assert tracker.tags["aggregator.custom"].endswith("factory")
    assert "objective" not in tracker.tags


def test_a_factory_returning_something_else_is_a_config_error() -> None:
    """An aggregator lacking members of the protocol is a ConfigError naming what is missing."""
    missing = r"the object that aggregator .*<lambda> returned lacks add, add_partial, .* flasync\.Aggregator"
    with pytest.raises(ConfigError, match=missing):
        flasync.run(small_config(), aggregator=lambda weights, server: object())


def test_an_objective_without_loss_is_a_config_error() -> None:
    """An objective with no loss method is refused when the federation is built."""
    with pytest.raises(ConfigError, match="objective object needs a loss"):
        flasync.Federation(small_config(), objective=object())  # type: ignore[arg-type]


def test_the_final_figures_hold_the_profile_figures() -> None:
    """The finished.alerts tag (and peak memory) is set after the profile counted them, equal to the summary's; the
    final figures are tags, not one-point metrics."""
    config = small_config("server.optimizer.lr=30", "stop.max_versions=6", "diagnostics.profile=true")
    tracker = MemoryTracker()
    summary = flasync.run(config, tracker=tracker)
    assert summary.alerts > 0
    assert tracker.tags["finished.alerts"] == str(summary.alerts)
    assert tracker.tags["finished.peak_rss_bytes"] == str(summary.peak_rss_bytes)
    assert float(tracker.tags["finished.accuracy"]) == summary.accuracy
    assert tracker.tags["finished.versions"] == str(summary.versions)
    assert not [row for row in tracker.metrics if row.key.startswith("run/finished")]


async def test_tags_given_to_a_federation_join_its_own() -> None:
    """``Federation(tags=...)`` adds tags to the new run's own (a sweep child's ``mlflow.parentRunId``)."""
    tracker = MemoryTracker()
    await flasync.Federation(small_config(), tracker=tracker, tags={"mlflow.parentRunId": "p1"}).run()
    assert tracker.tags["mlflow.parentRunId"] == "p1"
    assert tracker.tags["aggregator"] == "fedbuff"
