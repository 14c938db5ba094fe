"""The command line: bad input exits 2 with one line, the default experiment runs and lands in MLflow."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import yaml

from flasync.cli import main
from flasync.config import load_config
from flasync.tracking._child import IDLE, close_idle_writer


def _fails(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the CLI in-process, expect exit status 2 and return its one-line error."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    # Apart from the progress lines saying which phase the run reached, one line: the error.
    lines = [line for line in err.strip().splitlines() if " run.phase " not in line]
    assert len(lines) == 1, err
    assert lines[0].startswith("flasync: error: ")
    return lines[0]


def _runs(uri: str) -> list[mlflow.entities.Run]:
    db = Path(uri.removeprefix("sqlite:///"))
    if not db.exists():
        return []
    client = mlflow.MlflowClient(uri)
    return [run for exp in client.search_experiments() for run in client.search_runs([exp.experiment_id])]


def test_missing_file(capsys: pytest.CaptureFixture[str], store: str) -> None:
    """A missing config file exits 2 naming it."""
    assert "config file not found: nope.toml" in _fails(capsys, "run", "nope.toml", "--tracking-uri", store)
    assert _runs(store) == []


def test_unparsable_toml(capsys: pytest.CaptureFixture[str], store: str, tmp_path: Path) -> None:
    """A TOML syntax error exits 2."""
    (tmp_path / "bad.toml").write_text("seed = = 1\n")
    assert "invalid TOML" in _fails(capsys, "run", "bad.toml", "--tracking-uri", store)


def test_unparsable_yaml(capsys: pytest.CaptureFixture[str], store: str, tmp_path: Path) -> None:
    """A YAML syntax error exits 2."""
    (tmp_path / "bad.yaml").write_text("server: {kind: fedbuff\n")
    assert "invalid YAML" in _fails(capsys, "run", "bad.yaml", "--tracking-uri", store)


def test_unknown_key_in_file(capsys: pytest.CaptureFixture[str], store: str, tmp_path: Path) -> None:
    """An unknown key in a file exits 2 naming the dotted field."""
    (tmp_path / "c.toml").write_text("[server]\nkind = 'fedbuff'\nbuffersize = 3\n")
    said = _fails(capsys, "run", "c.toml", "--tracking-uri", store)
    assert said.endswith("server.buffersize: unknown field (did you mean buffer_size?)")


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("client.lr=fast", "client.lr: Input should be a valid number"),
        ("client.lr=-1", "client.lr: Input should be greater than 0"),
        ("server.kind=fedsgd", "server: unknown kind 'fedsgd'"),
        ("server.concurrency=500", "server.concurrency: must be <= population.num_clients (100), got 500"),
        ("clientlr", "--set 'clientlr': expected path.to.field=value"),
        ("client..lr=1", "is not a dotted field path"),
    ],
)
def test_bad_set(capsys: pytest.CaptureFixture[str], store: str, override: str, expected: str) -> None:
    """A bad --set (wrong type, out of range, unknown kind, cross-field, malformed) exits 2 naming the field."""
    assert expected in _fails(capsys, "run", "--set", override, "--tracking-uri", store)
    assert _runs(store) == []


def test_unknown_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown flag exits 2 with one line."""
    assert "unrecognized arguments: --fast" in _fails(capsys, "run", "--fast")


@pytest.mark.slow
def test_bad_data_leaves_no_run(capsys: pytest.CaptureFixture[str], store: str) -> None:
    """More clients than samples exits 2 before any MLflow run exists."""
    message = _fails(capsys, "run", "--set", "population.num_clients=5000", "--tracking-uri", store)
    assert "5000" in message
    assert all(run.info.status != "RUNNING" for run in _runs(store))
    # The MLflow writer process started beside the data loading is gone, or kept idle for the next run.
    kept = IDLE.child
    assert set(_writer_processes()) <= ({kept.pid} if kept is not None else set())
    close_idle_writer()
    assert _writer_processes() == []


