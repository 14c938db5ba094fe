"""Bad input at every boundary: one line on stderr, exit status 2, and no MLflow run left RUNNING."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
import torch

import flasync.data.prepare
import flasync.runtime.federation
import flasync.runtime.prepare
from flasync import tracking
from flasync.cli import main
from flasync.data import ArrayData
from flasync.runtime import checkpoint
from flasync.testing import MemoryTracker, small_config


def _statuses(uri: str) -> list[str]:
    if not Path(uri.removeprefix("sqlite:///")).exists():
        return []
    client = mlflow.MlflowClient(uri)
    return [r.info.status for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]


def _fails(capsys: pytest.CaptureFixture[str], store: str, *argv: str) -> str:
    """Run the CLI in-process: exit 2, one error line on stderr (besides phase lines), nothing RUNNING in the store."""
    status = main([*argv, "--tracking-uri", store] if argv and argv[0] == "run" else list(argv))
    err = capsys.readouterr().err
    assert status == 2, err
    # Apart from the progress lines saying which phase the run reached, one line: the error.
    lines = [line for line in err.strip().splitlines() if " run.phase " not in line]
    assert len(lines) == 1, err
    assert lines[0].startswith("flasync: error: ")
    assert "RUNNING" not in _statuses(store)
    return lines[0].removeprefix("flasync: error: ")


FILES = [
    ("bad.toml", "[server\nkind = 'fedbuff'", "bad.toml: invalid TOML: Expected ']' at the end of a table declaration"),
    ("bad.yaml", "server: {kind: fedbuff", "bad.yaml: invalid YAML: while parsing a flow mapping"),
    ("list.yaml", "- 1\n- 2\n", "list.yaml: the top level must be a table/mapping, got list"),
    ("typo.toml", "[faults]\ncrashes = 0.3\n", "faults.crashes: unknown field (did you mean crash?)"),
    ("type.toml", "[server]\nbuffer_size = 'ten'\n", "server.buffer_size: Input should be a valid integer"),
    ("range.toml", "[faults]\ncrash = 1.5\n", "faults.crash: Input should be less than 1 (got 1.5)"),
    ("window.toml", "[faults.availability]\nperiod_s = 0\nonline_fraction = 0.5\n", "faults.availability.period_s"),
    ("config.json", "{}", "config.json: unsupported config format '.json' (use .toml, .yaml or .yml)"),
]


@pytest.mark.parametrize(("name", "text", "expected"), FILES, ids=[f[0] for f in FILES])
def test_bad_config_files(
    capsys: pytest.CaptureFixture[str], store: str, tmp_path: Path, name: str, text: str, expected: str
) -> None:
    """Syntax errors, unknown keys, wrong types and out-of-range values in a file."""
    (tmp_path / name).write_text(text)
    assert expected in _fails(capsys, store, "run", name)


def test_missing_config_file(capsys: pytest.CaptureFixture[str], store: str) -> None:
    """A config path that does not exist."""
    assert _fails(capsys, store, "run", "nowhere.toml") == "config file not found: nowhere.toml"


SETS = [
    (["server.buffer_size"], "--set 'server.buffer_size': expected path.to.field=value"),
    (["faults.crash=abc"], "faults.crash: Input should be a valid number"),
    (["faults.hang=0.2"], "resilience.task_timeout_s: must be set when faults.hang > 0"),
    (["faults.crash=0.6", "faults.dropout=0.5"], "faults: crash + hang + dropout must be < 1, got 1.1"),
    (["resilience.aggregation=median"], "resilience.aggregation: 'median' applies to sync rounds only"),
    (["resilience.round_quorum=0"], "resilience.round_quorum: Input should be greater than 0 (got 0)"),
    (["resilience.zscore_min_history=80"], "resilience.zscore_min_history: must be <= resilience.zscore_window"),
    (["checkpoint.every_versions=0"], "checkpoint.every_versions: Input should be greater than or equal to 1"),
    (
        ["tracking.system_metrics_interval_s=0"],
        "tracking.system_metrics_interval_s: Input should be greater than or equal to 0.1 (got 0)",
    ),
    (
        ["eval.select=server/eval/f1:max"],
        "eval.select: 'server/eval/f1' is not a metric this run logs (one of: server/eval/accuracy, server/eval/loss)",
    ),
    (["eval.metrics=[accuracy, f2]"], "eval.metrics: unknown metric 'f2' (built-in: accuracy, loss, precision,"),
    (
        ["eval.metrics=f1"],
        "eval.metrics: Input should be a valid tuple (got 'f1'; a list is written [a, b], e.g. [f1])",
    ),
    (
        ["eval.clients.fraction=0.1", "eval.clients.every=3"],
        "eval.clients.every: set either eval.clients.fraction or every, not both",
    ),
    (
        ["eval.select=client_eval/accuracy/p10:max"],
        "eval.select: 'client_eval/accuracy/p10' is not a metric this run logs",
    ),
    (["eval.clients.held_out=1"], "eval.clients.held_out: Input should be less than 1"),
    (["eval.clients.fraction=0.1", "data.kind=synthetic", "data.lazy=true"], "eval.clients: client-side evaluation"),
    (["eval.metrics=[auc]"], "eval.metrics: 'auc' needs two classes, but the data has 10"),
    (["eval.metrics=[m=no_such_module_here:M]"], "eval.metrics: m=no_such_module_here:M: cannot import it"),
    (["eval.select=server/eval/loss:lowest"], "eval.select: the direction must be ':max' or ':min', got 'lowest'"),
    (["tracking.register=a:b"], "tracking.register: MLflow refuses the registered model name 'a:b': it contains ':'"),
    (["tracking.client_table_rows=0"], "tracking.client_table_rows: Input should be greater than or equal to 1"),
    (["tracking.client_table_rank=loss"], "tracking.client_table_rank: Input should be 'tasks', 'accepted'"),
]


@pytest.mark.parametrize(("overrides", "expected"), SETS, ids=[s[0][0] for s in SETS])
def test_bad_overrides(capsys: pytest.CaptureFixture[str], store: str, overrides: list[str], expected: str) -> None:
    """Malformed, mistyped, out-of-range and contradictory --set values."""
    argv = ["run"] + [arg for o in overrides for arg in ("--set", o)]
    assert expected in _fails(capsys, store, *argv)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["run", "--fast"], "unrecognized arguments: --fast"),
        (["run", "--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
        (["run", "--resume"], "argument --resume: expected one argument"),
        (
            ["run", "--resume", "abc123", "cfg.toml"],
            "--resume takes the config from run abc123's checkpoint; drop cfg.toml",
        ),
        (["run", "--resume", "abc123", "--no-tracking"], "--resume continues an MLflow run; it cannot be combined"),
        (["run", "--resume", "abc123", "--set", "server.buffer_size=3"], "with --resume only stop.* may change"),
        (["run", "--resume", "abc123", "--register", "digits"], "--register: a resumed run keeps its checkpoint's"),
        (["run", "--register", "team/digits"], "MLflow refuses the registered model name 'team/digits'"),
        (["run", "--register", "digits", "--no-tracking"], "tracking.register: needs tracking (tracking.enabled"),
        (
            ["run", "--register", "digits", "--set", "tracking.log_model=false"],
            "tracking.register: needs the model logged (tracking.log_model = true)",
        ),
        (["run", "--resume", "abc123"], "no MLflow run 'abc123': there is no store at sqlite:///"),
        (
            ["compare", "abc123", "--plot", "compare.png"],
            "--plot: the comparison is an SVG chart, name a .svg file (got 'compare.png')",
        ),
        (["compare", "abc123", "--plot", ""], "--plot: the comparison is an SVG chart, name a .svg file (got '')"),
        (
            ["compare", "abc123", "--plot", "no/such/folder/c.svg"],
            "--plot: cannot write no/such/folder/c.svg: not a file in an existing folder",
        ),
        (
            ["compare", "abc123", "--tracking-uri", "bogus://x"],
            "'bogus://x' is not an MLflow store URI: Model registry",
        ),
        (["compare", "abc123", "--experiment", "flasync"], "compare takes run ids or --experiment, not both"),
        (
            ["compare", "abc123", "--last", "2"],
            "--last and --filter pick among an experiment's runs: give them without",
        ),
        (["compare", "abc123", "--filter", "tags.seed = '1'"], "--last and --filter pick among an experiment's runs"),
        (["compare", "--last", "0"], "--last must be at least 1, got 0"),
        (["compare", "--last", "two"], "argument --last: invalid int value: 'two'"),
        (["compare", "--filter", " "], "--filter: empty filter (leave it out to compare every run)"),
        (["report", "abc123", "--tracking-uri", "bogus://x"], "'bogus://x' is not an MLflow store URI: "),
    ],
)
def test_bad_flags(capsys: pytest.CaptureFixture[str], store: str, argv: list[str], expected: str) -> None:
    """Unknown flags, bad choices, and --resume misuse."""
    assert expected in _fails(capsys, store, *argv)


def _run_with_checkpoint(store: str, status: str, data: bytes | None) -> str:
    tracker = tracking.MlflowTracker(store, writer_process=False)
    run_id = tracker.start(experiment="flasync")
    if data is not None:
        tracker.log_bytes(data, checkpoint.CHECKPOINT_SLOTS[0])
    tracker.finish(status)  # type: ignore[arg-type]
    return run_id


def _quiet(capsys: pytest.CaptureFixture[str]) -> None:
    """Forget what MLflow printed while the test set its store up."""
    capsys.readouterr()


@pytest.mark.slow
def test_resume_problems(capsys: pytest.CaptureFixture[str], store: str) -> None:
    """A run without a checkpoint, with a corrupt one, or already finished cannot be resumed."""
    bare = _run_with_checkpoint(store, "KILLED", None)
    _quiet(capsys)
    assert _fails(capsys, store, "run", "--resume", "0123abcd") == f"no MLflow run '0123abcd' in {store}"
    assert _fails(capsys, store, "run", "--resume", bare) == (f"MLflow run {bare} has no checkpoint (checkpoints/*.pt)")
    corrupt = _run_with_checkpoint(store, "KILLED", b"garbage")
    _quiet(capsys)
    assert _fails(capsys, store, "run", "--resume", corrupt).startswith("not a readable checkpoint (UnpicklingError): ")
    memory = MemoryTracker()
    flasync.runtime.federation.run(small_config("stop.max_versions=5", "checkpoint.every_versions=4"), tracker=memory)
    done = _run_with_checkpoint(store, "FINISHED", checkpoint.latest(memory.artifacts))
    _quiet(capsys)
    assert _fails(capsys, store, "run", "--resume", done) == (
        f"MLflow run {done} already FINISHED; there is nothing to resume"
    )
    assert set(_statuses(store)) == {"KILLED", "FINISHED"}


# -------------------------------------------------------------------------------------------- data and models
def test_labels_out_of_range(capsys: pytest.CaptureFixture[str], store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A data set whose labels exceed its classes."""

    def bad_digits() -> ArrayData:
        return ArrayData(x=torch.zeros(100, 64), y=torch.full((100,), 12, dtype=torch.int64), num_classes=10)

    monkeypatch.setattr(flasync.data.prepare, "load_digits", bad_digits)
    assert _fails(capsys, store, "run") == "labels must be in [0, 10); found 12 at index 0."


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["partition.kind=iid", "population.num_clients=2000"],
            "population.num_clients: 2000 clients need one training sample each, but the data has 1438",
        ),
        (
            ["partition.alpha=0.01", "population.num_clients=5000"],
            "population.num_clients: 5000 clients need one training sample each, but the data has 1438",
        ),
        (
            ["partition.kind=shards", "partition.shards_per_client=3", "population.num_clients=1000"],
            "cannot cut 1438 samples into 3000 shards (1000 clients x 3 shards each).",
        ),
    ],
)
def test_partitions_leaving_clients_empty(
    capsys: pytest.CaptureFixture[str], store: str, overrides: list[str], expected: str
) -> None:
    """Partitions that would leave a client with no samples."""
    argv = ["run"] + [arg for o in overrides for arg in ("--set", o)]
    assert expected in _fails(capsys, store, *argv)


