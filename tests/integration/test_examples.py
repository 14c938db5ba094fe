"""The runnable examples, end to end, as a user starts them (a subprocess, a temporary MLflow store)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

from tests.conftest import EXAMPLES


@pytest.mark.slow
def test_custom_strategy_runs_and_is_tracked(tmp_path: Path) -> None:
    """examples/custom_strategy.py trains with Multi-Krum and focal loss, prints its accuracy, and the MLflow run
    names both rules and holds the evaluation metrics."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "custom_strategy.py"), "--store", uri, "--versions", "3", "--clients", "20"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.search(r"^accuracy (\d\.\d{3}) after 3 versions, run ([0-9a-f]{32}) in ", done.stdout, re.MULTILINE)
    assert found is not None, done.stdout[-2000:]
    run = mlflow.MlflowClient(uri).get_run(found.group(2))
    assert run.info.status == "FINISHED"
    assert run.data.tags["aggregator.custom"] == "multi_krum"
    assert run.data.tags["objective"] == "FocalLoss"
    assert abs(run.data.metrics["server/eval/accuracy"] - float(found.group(1))) < 5e-4  # printed to 3 places


@pytest.mark.slow
def test_the_text_corpus_is_the_same_for_a_seed_and_a_sentence_a_line(tmp_path: Path) -> None:
    """examples/make_text_corpus.py writes --lines sentences, byte for byte the same for a seed, another for
    another seed."""
    made = []
    for seed, name in ((0, "a.txt"), (0, "b.txt"), (1, "c.txt")):
        out = tmp_path / name
        subprocess.run(
            [
                sys.executable,
                str(EXAMPLES / "make_text_corpus.py"),
                "--out",
                str(out),
                "--lines",
                "50",
                "--seed",
                str(seed),
            ],
            check=True,
            timeout=120,
        )
        made.append(out.read_bytes())
    lines = made[0].decode().splitlines()
    assert len(lines) == 50 and all(line.startswith("the ") and line.endswith(".") for line in lines)
    assert made[0] == made[1] and made[0] != made[2]


@pytest.mark.slow
def test_the_writers_file_splits_into_the_38_clients_the_custom_data_guide_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The file examples/make_files_data.py writes keeps 38 writers with min_samples samples under
    examples/files_by_column.toml: the number the guide's Dirichlet comparison sets."""
    from flasync.cli import main

    shutil.copy(EXAMPLES / "files_by_column.toml", tmp_path / "files_by_column.toml")
    out = tmp_path / "data" / "digits_by_writer.csv"
    subprocess.run([sys.executable, str(EXAMPLES / "make_files_data.py"), "--out", str(out)], check=True, timeout=120)
    assert main(["data", "describe", str(tmp_path / "files_by_column.toml"), "--rows", "1", "--no-tracking"]) == 0
    assert "clients 38, samples 1435" in capsys.readouterr().out
    assert "population.num_clients=38" in (EXAMPLES.parent / "docs" / "guides" / "custom.md").read_text()
