"""The Ray executor against the threads: the same weights, actors that die, a cluster that cannot be reached.

A local Ray (2 CPUs, no dashboard) is started once for the module; flasync then uses it and leaves it running. The
tests of a Ray that flasync starts itself run the CLI in a subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import flasync
from flasync.core.events import Aggregated
from flasync.testing import small_config

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

SERVERS = {
    "fedavg": {"kind": "fedavg", "clients_per_round": 5},
    "fedbuff": {"kind": "fedbuff", "buffer_size": 4, "concurrency": 8},
}


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A local Ray for the module's in-process runs."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def _ray_processes() -> set[int]:
    out = subprocess.run(["ps", "-eo", "pid=,comm="], capture_output=True, text=True, check=True).stdout
    names = ("raylet", "gcs_server", "ray::")
    return {int(line.split()[0]) for line in out.splitlines() if any(n in line for n in names)}


@pytest.mark.usefixtures("local_ray")
@pytest.mark.parametrize("actors", [1, 2])
@pytest.mark.parametrize("server", sorted(SERVERS))
def test_ray_gives_the_threads_weights(server: str, actors: int) -> None:
    """FedAvg and FedBuff on 1 or 2 actors end with the threads executor's weights_sha256."""
    threads = flasync.run(small_config("executor.kind=thread", server=SERVERS[server]))
    on_ray = flasync.run(small_config("executor.kind=ray", f"executor.ray.actors={actors}", server=SERVERS[server]))
    assert on_ray.weights_sha256 == threads.weights_sha256
    assert on_ray.updates_accepted == threads.updates_accepted


@pytest.mark.usefixtures("local_ray")
@pytest.mark.parametrize("inline", [True, False])
def test_model_versions_travel_inside_the_tasks_or_through_the_object_store(
    monkeypatch: pytest.MonkeyPatch, inline: bool
) -> None:
    """A small model's versions go inside the tasks and nothing of them is put (a put to a store that dies ends the
    process); above the inline size each version is put once. The threads' weights either way."""
    import numpy as np

    from flasync.training.executors import ray as ray_executor

    if not inline:
        monkeypatch.setattr(ray_executor, "_INLINE_BYTES", 0)
    put = ray.put
    versions_put: list[tuple[int, ...]] = []

    def counted(value: object, **kwargs: object) -> object:
        if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype == np.float32:
            versions_put.append(value.shape)
        return put(value, **kwargs)

    monkeypatch.setattr(ray, "put", counted)
    server = SERVERS["fedbuff"]
    threads = flasync.run(small_config("executor.kind=thread", server=server))
    on_ray = flasync.run(small_config("executor.kind=ray", server=server))
    assert on_ray.weights_sha256 == threads.weights_sha256
    if inline:
        assert versions_put == []
    else:
        assert 2 <= len(versions_put) <= on_ray.versions + 1  # once per version a task started from


@pytest.mark.usefixtures("local_ray")
def test_scaffold_corrections_travel_to_the_actors() -> None:
    """SCAFFOLD on Ray: each task's c - c_i reaches its actor, so the weights are the threads' ones."""
    overrides = ("scaffold.enabled=true", "stop.max_versions=6")
    threads = flasync.run(small_config(*overrides, "executor.kind=thread"))
    assert flasync.run(small_config(*overrides, "executor.kind=ray")).weights_sha256 == threads.weights_sha256


@pytest.mark.usefixtures("local_ray")
def test_cohorts_inside_actors_give_the_vectorized_weights() -> None:
    """executor.ray.vectorized trains each version's clients as one cohort per actor call: the vectorized weights."""
    vectorized = flasync.run(small_config("executor.kind=vectorized", "stop.max_versions=6"))
    on_ray = flasync.run(small_config("executor.kind=ray", "executor.ray.vectorized=true", "stop.max_versions=6"))
    assert on_ray.weights_sha256 == vectorized.weights_sha256