@pytest.mark.slow
def test_model_factory_that_raises(
    capsys: pytest.CaptureFixture[str], store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model factory that raises."""

    def broken(*args: object, **kwargs: object) -> torch.nn.Module:
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(flasync.runtime.prepare, "MLP", broken)
    assert _fails(capsys, store, "run") == "model factory failed: RuntimeError: no GPU here"


@pytest.mark.slow
def test_model_that_does_not_fit_the_data(capsys: pytest.CaptureFixture[str], store: str) -> None:
    """A CNN whose image size does not match the samples."""
    message = _fails(capsys, store, "run", "--set", "model.kind=cnn", "--set", "model.image_size=[4,4]")
    assert message == "model.image_size: 1x4x4 = 16 values, but samples have 64"


# ---------------------------------------------------------------------------------- input that cost minutes before
def _bomb(levels: int = 12) -> str:
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nseed: *a{levels - 1}\n"


@pytest.mark.parametrize(
    ("suffix", "text", "message"),
    [
        (".yaml", _bomb(), r"invalid YAML: YAML anchors \(&a0\) are not supported in configs \(line 1"),
        (".yaml", "seed:\n" + "".join(" " * (2 * i) + "- \n" for i in range(1, 3000)), r"nested deeper than 64 levels"),
        (".yaml", "server: {kind: fedbuff}\nstop: &s {max_versions: 3}\n", r"YAML anchors \(&s\)"),
        (".toml", "seed = " + "[" * 3000 + "]" * 3000 + "\n", r"invalid TOML: nested deeper than 64 levels"),
        (".toml", "seed = " + "[" * 100 + "]" * 100 + "\n", r"invalid TOML: nested deeper than 64 levels"),
        (".toml", "[a]\nb = " + "{c = " * 200 + "1" + "}" * 200 + "\n", r"invalid TOML: nested deeper than 64 levels"),
        (".toml", "seed = " + "9" * 5000 + "\n", r"invalid TOML: Exceeds the limit \(4300 digits\)"),
        (".toml", "seed = " + "9" * 4000 + "\n", r"seed: Input should be less than"),
    ],
    ids=[
        "yaml-alias-bomb",
        "yaml-deep-nesting",
        "yaml-anchor",
        "toml-deep-arrays",
        "toml-arrays-over-the-limit",
        "toml-deep-inline-tables",
        "toml-5000-digit-integer",
        "toml-4000-digit-integer",
    ],
)
@pytest.mark.timeout(30)
def test_hostile_config_files_are_one_line_while_parsing(
    store: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, suffix: str, text: str, message: str
) -> None:
    """An alias bomb, any anchor, nesting past 64 levels or an integer Python will not convert, in YAML or TOML:
    refused while parsing, in one line, exit 2, before any MLflow run exists."""
    import re

    path = tmp_path / f"hostile{suffix}"
    path.write_text(text)
    line = _fails(capsys, store, "run", str(path))
    assert re.search(message, line), line
    assert _statuses(store) == []


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("seed=" + "9" * 5000, "seed: "),
        ("network.latency_s=inf", "network.latency_s: Input should be a finite number"),
        ("client.lr=nan", "client.lr: Input should be a finite number"),
        ("population.num_clients=1000000000", "population.num_clients: Input should be less than or equal to"),
        ("data={kind: synthetic, num_features: 1000000000}", "data.num_features: Input should be less"),
        (
            "data={kind: synthetic, samples_per_client: 100000, num_features: 1000}",
            "data.samples_per_client: 100000 samples x 100 clients x 1000 features need 37 GiB",
        ),
    ],
)
def test_absurd_values_are_one_line_errors_naming_the_field(
    store: str, capsys: pytest.CaptureFixture[str], override: str, message: str
) -> None:
    """Huge, infinite or unknown values are refused by the config, before any data or MLflow run exists."""
    line = _fails(capsys, store, "run", "--set", override)
    assert message in line, line
    assert _statuses(store) == []


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("ftp://user:secret@host/store", "tracking.uri: 'ftp://***@host/store' is not an MLflow store URI"),
        ("mongodb://host/db", "tracking.uri: 'mongodb://host/db' is not an MLflow store URI"),
        ("sqlite:///{tmp}", "tracking.uri: the SQLite store {tmp} is a folder; name the database file"),
    ],
    ids=["ftp-with-password", "unknown-scheme", "sqlite-folder"],
)
def test_unusable_stores_are_refused_at_once(
    store: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, uri: str, message: str
) -> None:
    """An unknown scheme or a SQLite 'file' that is a folder: one line (no password in it), before anything runs
    (before: accepted, then everything spooled, or minutes of retries)."""
    uri, message = uri.format(tmp=tmp_path), message.format(tmp=tmp_path)
    status = main(["run", "--tracking-uri", uri])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert message in err[0] and "secret" not in err[0]


def test_instant_links_stay_allowed() -> None:
    """An infinite bandwidth is an instant link, the one infinity a config accepts."""
    config = small_config(network={"upload_bytes_per_s": float("inf"), "download_bytes_per_s": float("inf")})
    assert config.network.upload_bytes_per_s == float("inf")


def test_an_unwritable_working_directory_is_one_line_at_once(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run from a folder no one can write (here /proc, read-only even for root) with the default store
    ./mlruns/mlflow.db: one line naming the folder and the ways out, exit 2, before anything runs."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir("/proc")
    status = main(["run", "--set", "stop.max_versions=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith("flasync: error: cannot write the MLflow store's folder /proc/mlruns (")
    assert "--no-tracking" in err[0]
    assert main(["run", "--no-tracking", "--set", "stop.max_versions=1"]) == 0  # nothing else needs the folder


def test_compare_s_default_count_is_the_tracking_module_s() -> None:
    """The parser's default --last (kept apart so that parsing imports no MLflow) is what fetch_runs takes."""
    from flasync.cli import compare
    from flasync.tracking import compare as tracking_compare

    assert compare.DEFAULT_LAST == tracking_compare.DEFAULT_LAST