def _writer_processes() -> list[int]:
    """Return the pids of this process's live MLflow writer children (Linux's /proc; empty elsewhere)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"flasync.tracking._child" in cmdline:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
def test_no_tracking_never_imports_mlflow() -> None:
    """Importing flasync and running with tracking off does not load MLflow (over a second of imports)."""
    code = (
        "import sys, flasync, flasync.testing\n"
        "assert 'mlflow' not in sys.modules, 'import'\n"
        "flasync.run(flasync.testing.small_config('stop.max_versions=1', 'diagnostics.plots=false'))\n"
        "assert 'mlflow' not in sys.modules, 'run'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


_IDLE_POOL = """
import atexit, sys, threading
from concurrent.futures import ThreadPoolExecutor
import flasync.cli
import flasync.cli.program


class Repository:  # kept alive by a reference cycle, as MLflow's artifact repository can be
    def __init__(self):
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="repository")
        self.me = self


def command(argv=None, *, process_ends=False):
    repository = Repository()
    repository.pool.submit(print, "work done").result()
    done = threading.Thread(target=lambda: print("a thread of the command finished"))
    done.start()
    atexit.register(print, "atexit ran")
    return 3


flasync.cli.program.main = command
flasync.cli.console()
"""


@pytest.mark.slow
def test_the_command_line_ends_with_an_idle_thread_pool_left_alive() -> None:
    """console() ends as a normal exit would: an idle thread pool the command left alive (a reference cycle keeps
    it) does not keep the process waiting, the command's threads finish, atexit handlers run, the status is kept."""
    done = subprocess.run([sys.executable, "-c", _IDLE_POOL], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 3, done.stderr
    assert done.stdout.splitlines() == ["work done", "a thread of the command finished", "atexit ran"]


def test_print_config_round_trips(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--print-config prints YAML that loads back into the same config."""
    assert main(["run", "--print-config", "--set", "server.buffer_size=7", "--no-system-metrics"]) == 0
    printed = capsys.readouterr().out
    (tmp_path / "resolved.yaml").write_text(printed)
    resolved = load_config(tmp_path / "resolved.yaml")
    assert resolved == load_config(None, ["server.buffer_size=7"])
    assert yaml.safe_load(printed)["server"]["buffer_size"] == 7


@pytest.mark.parametrize("users", [None, "true"])
def test_a_command_draws_no_mlflow_download_bars_unless_the_user_asks(
    monkeypatch: pytest.MonkeyPatch, users: str | None
) -> None:
    """MLflow's artifact progress bars are off while a command runs (a resume's checkpoint, a report's profile would
    print them among flasync's lines), and the variable is as before afterwards; a user's own setting is kept."""
    name = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    if users is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, users)
    seen: list[str | None] = []

    def command(args: object) -> int:
        from mlflow.environment_variables import MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR

        seen.append(os.environ.get(name))
        return 0 if MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.get() == (users is not None) else 1

    monkeypatch.setattr("flasync.cli.report.command_report", command)
    assert main(["report", "some-run"]) == 0
    assert seen == ["false" if users is None else users]
    assert os.environ.get(name) == users


def test_help_lists_run(capsys: pytest.CaptureFixture[str]) -> None:
    """--help exits 0 and lists the run command."""
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    assert "run" in capsys.readouterr().out


def _run_in(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m flasync run ARGS` in ``folder`` with the default store (no MLflow variables); must succeed."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_LOGGING_LEVEL")}
    done = subprocess.run(
        [sys.executable, "-m", "flasync", "run", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_default_experiment_end_to_end(tmp_path: Path) -> None:
    """`python -m flasync run` with no arguments reaches 0.90 and logs to sqlite:///mlruns/mlflow.db."""
    done = _run_in(tmp_path)
    assert "flasync run finished" in done.stdout
    assert "mlflow ui --backend-store-uri sqlite:///" in done.stdout
    assert "server.eval" in done.stderr  # progress lines while it runs
    assert "Creating initial MLflow database tables" not in done.stderr  # MLflow's info lines are not flasync's
    console = done.stderr.splitlines()
    assert "run.phase" in console[0] and "loading flasync and torch" in console[0]
    assert max(len(line) for line in console) <= 120, max(console, key=len)
    assert not re.search(r"\d\.\d{8,}", done.stderr)  # floats rounded (to 4 significant digits)
    assert len(re.findall(r"run_id=", done.stderr)) == 1  # the run id once
    time_line = r"time +wall \d+\.\d\d s, simulated [\d.]+ s \(virtual clock\), first update 0\.\d{3} s"
    assert re.search(time_line, done.stdout)
    assert re.search(r"server\.eval +version=150/150 accuracy=0\.9\d*", done.stderr)
    uri = f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"
    (run,) = _runs(uri)
    assert run.info.status == "FINISHED"
    assert re.fullmatch(r"fedbuff-digits-seed0-[0-9a-f]{6}", run.info.run_name)
    assert mlflow.MlflowClient(uri).get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == (
        "custom_model_development"
    )
    assert run.data.tags["mlflow.source.type"] == "LOCAL" and run.data.tags["mlflow.user"]
    assert [entry.dataset.name for entry in run.inputs.dataset_inputs] == ["digits"]
    assert run.data.params["server.kind"] == "fedbuff"
    assert run.data.tags["aggregator"] == "fedbuff"
    client = mlflow.MlflowClient(uri)
    summary = json.loads(Path(client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path))).read_text())
    assert summary["accuracy"] >= 0.90
    assert summary["versions"] == 150
    assert run.data.metrics["server/eval/accuracy"] == pytest.approx(summary["accuracy"])
    history = client.get_metric_history(run.info.run_id, "client/loss")
    # One point per trained task: every accepted update, plus tasks still uploading when the run stopped.
    assert summary["updates_accepted"] <= len(history) <= summary["tasks_dispatched"]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"summary.json", "config.yaml", "weights.pt"} <= artifacts
    artifact_root = Path(run.info.artifact_uri.removeprefix("file://"))
    assert artifact_root.is_relative_to(tmp_path / "mlruns")