@pytest.mark.usefixtures("local_ray")
async def test_an_actor_killed_mid_run_fails_its_task_and_is_replaced() -> None:
    """Killing an actor fails the task it held as a client failure; a new actor takes over and the run finishes."""
    config = small_config("executor.kind=ray", "executor.ray.actors=2", "stop.max_versions=12")
    federation = flasync.Federation(config)
    aggregated = federation.bus.subscribe(Aggregated, policy="drop_oldest")
    run = asyncio.create_task(federation.run())
    killed: list[str] = []
    async for event in aggregated:
        if event.version >= 3:
            victim = _train_actors()[0]
            ray.kill(ray.get_actor(victim))
            killed.append(victim)
            break
    summary = await run
    assert killed
    assert summary.versions == 12
    assert summary.updates_failed >= 1


def _train_actors() -> list[str]:
    """The names of flasync's training actors alive in the local Ray."""
    names = [n["name"] if isinstance(n, dict) else n for n in ray.util.list_named_actors()]
    return sorted(n for n in names if n.startswith("flasync-train-"))


@pytest.mark.usefixtures("local_ray")
def test_a_runs_actors_start_side_by_side_and_all_are_killed_if_one_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every actor is asked for before the executor waits for the first (they load at once); when one of them cannot
    start, the run fails with its one-line error and none of its actors is left."""
    from flasync.training.executors import ray as ray_executor

    node_of = ray_executor.RayTrainingExecutor._node_of
    asked_when_waiting: list[int] = []

    def this_runs() -> set[str]:  # an earlier test's actors may still be going away meanwhile
        return set(_train_actors()) - before

    def waited(self: ray_executor.RayTrainingExecutor, actor: object) -> str:
        asked_when_waiting.append(len(this_runs()))
        if len(asked_when_waiting) == 2:
            raise flasync.ConfigError("executor.ray: an actor could not start: a test's")
        return node_of(self, actor)

    monkeypatch.setattr(ray_executor.RayTrainingExecutor, "_node_of", waited)
    before = set(_train_actors())
    with pytest.raises(flasync.ConfigError, match="a test's"):
        flasync.run(small_config("executor.kind=ray", "executor.ray.actors=3"))
    assert asked_when_waiting[0] == 3
    deadline = time.monotonic() + 30
    while this_runs() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not this_runs()


def _env() -> dict[str, str]:
    """This process's environment, with this checkout of flasync first on ``PYTHONPATH``."""
    root = str(Path(flasync.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}


def _cli(*args: str, cwd: Path, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    env = _env()
    return subprocess.run(
        [sys.executable, "-m", "flasync", "run", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def test_an_unreachable_cluster_is_one_line_before_any_mlflow_run(tmp_path: Path) -> None:
    """A closed port: exit 2, one error line naming executor.ray.address, and the store holds no run."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = _cli(
        "--set",
        "executor.kind=ray",
        "--set",
        "executor.ray.address=127.0.0.1:9",
        "--set",
        "executor.ray.connect_timeout_s=2",
        "--tracking-uri",
        store,
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("flasync: error:")]
    assert len(errors) == 1 and "executor.ray.address" in errors[0]
    import mlflow

    runs = mlflow.MlflowClient(store).search_runs(
        [e.experiment_id for e in mlflow.MlflowClient(store).search_experiments()]
    )
    assert runs == []


def test_the_ray_a_run_starts_is_gone_after_it(tmp_path: Path) -> None:
    """A run that started its own Ray leaves no Ray process behind (of those its process tree held while it ran:
    another test's Ray may run beside it)."""
    import psutil

    settings = ["--no-tracking", "--set", "executor.kind=ray", "--set", "stop.max_versions=5"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "flasync", "run", *settings],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    started: dict[int, psutil.Process] = {}
    try:
        while proc.poll() is None:  # who the run starts, seen while it runs
            with contextlib.suppress(psutil.Error):
                started.update((c.pid, c) for c in psutil.Process(proc.pid).children(recursive=True))
            time.sleep(0.25)  # a Ray process lives for seconds: a few looks catch it, without taking a core
    finally:
        stdout, stderr = proc.communicate(timeout=150)
    assert proc.returncode == 0, stderr[-2000:]
    assert "weights sha256" in stdout
    assert started, "the run started no process of its own (no local Ray?)"
    left = [pid for pid, child in started.items() if child.is_running() and child.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes of the run still alive: {left}"


@pytest.mark.usefixtures("local_ray")
def test_a_ray_run_resumes_from_its_checkpoint_to_the_uninterrupted_weights() -> None:
    """Periodic checkpoints of a Ray run resume (on Ray) to the weights the whole run ends with."""
    from flasync.runtime import checkpoint
    from flasync.testing import MemoryTracker

    config = small_config("executor.kind=ray", "stop.max_versions=10", "checkpoint.every_versions=4")
    tracker = MemoryTracker()
    full = flasync.run(config, tracker=tracker)
    saved, state = checkpoint.decode(checkpoint.latest(tracker.artifacts))
    assert state["version"] == 8
    resumed = flasync.run(saved, resume=checkpoint.ResumePoint(None, state))
    assert resumed.weights_sha256 == full.weights_sha256


def test_ctrl_c_leaves_no_ray_behind(tmp_path: Path) -> None:
    """SIGINT during a run that started its own Ray: exit 130, and every Ray process it started is gone (those of
    the run's process tree when the signal is sent: another test's Ray may run beside it)."""
    import psutil

    env = _env()
    settings = ["executor.kind=ray", "stop.max_versions=100000", "eval.every_versions=1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "flasync", "run", "--no-tracking", *(f"--set={s}" for s in settings)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # training has started once the first evaluation is printed
        if "server.eval" in line:
            break
    started = {child.pid: child for child in psutil.Process(proc.pid).children(recursive=True)}
    assert started.keys() & _ray_processes(), "the run's Ray processes were not found"
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, output[-2000:]
    left = [pid for pid, child in started.items() if child.is_running() and child.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes of the run still alive: {left}"


def test_a_lost_ray_cluster_stops_the_run_with_one_line(tmp_path: Path) -> None:
    """SIGKILL of the run's own GCS and raylet once training has started: one line names the cluster gone, the
    partial summary is printed, the exit status is 1 and the MLflow run is KILLED or FAILED (not left RUNNING)."""
    import mlflow
    import psutil

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    settings = ["executor.kind=ray", "stop.max_versions=100000", "eval.every_versions=1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "flasync", "run", "--tracking-uri", store, "--no-system-metrics"]
        + [f"--set={s}" for s in settings],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # training has started once a version past the first is evaluated
        seen.append(line)
        if "server.eval" in line and "version=0/" not in line:
            break
    cluster = [
        child
        for child in psutil.Process(proc.pid).children(recursive=True)  # this run's Ray, not another test's
        if child.name() in ("gcs_server", "raylet")
    ]
    assert len(cluster) == 2, f"the run's GCS and raylet were not found: {cluster}"
    for child in cluster:
        child.kill()
    output = "".join(seen) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 1, output[-3000:]
    gone = [line for line in output.splitlines() if "the Ray cluster at" in line and "is gone" in line]
    assert len(gone) == 1, output[-3000:]
    assert "flasync run stopped (Ray cluster gone) at version" in output
    client = mlflow.MlflowClient(store)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status in ("KILLED", "FAILED")
    assert f"resume with: python -m flasync run --resume {run.info.run_id}" in output  # its checkpoint was written


@pytest.mark.usefixtures("local_ray")
def test_a_lazy_population_ships_client_ids_not_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    """Actors draw a lazy client's samples from its seed: no data goes through the object store, same weights."""
    from flasync.training.executors.ray import RayTrainingExecutor

    overrides = ("data={kind: synthetic, lazy: true}", "population.num_clients=100000", "stop.max_versions=4")
    threads = flasync.run(small_config(*overrides, "executor.kind=thread"))

    def no_data(*args: object) -> None:
        raise AssertionError("a lazy client's samples were shipped")

    monkeypatch.setattr(RayTrainingExecutor, "_data_ref", no_data)
    on_ray = flasync.run(small_config(*overrides, "executor.kind=ray"))
    assert on_ray.updates_failed == 0
    assert on_ray.weights_sha256 == threads.weights_sha256


def test_gpus_asked_for_on_a_machine_without_any_is_one_line(tmp_path: Path) -> None:
    """A local Ray cannot give actors GPUs this machine lacks: refused before Ray starts, exit 2, one line."""
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = _cli("--no-tracking", "--set", "executor.kind=ray", "--set", "executor.ray.gpus_per_actor=1", cwd=tmp_path)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("flasync: error:")]
    assert len(errors) == 1 and "executor.ray.gpus_per_actor" in errors[0]
