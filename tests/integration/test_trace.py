"""Trace-driven runs: a device trace's windows decide who trains when, its speeds how long, the same way each run."""

from __future__ import annotations

from pathlib import Path

import pytest

import flasync
from flasync.cli import main
from flasync.clients.simulated.trace import TraceWindows, read_trace, synthetic_trace, write_trace
from flasync.core.events import ClientFailed, TaskAssigned, UpdateReceived, UpdateUploaded
from flasync.testing import EventRecorder, small_config


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    """A synthetic trace of 20 clients, each online about 40% of a 60 s cycle in a few sessions."""
    path = tmp_path / "devices.csv"
    write_trace(synthetic_trace(20, horizon_s=60.0, online_fraction=0.4, seed=1), path)
    return path


@pytest.mark.parametrize("server", ["fedbuff", "fedavg"])
async def test_no_task_starts_while_its_client_is_offline(trace_file: Path, server: str) -> None:
    """Every task starts inside its client's window; tasks cut short fail "offline" when the window closes."""
    sections = {"server": {"kind": "fedavg", "clients_per_round": 5}} if server == "fedavg" else {}
    config = small_config(f"population.trace={trace_file}", "population.speed.seconds_per_step=0.2", **sections)
    windows = TraceWindows(read_trace(trace_file), config.population.num_clients)
    federation = flasync.Federation(config)
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    assert summary.versions == 12
    tasks = recorder.of(TaskAssigned)
    assert tasks
    for task in tasks:
        assert windows.online(task.client_id, task.simulated_s), (task.client_id, task.simulated_s)
    failed = recorder.of(ClientFailed)
    assert failed and {e.kind for e in failed} == {"offline"}  # some sessions end before their task does
    for event in failed:
        assert windows.offline_at(event.client_id, event.simulated_s - 1e-9) == pytest.approx(event.simulated_s)
    for update in recorder.of(UpdateReceived):  # an accepted update was uploaded before its window closed
        assert update.simulated_s <= windows.offline_at(update.client_id, update.simulated_s - 1e-9) + 1e-9


async def test_trace_speeds_set_the_training_times(tmp_path: Path) -> None:
    """With constant speed and always-online clients, a client of speed 4 trains in a quarter of speed 1's time."""
    path = tmp_path / "speeds.csv"
    path.write_text("client,speed,online\n" + "".join(f"{k},{4 if k % 2 else 1}," + "\n" for k in range(20)))
    population = {"num_clients": 20, "trace": str(path), "speed": {"kind": "constant", "seconds_per_step": 1.0}}
    config = small_config(
        "network.latency_s=0",
        "network.upload_bytes_per_s=inf",
        "network.download_bytes_per_s=inf",
        population=population,
    )
    federation = flasync.Federation(config)
    recorder = EventRecorder(federation.bus)
    await federation.run()
    started = {e.task_id: e for e in recorder.of(TaskAssigned)}
    steps = -(-72 // 16) * 2  # 72 samples per client, batches of 16, 2 epochs
    for update in recorder.of(UpdateReceived):
        task = started[update.task_id]
        expected = steps * (0.25 if task.client_id % 2 else 1.0)
        assert update.simulated_s - task.simulated_s == pytest.approx(expected)


async def test_trace_links_set_the_transfer_times(tmp_path: Path) -> None:
    """A trace's bandwidths time each client's download and upload: bytes / bandwidth (no latency here)."""
    path = tmp_path / "links.csv"
    rows = "".join(f"{k},1,,{1e5 if k % 2 else 4e5},{2e5 if k % 2 else 8e5}\n" for k in range(20))
    path.write_text("client,speed,online,upload_bytes_per_s,download_bytes_per_s\n" + rows)
    population = {"num_clients": 20, "trace": str(path), "speed": {"kind": "constant"}}
    config = small_config("network.latency_s=0", population=population)
    federation = flasync.Federation(config)
    recorder = EventRecorder(federation.bus)
    await federation.run()
    uploads = recorder.of(UpdateUploaded)
    assert uploads
    for upload in uploads:
        up, down = (1e5, 2e5) if upload.client_id % 2 else (4e5, 8e5)
        assert upload.sim_upload_s == pytest.approx(upload.upload_bytes / up)
        assert upload.sim_download_s == pytest.approx(upload.download_bytes / down)


@pytest.mark.slow
def test_trace_runs_are_bit_identical(trace_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two runs of the same trace and seed print the same weights digest; another trace gives another."""
    argv = ["run", "--no-tracking", "--set", "population.num_clients=20", "--set", "stop.max_versions=8"]
    digests = []
    for trace in (trace_file, trace_file, trace_file.with_name("other.csv")):
        if not trace.exists():
            write_trace(synthetic_trace(20, horizon_s=60.0, online_fraction=0.4, seed=2), trace)
        assert main([*argv, "--set", f"population.trace={trace}", "--set", "server.concurrency=8"]) == 0
        out = capsys.readouterr().out
        digests.append(next(line for line in out.splitlines() if "sha256" in line))
    assert digests[0] == digests[1]
    assert digests[0] != digests[2]


@pytest.mark.slow
async def test_a_trace_run_resumes_exactly(trace_file: Path) -> None:
    """Stopped mid-way and resumed from its checkpoint, a trace-driven run ends with the uninterrupted weights."""
    from tests.integration.test_checkpoint import _resumes_exactly

    config = small_config(
        f"population.trace={trace_file}", "population.speed.seconds_per_step=0.2", "stop.max_versions=14"
    )
    fields = ("tasks_dispatched", "updates_accepted", "updates_failed", "simulated_s")
    full, _ = await _resumes_exactly(config, 5, fields)
    assert full.updates_failed > 0  # windows closed on some tasks, before and after the checkpoint