def test_print_config_says_what_the_weights_depend_on(capsys: pytest.CaptureFixture[str]) -> None:
    """--print-config starts with comments naming threads_per_worker, the torch build and the CPU kernels."""
    import torch
    import yaml

    assert main(["run", "--print-config", "--set", "executor.threads_per_worker=2"]) == 0
    out = capsys.readouterr().out
    head = [line for line in out.splitlines() if line.startswith("#")]
    assert any("executor.threads_per_worker = 2" in line for line in head)
    assert any(torch.__version__ in line for line in head)
    assert any(str(torch.backends.cpu.get_cpu_capability()) in line for line in head)
    assert yaml.safe_load(out)["executor"]["threads_per_worker"] == 2  # still valid YAML


def test_intra_op_threads_change_the_weights_and_workers_do_not() -> None:
    """What the note says is true: threads_per_worker changes weights_sha256, workers does not."""
    import flasync
    from flasync.testing import small_config

    # Kernels split their work across threads only above a size that depends on the CPU's kernels: on AVX-512
    # machines a batch of 16 through a 32-wide layer is not split (the weights would not change), 256 through 1024 is.
    run = ("stop.max_versions=2", "model.hidden=[1024]", "client.batch_size=256")
    base = flasync.run(small_config(*run)).weights_sha256
    assert flasync.run(small_config(*run, "executor.workers=2")).weights_sha256 == base
    two_threads = flasync.run(small_config(*run, "executor.threads_per_worker=2")).weights_sha256
    assert two_threads != base


@pytest.mark.slow
def test_log_level_governs_the_libraries_logs_too(tmp_path: Path) -> None:
    """`--log-level warning` on a new store: no info line from flasync or MLflow reaches stderr."""
    done = _run_in(tmp_path, "--log-level", "warning", "--set", "stop.max_versions=2")
    assert (tmp_path / "mlruns" / "mlflow.db").is_file()
    assert " INFO " not in done.stderr and "[info" not in done.stderr, done.stderr


