"""Tracked runs with a selection and a registered model: the best model logged beside the last, and the alias
champion moved only by a better run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlflow
import mlflow.pytorch
import numpy as np
import pytest
import torch
import yaml

import flasync
from flasync.cli import main
from flasync.observe.summary import weights_sha256
from flasync.testing import small_config
from flasync.tracking.registry import CHAMPION


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in model.state_dict().values()])


@pytest.mark.slow
def test_a_run_registers_its_best_model_and_only_a_better_run_moves_the_champion(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command line registers the best model (champion); a worse run adds a version without the alias, a better
    one takes it."""
    config = small_config("eval.every_versions=1", "eval.select=server/eval/accuracy:max").model_dump(mode="json")
    config["tracking"].update(enabled=True, log_model=True)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    argv = ["run", "run.yaml", "--tracking-uri", store, "--no-system-metrics", "--register", "digits"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "registry        registered digits version 1, alias champion" in out
    client = mlflow.MlflowClient(store)
    champion = client.get_model_version_by_alias("digits", CHAMPION)
    run = client.get_run(champion.run_id)
    version, value = int(champion.tags["flasync.version"]), float(champion.tags["flasync.value"])
    assert f"best            version {version} by server/eval/accuracy:max ({value:.4f})" in out
    assert champion.tags["flasync.dataset_digest"] == run.inputs.dataset_inputs[0].dataset.digest
    logged = {m.name: m for m in client.search_logged_models([run.info.experiment_id])}
    assert set(logged) == {"model", "best_model"} and champion.source == logged["best_model"].artifact_location
    assert json.loads(logged["best_model"].tags["mlflow.modelVersions"]) == [{"name": "digits", "version": 1}]
    assert logged["model"].tags["flasync.version"] == "12" and logged["best_model"].tags["flasync.version"] == str(
        version
    )
    best = mlflow.pytorch.load_model(logged["best_model"].artifact_location)
    stopped = flasync.run(small_config("eval.every_versions=1", f"stop.max_versions={version}"))
    assert weights_sha256(_flat(best)) == stopped.weights_sha256

    def again(*overrides: str) -> flasync.Federation:
        federation = flasync.Federation(
            small_config(
                "eval.every_versions=1",
                "tracking.enabled=true",
                f"tracking.uri={store}",
                "tracking.log_model=true",
                "tracking.register=digits",
                *overrides,
            )
        )
        flasync.core.loops.run_loop(federation.run())
        return federation

    worse = again("eval.select=server/eval/accuracy:max", "stop.max_versions=2").registration
    assert worse is not None and (worse.version, worse.champion) == (2, 1)
    assert worse.message.startswith("registered digits version 2; kept champion version 1 (")
    better = again("eval.select=server/eval/accuracy:max", "client.lr=0.5").registration
    assert better is not None and (better.version, better.champion) == (3, 3)
    assert int(client.get_model_version_by_alias("digits", CHAMPION).version) == 3
    assert np.isfinite(float(client.get_model_version("digits", "3").tags["flasync.value"]))


@pytest.mark.slow
def test_a_run_links_its_evaluation_metrics_to_its_logged_models(store: str) -> None:
    """Each logged model holds the evaluation (central and, where clients evaluated its version, client-side) of the
    version it holds, the run's series hold each point once, and the registered version is the best model."""
    federation = flasync.Federation(
        small_config(
            "eval.every_versions=1",
            "eval.select=client_eval/accuracy/mean:max",
            "eval.clients.fraction=0.5",
            "eval.clients.held_out=0.2",
            "eval.clients.min_reports=2",
            "tracking.enabled=true",
            f"tracking.uri={store}",
            "tracking.log_model=true",
            "tracking.register=digits",
        )
    )
    flasync.core.loops.run_loop(federation.run())
    client = mlflow.MlflowClient(store)
    run = client.get_run(federation.run_id)
    keys = sorted(k for k in run.data.metrics if k.startswith(("server/eval/", "client_eval/")))
    assert "server/eval/accuracy" in keys and any(k.startswith("client_eval/accuracy/") for k in keys)
    series = {key: client.get_metric_history(run.info.run_id, key) for key in keys}
    for points in series.values():
        assert len({p.step for p in points}) == len(points)  # one point per evaluated version
    logged = {m.name: m for m in client.search_logged_models([run.info.experiment_id])}
    for name in ("model", "best_model"):  # each model: the evaluation of the version it holds, one point a key
        version = int(logged[name].tags["flasync.version"])
        held = sorted((m.key, m.step, m.value) for m in logged[name].metrics)
        points = [p for values in series.values() for p in values if p.step == version and not math.isnan(p.value)]
        assert held == sorted((p.key, p.step, p.value) for p in points), name
        assert {"server/eval/accuracy", "server/eval/loss"} <= {key for key, _, _ in held}, name
    assert int(logged["model"].tags["flasync.version"]) == federation.summary.versions
    best = {m.key: m.value for m in logged["best_model"].metrics}
    assert best["client_eval/accuracy/mean"] == float(logged["best_model"].tags["flasync.value"])
    # MLflow's SQL registry keeps no model id on a version: its source and the model's version list are the link.
    champion = client.get_model_version_by_alias("digits", CHAMPION)
    assert (champion.source, champion.run_id) == (logged["best_model"].artifact_location, run.info.run_id)
    assert json.loads(logged["best_model"].tags["mlflow.modelVersions"]) == [{"name": "digits", "version": 1}]
