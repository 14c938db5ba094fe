"""Models saved for MLflow by builder, and the exports made ahead of their save
(:class:`flasync.tracking._model.Exports`)."""

from __future__ import annotations

import filecmp
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
import mlflow.pytorch
import numpy as np
import pytest
import torch
import yaml
from mlflow.models import Model

from flasync.tracking import _model
from flasync.tracking._child import _Aside, _job, _Monitor
from flasync.training import models

_BUILDER = "flasync.training.models:build"
_SPEC = {"model": "MLP", "in_features": 8, "hidden": [6], "num_classes": 3}
_EXAMPLE = np.random.default_rng(0).normal(size=(2, 8)).astype(np.float32).tolist()
_DESCRIPTION = {"artifact_path": "models:/m-1", "run_id": "r1", "model_uuid": "m-1", "model_id": "m-1"}

_NORM_BUILDER = '''
import torch


class Scaled(torch.nn.Module):
    """Multiply by a number that is no tensor: models differing only in it have the same classes and weights."""

    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


class StatefulScaled(Scaled):
    """The factor in the state dict, as extra state (which an exported program does not hold)."""

    def get_extra_state(self):
        return {"factor": self.factor}

    def set_extra_state(self, state):
        self.factor = state["factor"]


def build(hidden=6, activation="relu", factor=1.0, scale=None, train=False, extra=False):
    """A small model with a batch norm (running statistics, a counter) and a buffer outside the state dict."""
    layers = [torch.nn.Linear(8, hidden), torch.nn.BatchNorm1d(hidden), (StatefulScaled if extra else Scaled)(factor)]
    layers.append(torch.nn.ReLU() if activation == "relu" else torch.nn.Tanh())
    model = torch.nn.Sequential(*layers, torch.nn.Linear(hidden, 3))
    model.register_buffer("offset", torch.zeros(3), persistent=False)
    if scale is not None:
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                if tensor.is_floating_point():
                    tensor.copy_(torch.linspace(0.1, scale, tensor.numel()).view_as(tensor))
        model[1].num_batches_tracked.fill_(7)
    return model.train(train)
'''


@pytest.fixture
def norm_builder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Return the builder of a model with buffers, importable as ``norm_builder:build``."""
    (tmp_path / "norm_builder.py").write_text(_NORM_BUILDER)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "norm_builder:build"
    sys.modules.pop("norm_builder", None)


def _final_mlp(tmp_path: Path, seed: int = 1) -> tuple[dict[str, Any], torch.nn.Module]:
    """Return the builder's arguments of an MLP with trained-looking weights (written to a file), and the MLP."""
    torch.manual_seed(seed)
    model = models.MLP(8, [6], 3)
    weights = tmp_path / f"w{seed}.npy"
    np.save(weights, torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy())
    return {**_SPEC, "weights": str(weights)}, model


def _saved(folder: Path) -> Model:
    return Model.load(str(folder / "MLmodel"))


@pytest.mark.slow
def test_a_prepared_export_saves_what_a_full_save_does(tmp_path: Path) -> None:
    """A model saved from the export prepared for its structure is the full save's folder: the same files, the same
    archive bytes, the same MLmodel but for its time; it loads to the final weights."""
    exports = _model.Exports()
    exports.prepare(builder=_BUILDER, kwargs={**_SPEC, "weights": None}, input_example=_EXAMPLE)
    kwargs, model = _final_mlp(tmp_path)
    common = {"builder": _BUILDER, "kwargs": kwargs, "description": _DESCRIPTION, "input_example": _EXAMPLE}
    _model.save_for(folder=str(tmp_path / "ahead"), exports=exports, **common)
    _model.save_for(folder=str(tmp_path / "full"), **common)
    compared = filecmp.dircmp(tmp_path / "ahead", tmp_path / "full")
    assert compared.left_only == compared.right_only == []
    assert compared.diff_files == ["MLmodel"]
    assert filecmp.cmp(tmp_path / "ahead/data/model.pt2", tmp_path / "full/data/model.pt2", shallow=False)
    ahead, full = (yaml.safe_load((tmp_path / name / "MLmodel").read_text()) for name in ("ahead", "full"))
    assert ahead.pop("utc_time_created") != "" and full.pop("utc_time_created") != ""
    assert ahead == full
    assert ahead["model_id"] == "m-1" and ahead["run_id"] == "r1"
    x = torch.randn(5, 8)
    assert torch.equal(mlflow.pytorch.load_model(str(tmp_path / "ahead"))(x), model(x))