def _interrupted(folder: Path, *args: str) -> tuple[int, str, str]:
    """Start `flasync run ARGS` on the wall clock, Ctrl-C its process group once version 4 was evaluated; return
    its exit status, standard output and standard error (with the log lines)."""
    (folder / "cfg.yaml").write_text(
        "data: {kind: digits}\nmodel: {kind: mlp, hidden: [32]}\npopulation: {num_clients: 20}\n"
        "server: {kind: fedbuff, buffer_size: 4, concurrency: 8}\neval: {every_versions: 2}\n"
        "stop: {max_versions: 100000}\nclock: wall\ntracking: {log_model: false}\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "flasync", "run", "cfg.yaml", "--log-level", "info", *args],
        cwd=folder,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert process.stderr is not None
    lines: list[str] = []
    for line in process.stderr:
        lines.append(line)
        if "server.eval" in line and re.search(r"\bversion=([4-9]|\d\d+)\b", line):
            os.killpg(process.pid, signal.SIGINT)  # as Ctrl-C in a terminal
            break
    out, err = process.communicate(timeout=120)
    return process.returncode, out, "".join(lines) + err


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ctrl_c_without_tracking_prints_the_partial_summary_and_no_mlflow(tmp_path: Path) -> None:
    """Ctrl-C of `run --no-tracking`: exit 130, the partial summary printed once, and no word of MLflow or of a
    checkpoint that was never written."""
    status, out, err = _interrupted(tmp_path, "--no-tracking")
    assert status == 130, err[-3000:]
    partial = [line for line in out.splitlines() if line.startswith("flasync run stopped")]
    assert len(partial) == 1, out
    assert re.fullmatch(
        r"flasync run stopped \(SIGINT\) at version \d+: accuracy 0\.\d{4}, loss \d+\.\d{4}; \d+ updates accepted, "
        r"\d+ dropped, \d+ failed; wall \d+\.\d s",
        partial[0],
    ), partial[0]
    assert "flasync: SIGINT received; stopping (tracking is off: no checkpoint)" in err
    assert err.strip().splitlines()[-1] == "flasync: interrupted (SIGINT)"
    assert "MLflow" not in out + err and "mlflow" not in out + err


@pytest.mark.slow
def test_mark_failed_says_whether_a_run_can_be_resumed(
    capsys: pytest.CaptureFixture[str], store: str, tmp_path: Path
) -> None:
    """A RUNNING run whose process is gone is marked FAILED; the line suggests --resume only for a run that wrote a
    checkpoint (before: it did for every run)."""
    import socket

    import psutil

    from flasync.core.owner import HOST_TAG, PID_TAG, STARTED_TAG

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = {HOST_TAG: socket.gethostname(), PID_TAG: dead.stdout.strip(), STARTED_TAG: f"{psutil.boot_time():.3f}"}
    client = mlflow.MlflowClient(store)
    experiment = client.create_experiment("gone", artifact_location=(tmp_path / "artifacts").as_uri())
    bare = client.create_run(experiment, tags=gone).info.run_id
    saved = client.create_run(experiment, tags=gone).info.run_id
    (tmp_path / "a.pt").write_bytes(b"checkpoint")
    client.log_artifact(saved, str(tmp_path / "a.pt"), "checkpoints")
    assert main(["tracking", "mark-failed", "--tracking-uri", store]) == 0
    out = capsys.readouterr().out
    assert f"{bare}  FAILED (its process is gone; it wrote no checkpoint, so it cannot be resumed)" in out
    assert f"{saved}  FAILED (its process is gone; resume it with: flasync run --resume {saved})" in out
    assert {client.get_run(run).info.status for run in (bare, saved)} == {"FAILED"}


@pytest.mark.slow
def test_tracking_ui_prints_the_training_runs_address(
    capsys: pytest.CaptureFixture[str], store: str, tmp_path: Path
) -> None:
    """``flasync tracking ui`` prints the UI command and the experiment's Training runs address, with flasync's runs
    view where the experiment has it; an unknown experiment is a one-line error, exit 2."""
    from flasync.tracking._runs import RUNS_VIEW_TAG

    client = mlflow.MlflowClient(store)
    viewed = client.create_experiment("viewed", artifact_location=(tmp_path / "a").as_uri())
    client.set_experiment_tag(viewed, RUNS_VIEW_TAG, "{}")
    plain = client.create_experiment("plain", artifact_location=(tmp_path / "b").as_uri())
    assert main(["tracking", "ui", "--experiment", "viewed", "--tracking-uri", store]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"open the UI     mlflow ui --backend-store-uri {store}",
        f"then browse     http://127.0.0.1:5000/#/experiments/{viewed}/runs?workflowType=machine_learning"
        "&viewStateShareKey=flasync",
    ]
    assert main(["tracking", "ui", "--experiment", "plain", "--tracking-uri", store, "--base", "http://h:80/"]) == 0
    expected = f"then browse     http://h:80/#/experiments/{plain}/runs?workflowType=machine_learning"
    assert capsys.readouterr().out.splitlines()[-1] == expected
    error = _fails(capsys, "tracking", "ui", "--experiment", "absent", "--tracking-uri", store)
    assert error.startswith("flasync: error: no experiment 'absent' in the store (it has: ")
