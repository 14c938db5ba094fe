"""``flasync data describe`` and ``flasync data trace``: printed histograms, the MLflow artifacts, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest

from flasync.cli import main


def _fails(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the CLI in-process: exit 2 and one error line on stderr."""
    status = main(list(argv))
    err = capsys.readouterr().err
    assert status == 2, err
    lines = [line for line in err.strip().splitlines() if " run.phase " not in line]
    assert len(lines) == 1, err
    return lines[0].removeprefix("flasync: error: ")


def test_describe_prints_each_clients_labels(capsys: pytest.CaptureFixture[str], store: str) -> None:
    """Label-quantity skew with k = 3: the summary says 3 labels for every client, each row lists 3 nonzero counts."""
    argv = ["data", "describe", "--set", "partition.kind=label_quantity", "--set", "partition.labels_per_client=3"]
    assert main([*argv, "--set", "population.num_clients=25", "--rows", "25", "--no-tracking"]) == 0
    out = capsys.readouterr().out
    assert "clients 25, samples 1438" in out
    assert "labels per client: min 3, mean 3.00, max 3" in out
    rows = out.split("label counts (0..C-1)\n")[1].strip().splitlines()
    assert len(rows) == 25
    assert all(sum(int(c) > 0 for c in row.split()[2:]) == 3 for row in rows)
    assert not Path(store.removeprefix("sqlite:///")).exists()


@pytest.mark.slow
def test_describe_logs_the_histograms_to_mlflow(capsys: pytest.CaptureFixture[str], store: str) -> None:
    """With tracking, a run in '<experiment>.data' holds data/describe.svg, data/clients.json and the summary."""
    argv = ["data", "describe", "--set", "partition.kind=quantity", "--set", "population.num_clients=40"]
    assert main([*argv, "--tracking-uri", store]) == 0
    assert "logged to MLflow run" in capsys.readouterr().out
    client = mlflow.MlflowClient(store)
    experiment = client.get_experiment_by_name("flasync.data")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["partition.kind"] == "quantity"
    assert run.data.metrics["data.clients"] == 40 and run.data.metrics["data.samples"] == 1438
    folder = Path(client.download_artifacts(run.info.run_id, "data", str(Path(store[10:]).parent)))
    table = json.loads((folder / "clients.json").read_text())
    assert sum(table["clients"]["size"]) == 1438 and len(table["clients"]["label_counts"]) == 40
    svg = (folder / "describe.svg").read_text()
    assert svg.startswith("<svg") and "client sizes" in svg and "distinct labels per client" in svg


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (["partition.kind=label_quantity", "partition.labels_per_client=11"], "partition.labels_per_client: must be"),
        (["partition.kind=quantity", "partition.distribution=powerlaw", "partition.sigma=1"], "partition.sigma: is"),
        (["partition.kind=quantity", "partition.exponent=0.5"], "partition.exponent: Input should be greater than 1"),
        (["partition.kind=feature_skew"], "partition.noise: feature_skew needs noise > 0 or rotations > 1"),
        (["partition.kind=feature_skew", "partition.noise=-1"], "partition.noise: Input should be greater than"),
        (["data.kind=synthetic", "data.lazy=true", "partition.kind=quantity"], "data describe: data.lazy = true"),
    ],
)
def test_bad_partition_parameters_are_one_line(
    capsys: pytest.CaptureFixture[str], store: str, sets: list[str], expected: str
) -> None:
    """A bad partition parameter is one line naming the field, exit 2."""
    argv = ["data", "describe", "--no-tracking"]
    for item in sets:
        argv += ["--set", item]
    assert expected in _fails(capsys, *argv)


@pytest.mark.parametrize("suffix", [".csv", ".json"])
def test_trace_writes_a_readable_trace(capsys: pytest.CaptureFixture[str], tmp_path: Path, suffix: str) -> None:
    """`data trace` writes N clients' trace in the named format, which population.trace reads back."""
    from flasync.clients.simulated.trace import read_trace

    out = tmp_path / f"devices{suffix}"
    assert main(["data", "trace", "--clients", "12", "--out", str(out), "--online-fraction", "0.3"]) == 0
    assert f"wrote {out}: 12 clients" in capsys.readouterr().out
    assert len(read_trace(out)) == 12


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--clients", "0", "--out", "t.csv"], "--clients must be >= 1, got 0"),
        (["--clients", "3", "--out", "t.txt"], "--out: name a .csv or .json trace file"),
        (["--clients", "3", "--out", "t.csv", "--online-fraction", "1.5"], "--online-fraction must be in (0, 1]"),
    ],
)
def test_trace_bad_arguments_are_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], expected: str
) -> None:
    """Bad generator arguments are one line, exit 2."""
    assert expected in _fails(capsys, "data", "trace", *argv)


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (["population.trace=t.txt"], "population.trace: unsupported format of 't.txt'"),
        (["population.trace=nowhere.csv"], "population.trace: cannot read"),
        (["population.trace=t.csv", "population.sampling=lru"], "population.trace: windows need population.sampling"),
        (
            ["population.trace=t.csv", "faults.availability.period_s=5", "faults.availability.online_fraction=0.5"],
            "population.trace: gives the availability windows; remove faults.availability",
        ),
    ],
)
def test_bad_trace_runs_are_one_line(
    capsys: pytest.CaptureFixture[str], store: str, tmp_path: Path, sets: list[str], expected: str
) -> None:
    """A run naming a bad or unreadable trace, or one it cannot combine with, stops in one line, exit 2."""
    (tmp_path / "t.csv").write_text("client,speed,online\n0,1,0-10\n")
    argv = ["run", "--no-tracking"]
    for item in sets:
        argv += ["--set", item]
    assert expected in _fails(capsys, *argv)


def test_a_bad_trace_row_stops_the_run_in_one_line(capsys: pytest.CaptureFixture[str], store: str) -> None:
    """A trace with a bad field names the file, the row and the field."""
    Path("bad.csv").write_text("client,speed,online\n0,1,0-10\n1,-2,0-10\n")
    message = _fails(capsys, "run", "--no-tracking", "--set", "population.trace=bad.csv")
    assert message.endswith("bad.csv: row 3, field 'speed': must be > 0, got '-2'")


def test_a_lazy_run_with_too_many_labels_per_client_is_one_line(capsys: pytest.CaptureFixture[str], store: str) -> None:
    """Lazy label-quantity skew asking for more labels than the synthetic data has stops before training."""
    sets = ["data.kind=synthetic", "data.lazy=true", "data.num_classes=5", "partition.kind=label_quantity"]
    argv = ["run", "--no-tracking", "--set", "partition.labels_per_client=6"]
    for item in sets:
        argv += ["--set", item]
    assert _fails(capsys, *argv) == "partition.labels_per_client: must be in 1..5 (data.num_classes), got 6"