@pytest.mark.parametrize("ahead", [False, True], ids=["full save", "prepared export"])
def test_an_exported_model_loads_as_pyfunc_where_cuda_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ahead: bool
) -> None:
    """A pt2 model exported on the CPU says so in its python_function flavour: mlflow.pyfunc.load_model, which takes
    the first GPU wherever CUDA is, loads it on the CPU there instead of refusing it."""
    kwargs, model = _final_mlp(tmp_path)
    exports = _model.Exports() if ahead else None
    if exports is not None:
        exports.prepare(builder=_BUILDER, kwargs={**_SPEC, "weights": None}, input_example=_EXAMPLE)
    folder = tmp_path / "model"
    _model.save_for(
        folder=str(folder),
        exports=exports,
        builder=_BUILDER,
        kwargs=kwargs,
        description=_DESCRIPTION,
        input_example=_EXAMPLE,
    )
    assert _saved(folder).flavors["python_function"]["config"] == {"device": "cpu"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    monkeypatch.delenv("MLFLOW_DEFAULT_PREDICTION_DEVICE", raising=False)
    x = np.linspace(-1, 1, 40, dtype=np.float32).reshape(5, 8)
    predicted = mlflow.pyfunc.load_model(str(folder)).predict(x)
    assert np.array_equal(np.asarray(predicted), model(torch.from_numpy(x)).detach().numpy())


def test_an_export_serves_one_save_after_another(tmp_path: Path) -> None:
    """Each save swaps its own weights in: two models saved from one export load to their own weights, and a save
    without a description gets a model id of its own."""
    exports = _model.Exports()
    exports.prepare(builder=_BUILDER, kwargs={**_SPEC, "weights": None}, input_example=_EXAMPLE)
    x = torch.randn(5, 8)
    uuids = set()
    for seed in (1, 2):
        kwargs, model = _final_mlp(tmp_path, seed)
        folder = tmp_path / f"m{seed}"
        saved = exports.save(_model.build(_BUILDER, kwargs), str(folder), builder=_BUILDER, input_example=_EXAMPLE)
        assert saved
        assert torch.equal(mlflow.pytorch.load_model(str(folder))(x), model(x))
        uuids.add(_saved(folder).model_uuid)
    assert len(uuids) == 2


@pytest.mark.parametrize("train", [False, True], ids=["eval mode", "training mode"])
def test_buffers_are_swapped_in_too(tmp_path: Path, norm_builder: str, train: bool) -> None:
    """Batch-norm statistics, its counter and a buffer outside the state dict take the final values; in training
    mode too, where the forward that checks the export updates the statistics."""
    exports = _model.Exports()
    exports.prepare(builder=norm_builder, kwargs={"train": train}, input_example=_EXAMPLE)
    final = _model.build(norm_builder, {"scale": 1.5, "train": train})
    expected = {name: tensor.clone() for name, tensor in final.state_dict().items()}
    assert exports.save(final, str(tmp_path / "m"), builder=norm_builder, input_example=_EXAMPLE)
    loaded = mlflow.pytorch.load_model(str(tmp_path / "m"))
    buffers = dict(loaded.named_buffers())
    assert buffers["1.num_batches_tracked"].item() == 7
    for name in ("1.running_mean", "1.running_var", "offset"):
        assert torch.equal(buffers[name], expected.get(name, torch.linspace(0.1, 1.5, 3)))
    if not train:
        x = torch.randn(5, 8)
        assert torch.equal(loaded(x), final(x))


@pytest.mark.parametrize(
    "kwargs",
    [{"hidden": 7}, {"activation": "tanh"}, {"factor": -1.0}],
    ids=["other shapes", "other classes", "same classes and weights, other computation"],
)
@pytest.mark.slow
def test_a_model_of_another_structure_is_refused(tmp_path: Path, norm_builder: str, kwargs: dict[str, Any]) -> None:
    """A model whose parameters or outputs differ from the export's is not saved from it (nothing is written), and
    save_for then exports it in full."""
    exports = _model.Exports()
    exports.prepare(builder=norm_builder, kwargs={}, input_example=_EXAMPLE)
    final = _model.build(norm_builder, {**kwargs, "scale": 1.5})
    assert not exports.save(final, str(tmp_path / "m"), builder=norm_builder, input_example=_EXAMPLE)
    assert not (tmp_path / "m").exists()
    _model.save_for(
        folder=str(tmp_path / "m"),
        builder=norm_builder,
        kwargs={**kwargs, "scale": 1.5},
        input_example=_EXAMPLE,
        exports=exports,
    )
    x = torch.randn(5, 8)
    assert torch.equal(mlflow.pytorch.load_model(str(tmp_path / "m"))(x), final(x))


def test_a_model_with_extra_state_is_exported_in_full(tmp_path: Path, norm_builder: str) -> None:
    """A module's extra state (in its state dict, not in an exported program) is no weight to swap in: even the
    same structure is refused, and saved in full by save_for."""
    exports = _model.Exports()
    exports.prepare(builder=norm_builder, kwargs={"extra": True}, input_example=_EXAMPLE)
    final = _model.build(norm_builder, {"extra": True, "scale": 1.5})
    assert not exports.save(final, str(tmp_path / "m"), builder=norm_builder, input_example=_EXAMPLE)
    _model.save_for(
        folder=str(tmp_path / "m"),
        builder=norm_builder,
        kwargs={"extra": True, "scale": 1.5},
        input_example=_EXAMPLE,
        exports=exports,
    )
    x = torch.randn(5, 8)
    assert torch.equal(mlflow.pytorch.load_model(str(tmp_path / "m"))(x), final(x))


def test_no_export_without_its_builder_and_example(tmp_path: Path) -> None:
    """An export serves only its builder and input example; the oldest of more than ``kept`` is dropped."""
    exports = _model.Exports(kept=2)
    final = _model.build(_BUILDER, {**_SPEC, "weights": None})
    other = np.zeros((2, 8), dtype=np.float32).tolist()
    assert not exports.save(final, str(tmp_path / "a"), builder=_BUILDER, input_example=_EXAMPLE)
    exports.prepare(builder=_BUILDER, kwargs={**_SPEC, "weights": None}, input_example=other)
    assert not exports.save(final, str(tmp_path / "a"), builder=_BUILDER, input_example=_EXAMPLE)
    assert not exports.save(final, str(tmp_path / "a"), builder=_BUILDER, input_example=other, input_dtype="float64")
    for example in (_EXAMPLE, np.ones((2, 8)).tolist()):
        exports.prepare(builder=_BUILDER, kwargs={**_SPEC, "weights": None}, input_example=example)
    assert len(exports) == 2
    assert not exports.save(final, str(tmp_path / "a"), builder=_BUILDER, input_example=other)
    assert exports.save(final, str(tmp_path / "a"), builder=_BUILDER, input_example=_EXAMPLE)


def test_the_same_model_prepared_again_is_not_exported_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Preparing the builder, arguments and example already prepared (the next run of a sweep) keeps the export;
    other arguments are exported anew."""
    exports = _model.Exports()
    exports.prepare(builder=_BUILDER, kwargs={**_SPEC, "weights": None}, input_example=_EXAMPLE)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("exported again")

    monkeypatch.setattr(torch.export, "export", broken)
    exports.prepare(builder=_BUILDER, kwargs={"weights": None, **_SPEC}, input_example=_EXAMPLE)
    with pytest.raises(RuntimeError, match="exported again"):
        exports.prepare(builder=_BUILDER, kwargs={**_SPEC, "hidden": [7], "weights": None}, input_example=_EXAMPLE)
    assert len(exports) == 1


def test_a_model_torch_export_cannot_trace_is_not_kept() -> None:
    """Preparing a model that cannot be exported raises and keeps nothing (its save pickles it as before)."""
    exports = _model.Exports()
    with pytest.raises(Exception, match="no model"):
        exports.prepare(builder=_BUILDER, kwargs={"model": "Nope", "weights": None}, input_example=_EXAMPLE)
    assert len(exports) == 0


def test_the_writer_without_a_helper_prepares_and_saves_itself(
    tracking_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer process's prepare job, with no helper, exports in the writer process; its model job then saves
    from that export (here torch.export is broken after the prepare: the model is still in the pt2 format)."""
    client = mlflow.MlflowClient(tracking_uri)
    experiment = client.create_experiment("model-ahead", artifact_location=(tmp_path / "artifacts").as_uri())
    run_id = client.create_run(experiment).info.run_id
    aside = _Aside({})
    request: dict[str, Any] = {"builder": _BUILDER, "kwargs": {**_SPEC, "weights": None}, "input_example": _EXAMPLE}
    logged: dict[str, str] = {}
    _job(client, run_id, {"op": "prepare", "model": request}, _Monitor(), tracking_uri, aside, logged)
    assert len(aside.exports) == 1

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("torch.export is not to run again")

    monkeypatch.setattr(torch.export, "export", broken)
    kwargs, model = _final_mlp(tmp_path)
    model_job = {"experiment_id": experiment, **request, "kwargs": kwargs, "name": "mlp"}
    _job(client, run_id, {"op": "model", "model": model_job}, _Monitor(), tracking_uri, aside, logged)
    [found] = client.search_logged_models([experiment])
    assert str(found.status) == "READY" and logged == {"mlp": found.model_id}  # what the run's link jobs link to
    assert "model.pt2" in {Path(a.path).name for a in client.list_logged_model_artifacts(found.model_id, "data")}
    x = torch.randn(5, 8)
    assert torch.equal(mlflow.pytorch.load_model(found.artifact_location)(x), model(x))


@pytest.mark.slow
def test_a_model_saved_without_the_package_scan_is_the_same_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where MLflow's map of installed packages is not made yet, :func:`_model.skip_package_scan` has a save check
    the requirements it states without scanning every installed package, and the folder saved is the one a save
    after the scan writes (but for its time)."""
    from mlflow.utils import requirements_utils

    common = {"builder": _BUILDER, "kwargs": _final_mlp(tmp_path)[0], "description": _DESCRIPTION}
    monkeypatch.setattr(requirements_utils, "_MODULES_TO_PACKAGES", None)
    monkeypatch.setattr(requirements_utils, "_PACKAGES_TO_MODULES", None)
    _model.save_for(folder=str(tmp_path / "scanned"), input_example=_EXAMPLE, **common)
    assert requirements_utils._MODULES_TO_PACKAGES is not None  # the scan ran: many packages mapped
    scanned = requirements_utils._MODULES_TO_PACKAGES
    assert len(scanned) > 2

    scans: list[None] = []

    def scan() -> dict[str, list[str]]:  # MLflow's check swallows what it raises: counted instead
        scans.append(None)
        return dict(scanned)

    monkeypatch.setattr(requirements_utils, "_MODULES_TO_PACKAGES", None)
    monkeypatch.setattr(requirements_utils.importlib_metadata, "packages_distributions", scan)
    _model.skip_package_scan()
    _model.save_for(folder=str(tmp_path / "skipped"), input_example=_EXAMPLE, **common)
    assert scans == []
    compared = filecmp.dircmp(tmp_path / "skipped", tmp_path / "scanned")
    assert compared.left_only == compared.right_only == []
    assert compared.diff_files == ["MLmodel"]
    requirements = (tmp_path / "skipped/requirements.txt").read_text().split()
    assert requirements == _model.requirements()


def test_a_package_map_made_already_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`_model.skip_package_scan` keeps the map of installed packages MLflow has made already."""
    from mlflow.utils import requirements_utils

    made = {"numpy": ["numpy"], "mlflow": ["mlflow"], "torch": ["torch"]}
    monkeypatch.setattr(requirements_utils, "_MODULES_TO_PACKAGES", made)
    _model.skip_package_scan()
    assert requirements_utils._MODULES_TO_PACKAGES is made
