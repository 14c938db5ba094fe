"""Exports kept across processes: the weight swap into a ``pt2`` archive and the cache's keys, entries and marks."""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest
import torch

from flasync.tracking.exports import ExportCache, default_export_cache, save_from_cache, swap_weights


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    with torch.no_grad():  # statistics unlike a new model's: the buffers are swapped too
        model[1].running_mean.normal_()
        model[1].running_var.uniform_(0.5, 2.0)
        model[1].num_batches_tracked.fill_(seed + 3)
    return model.eval()


def _exported(tmp_path: Path, model: torch.nn.Module) -> tuple[Path, torch.export.ExportedProgram]:
    program = torch.export.export(model, (torch.zeros(2, 6),))
    archive = tmp_path / "exported.pt2"
    torch.export.save(program, archive)
    return archive, program


def _state(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}


@pytest.mark.slow  # each test that exports: torch.export's first trace in a process takes seconds
def test_swapped_weights_load_back_as_the_other_models(tmp_path: Path) -> None:
    """An archive with another model's weights swapped in loads (torch.export.load) as that model: the same
    parameters and buffers, the same outputs."""
    archive, _ = _exported(tmp_path, _model(0))
    other = _model(1)
    assert swap_weights(archive, tmp_path / "swapped.pt2", _state(other))
    loaded = torch.export.load(tmp_path / "swapped.pt2")
    for name, tensor in other.state_dict().items():
        assert torch.equal(loaded.state_dict[name], tensor)
    x = torch.randn(2, 6)
    assert torch.equal(loaded.module()(x), other(x))


_CHANGES = {
    "missing": (lambda s: {k: v for k, v in s.items() if k != "3.bias"}, False),
    "unknown": (lambda s: {**s, "extra": np.zeros(2, np.float32)}, False),
    "shape": (lambda s: {**s, "3.bias": np.zeros(4, np.float32)}, False),
    "dtype": (lambda s: {**s, "3.bias": s["3.bias"].astype(np.float64)}, False),
    "fortran-order": (lambda s: {**s, "0.weight": np.asfortranarray(s["0.weight"])}, True),
}


@pytest.mark.slow
@pytest.mark.parametrize("change", list(_CHANGES))
def test_a_swap_refuses_weights_that_do_not_fit(tmp_path: Path, change: str) -> None:
    """Weights whose names, shapes or dtypes differ from the archive's are refused and nothing is written; the same
    values in another memory order are written as the archive lays them out."""
    archive, _ = _exported(tmp_path, _model(0))
    state = _state(_model(1))
    alter, fits = _CHANGES[change]
    assert swap_weights(archive, tmp_path / "swapped.pt2", alter(state)) == fits
    assert (tmp_path / "swapped.pt2").exists() == fits
    if fits:
        loaded = torch.export.load(tmp_path / "swapped.pt2")
        assert torch.equal(loaded.state_dict["0.weight"], torch.from_numpy(state["0.weight"]))


@pytest.mark.slow
def test_a_swap_refuses_an_archive_with_constants(tmp_path: Path) -> None:
    """A model whose export holds constants (a non-persistent buffer) is refused: the swap knows only weights."""
    model = _model(0)
    model.register_buffer("scale", torch.ones(3), persistent=False)
    model.forward = lambda x: torch.nn.Sequential.forward(model, x) * model.scale  # type: ignore[method-assign]
    archive, _ = _exported(tmp_path, model)
    assert not swap_weights(archive, tmp_path / "swapped.pt2", _state(model))
    assert not (tmp_path / "swapped.pt2").exists()


@pytest.mark.slow
def test_a_kept_export_is_found_by_its_key_and_saved_with_new_weights(tmp_path: Path) -> None:
    """put() keeps an export (its files and archive) once a swap into it reads back; get() finds it by the key;
    save_from_cache() writes its folder with other weights."""
    model = _model(0)
    archive, program = _exported(tmp_path, model)
    cache = ExportCache(tmp_path / "cache")
    key = cache.key("pkg.mod:build", {"width": 5, "weights": None}, [[0.0] * 6] * 2, "float32")
    assert cache.get(key) is None
    assert cache.put(key, {"MLmodel": b"flavors: {}\n", "meta/a.txt": b"a"}, "data/model.pt2", str(archive), program)
    entry = cache.get(key)
    assert entry is not None
    other = _model(2)
    saved = tmp_path / "saved"
    assert save_from_cache(entry, _state(other), saved)
    assert (saved / "MLmodel").read_bytes() == b"flavors: {}\n" and (saved / "meta" / "a.txt").read_bytes() == b"a"
    x = torch.randn(2, 6)
    assert torch.equal(torch.export.load(saved / "data" / "model.pt2").module()(x), other(x))
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [key]  # no staging folder left


def test_the_key_leaves_out_the_weights_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two models of one builder differing in their weights' file share a key; another argument, builder, example,
    example dtype or Python (which the saved folder names as the one to serve it with) makes another key."""
    key = ExportCache.key
    example = [[0.0, 1.0]]
    base = key("pkg.mod:build", {"width": 5, "weights": "a.npy"}, example, "float32")
    assert key("pkg.mod:build", {"width": 5, "weights": "b.npy"}, example, "float32") == base
    others = [
        key("pkg.mod:build", {"width": 6, "weights": "a.npy"}, example, "float32"),
        key("pkg.mod:other", {"width": 5, "weights": "a.npy"}, example, "float32"),
        key("pkg.mod:build", {"width": 5, "weights": "a.npy"}, [[0.0, 2.0]], "float32"),
        key("pkg.mod:build", {"width": 5, "weights": "a.npy"}, example, "float64"),
    ]
    monkeypatch.setattr(platform, "python_version", lambda: "3.99.0")
    others.append(key("pkg.mod:build", {"width": 5, "weights": "a.npy"}, example, "float32"))
    assert base not in others and len(set(others)) == len(others)


@pytest.mark.slow
def test_a_mark_counts_only_while_its_export_is_kept(tmp_path: Path) -> None:
    """marked() is True for a hint marked with a key whose export is kept, False for an unknown hint or an export
    gone since."""
    model = _model(0)
    archive, program = _exported(tmp_path, model)
    cache = ExportCache(tmp_path / "cache")
    cache.mark("config a", "no-such-key")
    assert not cache.marked("config a") and not cache.marked("config b")
    assert cache.put("k", {"MLmodel": b"x"}, "data/model.pt2", str(archive), program)
    cache.mark("config a", "k")
    assert cache.marked("config a") and not cache.marked("config b")
    (tmp_path / "cache" / "k" / "export.json").unlink()
    assert not cache.marked("config a")


def test_the_default_cache_is_under_the_users_cache_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default cache folder is $XDG_CACHE_HOME/flasync/model-exports."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_export_cache() == tmp_path / "flasync" / "model-exports"
