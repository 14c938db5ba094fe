"""Tests of flasync.training.residuals: per-client error-feedback residuals, bounded in memory, spilled to disk."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flasync.core.errors import FlasyncError
from flasync.training.residuals import ResidualCapacityError, ResidualStore

N = 16
BYTES_PER_RESIDUAL = 4 * N


def _residual(seed: int, n: int = N) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _same_bits(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and a.dtype == torch.float32 and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _spill_files(store: ResidualStore) -> list[Path]:
    folder = store.spill_folder
    return [] if folder is None else sorted(folder.glob("*.f32"))  # (the folder also holds its owner marker)


# ------------------------------------------------------------------------------------------- in memory
def test_get_of_unknown_client_is_none() -> None:
    """A client that never stored a residual has none."""
    store = ResidualStore(N)
    assert store.get(3) is None
    assert store.norm(3) is None
    assert len(store) == 0


def test_put_then_get_round_trips_bit_exactly() -> None:
    """``get`` returns the bits ``put`` stored, NaN payloads and -0.0 included."""
    store = ResidualStore(4)
    residual = torch.tensor([0x7FC00001, -(2**31), 1, -1], dtype=torch.int32).view(torch.float32)
    store.put(7, residual)
    assert _same_bits(store.get(7), residual)
    assert len(store) == 1


def test_put_copies_and_get_returns_a_copy() -> None:
    """Changing the tensor given to ``put`` or returned by ``get`` leaves the stored residual unchanged."""
    store = ResidualStore(N)
    residual = _residual(0)
    store.put(1, residual)
    residual.zero_()
    got = store.get(1)
    assert got is not None
    got.fill_(5.0)
    assert _same_bits(store.get(1), _residual(0))


def test_put_replaces_the_previous_residual() -> None:
    """A second ``put`` for a client replaces its residual."""
    store = ResidualStore(N)
    store.put(1, _residual(0))
    store.put(1, _residual(1))
    assert _same_bits(store.get(1), _residual(1))
    assert len(store) == 1


def test_norm_is_the_l2_norm() -> None:
    """``norm`` is the Euclidean norm of the stored residual."""
    store = ResidualStore(2)
    store.put(0, torch.tensor([3.0, 4.0]))
    assert store.norm(0) == pytest.approx(5.0)


@pytest.mark.parametrize("shape", [(N - 1,), (N + 1,), (2, N // 2)])
def test_put_rejects_a_residual_of_another_shape(shape: tuple[int, ...]) -> None:
    """A residual that is not a vector of ``num_elements`` values is a ValueError."""
    with pytest.raises(ValueError, match=str(N)):
        ResidualStore(N).put(0, torch.zeros(shape))


def test_memory_bytes_count_in_memory_residuals() -> None:
    """``memory_bytes`` is 4 n bytes per residual held in memory; ``disk_bytes`` is 0 without spilling."""
    store = ResidualStore(N)
    for client in range(3):
        store.put(client, _residual(client))
    assert store.memory_bytes == 3 * BYTES_PER_RESIDUAL
    assert store.disk_bytes == 0


# ----------------------------------------------------------------------------------------- bound
def test_without_spill_dir_exceeding_the_bound_raises() -> None:
    """Without a spill folder, a residual for one client too many is a ResidualCapacityError saying how to fix it."""
    store = ResidualStore(N, max_in_memory=2)
    store.put(0, _residual(0))
    store.put(1, _residual(1))
    with pytest.raises(ResidualCapacityError, match=r"max_in_memory=2.*raise max_in_memory.*spill_dir") as caught:
        store.put(2, _residual(2))
    assert isinstance(caught.value, FlasyncError)
    assert len(store) == 2
    assert store.get(2) is None


def test_without_spill_dir_updating_a_held_client_at_the_bound_is_fine() -> None:
    """At the bound, replacing the residual of a client already held needs no room and does not raise."""
    store = ResidualStore(N, max_in_memory=1)
    store.put(0, _residual(0))
    store.put(0, _residual(1))
    assert _same_bits(store.get(0), _residual(1))


@pytest.mark.parametrize(("num_elements", "max_in_memory"), [(-1, 1), (N, 0)])
def test_constructor_rejects_invalid_sizes(num_elements: int, max_in_memory: int) -> None:
    """A negative length or a bound below 1 is a ValueError."""
    with pytest.raises(ValueError, match="at least"):
        ResidualStore(num_elements, max_in_memory=max_in_memory)


# ------------------------------------------------------------------------------------------- spilling
def test_lru_eviction_spills_and_loads_back_bit_exactly(tmp_path: Path) -> None:
    """The least recently used residual goes to disk past the bound and reads back bit for bit."""
    store = ResidualStore(N, max_in_memory=2, spill_dir=tmp_path)
    for client in range(3):
        store.put(client, _residual(client))
    assert (store.spills, store.loads) == (1, 0)
    assert store.memory_bytes == 2 * BYTES_PER_RESIDUAL
    assert store.disk_bytes == BYTES_PER_RESIDUAL
    assert len(store) == 3
    assert _same_bits(store.get(0), _residual(0))
    assert store.loads == 1


def test_spill_file_is_raw_little_endian_float32(tmp_path: Path) -> None:
    """A spilled residual is a file of exactly n little-endian float32 values, no pickle or header."""
    store = ResidualStore(N, max_in_memory=1, spill_dir=tmp_path)
    store.put(0, _residual(0))
    store.put(1, _residual(1))
    [path] = _spill_files(store)
    assert path.stat().st_size == BYTES_PER_RESIDUAL
    assert np.array_equal(np.fromfile(path, dtype="<f4"), _residual(0).numpy())


def test_get_refreshes_recency(tmp_path: Path) -> None:
    """A residual read with ``get`` becomes the most recently used, so another one is spilled first."""
    store = ResidualStore(N, max_in_memory=2, spill_dir=tmp_path)
    store.put(0, _residual(0))
    store.put(1, _residual(1))
    store.get(0)
    store.put(2, _residual(2))
    assert store.get(1) is not None
    assert store.loads == 1  # client 1 was the one on disk


def test_put_of_a_spilled_client_deletes_its_file(tmp_path: Path) -> None:
    """Storing a new residual for a spilled client brings it into memory and deletes its stale file."""
    store = ResidualStore(N, max_in_memory=1, spill_dir=tmp_path)
    store.put(0, _residual(0))
    store.put(1, _residual(1))
    store.put(0, _residual(2))
    assert [path.name for path in _spill_files(store)] == ["1.f32"]
    assert store.disk_bytes == BYTES_PER_RESIDUAL
    assert _same_bits(store.get(0), _residual(2))
    assert store.loads == 0


def test_memory_bound_is_honoured(tmp_path: Path) -> None:
    """However many clients store residuals, memory never holds more than ``max_in_memory`` of them."""
    store = ResidualStore(N, max_in_memory=3, spill_dir=tmp_path)
    for client in range(20):
        store.put(client, _residual(client))
        assert store.memory_bytes <= 3 * BYTES_PER_RESIDUAL
    assert store.disk_bytes == 17 * BYTES_PER_RESIDUAL
    assert len(store) == 20


def test_spill_dir_is_created_if_missing(tmp_path: Path) -> None:
    """A spill folder that does not exist yet is created."""
    folder = tmp_path / "a" / "b"
    ResidualStore(N, spill_dir=folder)
    assert folder.is_dir()


def test_close_removes_spill_files_and_a_folder_it_created(tmp_path: Path) -> None:
    """``close`` deletes the spill files and the folders the store made, and forgets every residual."""
    folder = tmp_path / "spill"
    store = ResidualStore(N, max_in_memory=1, spill_dir=folder)
    for client in range(4):
        store.put(client, _residual(client))
    assert len(_spill_files(store)) == 3
    store.close()
    assert not folder.exists()
    assert len(store) == 0
    assert store.get(0) is None


def test_close_keeps_a_spill_dir_that_already_existed(tmp_path: Path) -> None:
    """``close`` leaves a spill folder it did not create, and whatever else is in it."""
    (tmp_path / "other.txt").write_text("keep me")
    with ResidualStore(N, max_in_memory=1, spill_dir=tmp_path) as store:
        store.put(0, _residual(0))
        store.put(1, _residual(1))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["other.txt"]


# ---------------------------------------------------------------------------------------------- model
_OPS = st.lists(
    st.tuples(st.sampled_from(["get", "put", "norm"]), st.integers(0, 6), st.integers(0, 2**16)),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ops=_OPS, max_in_memory=st.integers(1, 4), spill=st.booleans())
def test_store_behaves_like_a_dict(ops: list[tuple[str, int, int]], max_in_memory: int, spill: bool) -> None:
    """Random get/put/norm sequences match a dict, within the memory bound, raising only when it cannot spill."""
    with tempfile.TemporaryDirectory() as folder:
        store = ResidualStore(4, max_in_memory=max_in_memory, spill_dir=folder if spill else None)
        model: dict[int, torch.Tensor] = {}
        for op, client, seed in ops:
            if op == "put":
                residual = _residual(seed, 4)
                if not spill and client not in model and len(model) >= max_in_memory:
                    with pytest.raises(ResidualCapacityError):
                        store.put(client, residual)
                    continue
                store.put(client, residual)
                model[client] = residual
            elif op == "get":
                got = store.get(client)
                assert (got is None) if client not in model else _same_bits(got, model[client])
            else:
                expected = None if client not in model else float(torch.linalg.vector_norm(model[client]))
                assert store.norm(client) == expected
            assert len(store) == len(model)
            assert store.memory_bytes <= max_in_memory * 4 * 4
            assert store.memory_bytes + store.disk_bytes == len(model) * 4 * 4
        store.close()
        assert list(Path(folder).iterdir()) == []
