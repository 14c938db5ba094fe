"""The MLflow Model Registry: a run's model registered with the alias champion, moved only by a better one."""

from __future__ import annotations

import mlflow
import pytest

from flasync.tracking.registry import CHAMPION, Registration, register_champion
from tests.conftest import ready_models


def _run_with_model(client: mlflow.MlflowClient, name: str = "best_model") -> str:
    """Start and end a run that logged an (empty) READY model called ``name``; return the run's id."""
    experiment = client.get_experiment_by_name("registry") or client.get_experiment(
        client.create_experiment("registry")
    )
    run = client.create_run(experiment.experiment_id)
    model = client.create_logged_model(experiment.experiment_id, name=name, source_run_id=run.info.run_id)
    client.finalize_logged_model(model.model_id, "READY")
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def _register(
    client: mlflow.MlflowClient, name: str, value: float, direction: str = "max", metric: str = "server/eval/accuracy"
) -> Registration:
    return register_champion(
        client,
        name,
        run_id=_run_with_model(client),
        model_name="best_model",
        metric=metric,
        direction=direction,
        value=value,
        tags={"flasync.version": "7"},
    )


def test_the_first_model_becomes_the_champion_with_its_tags(tracking_uri: str) -> None:
    """A new registered model's first version gets the alias and the run's tags."""
    client = mlflow.MlflowClient(tracking_uri)
    done = register_champion(
        client,
        "first",
        run_id=(run_id := _run_with_model(client)),
        model_name="best_model",
        metric="server/eval/accuracy",
        direction="max",
        value=0.9,
        tags={"flasync.version": "7"},
    )
    assert (done.version, done.champion, done.moved) == (1, 1, True)
    assert done.message == "registered first version 1, alias champion"
    champion = client.get_model_version_by_alias("first", CHAMPION)
    assert int(champion.version) == 1 and champion.run_id == run_id
    assert champion.tags["flasync.run_id"] == run_id
    assert (champion.tags["flasync.version"], champion.tags["flasync.value"]) == ("7", "0.9")
    assert champion.tags["flasync.metric"] == "server/eval/accuracy"


def test_a_worse_or_equal_model_keeps_the_champion_and_a_better_one_moves_it(
    tracking_uri: str,
) -> None:
    """Ties and worse values keep the alias on the old version (saying why); a better value moves it."""
    client = mlflow.MlflowClient(tracking_uri)
    assert _register(client, "digits", 0.95).moved
    worse = _register(client, "digits", 0.94)
    assert (worse.version, worse.champion, worse.moved) == (2, 1, False)
    assert worse.message == "registered digits version 2; kept champion version 1 (0.95 > 0.94)"
    tie = _register(client, "digits", 0.95)
    assert (tie.champion, tie.message.endswith("(0.95 = 0.95)")) == (1, True)
    better = _register(client, "digits", 0.97)
    assert (better.version, better.champion) == (4, 4)
    assert int(client.get_model_version_by_alias("digits", CHAMPION).version) == 4


def test_for_a_loss_lower_is_better(tracking_uri: str) -> None:
    """With direction min, a smaller value moves the alias and a larger one does not."""
    client = mlflow.MlflowClient(tracking_uri)
    _register(client, "loss", 0.3, "min", "server/eval/loss")
    assert not _register(client, "loss", 0.35, "min", "server/eval/loss").moved
    assert _register(client, "loss", 0.25, "min", "server/eval/loss").moved


def test_a_champion_selected_by_another_metric_is_kept(tracking_uri: str) -> None:
    """Values of different metrics are not compared: the champion stays, and the message says why."""
    client = mlflow.MlflowClient(tracking_uri)
    _register(client, "mixed", 0.3, "min", "server/eval/loss")
    done = _register(client, "mixed", 0.99)
    assert not done.moved
    assert "selected by server/eval/loss:min, not server/eval/accuracy:max" in done.message


def test_a_run_without_that_model_is_a_lookup_error(tracking_uri: str) -> None:
    """Registering a logged model the run does not have raises LookupError (nothing is registered)."""
    client = mlflow.MlflowClient(tracking_uri)
    with pytest.raises(LookupError, match="has no logged model 'model'"):
        register_champion(
            client,
            "nothing",
            run_id=_run_with_model(client),
            model_name="model",
            metric="server/eval/accuracy",
            direction="max",
            value=0.5,
            tags={},
        )


def test_the_latest_ready_model_of_the_name_is_registered(tracking_uri: str) -> None:
    """Of several READY models of one name in the run (a service logging its model again), the one created last is
    registered; a later one still pending is not."""
    client = mlflow.MlflowClient(tracking_uri)
    experiment = client.create_experiment("registry-latest")
    run_id = client.create_run(experiment).info.run_id
    made = ready_models(client, experiment, run_id, "model")
    done = register_champion(
        client,
        "latest",
        run_id=run_id,
        model_name="model",
        metric="server/eval/accuracy",
        direction="max",
        value=0.5,
        tags={},
    )
    assert client.get_model_version("latest", str(done.version)).source == made[-1].artifact_location
