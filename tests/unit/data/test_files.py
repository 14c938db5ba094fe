"""Your own data from files: .npz / .pt / .csv / .parquet loading, one-line errors, by_column runs end to end."""

from __future__ import annotations

import csv
import hashlib
import os
import re
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import flasync
from flasync.cli import main
from flasync.config import FILE_FORMATS, load_config
from flasync.core.errors import ConfigError, DataError
from flasync.data.files import FORMATS, load_files
from flasync.runtime import checkpoint
from flasync.runtime.prepare import RunInputs
from flasync.testing import MemoryTracker, small_config
from tests.conftest import EXAMPLES

# 60 samples of 3 features, 3 classes, 4 users of 30, 15, 10 and 5 samples (ids not in sorted order in the file).
_USERS = np.array(["carol"] * 30 + ["alice"] * 15 + ["dave"] * 10 + ["bob"] * 5)
_RNG = np.random.default_rng(0)
_X = _RNG.standard_normal((60, 3)).astype(np.float32)
_Y = np.arange(60, dtype=np.int64) % 3


def _write_csv(path: Path, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> Path:
    with path.open("w", newline="") as stream:
        writer = csv.writer(stream)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def _table(path: Path, users: np.ndarray = _USERS, x: np.ndarray = _X, y: np.ndarray = _Y) -> Path:
    """Write a LEAF-style table: user, label, f0..f2."""
    rows = [[u, int(label), *(repr(float(v)) for v in feats)] for u, label, feats in zip(users, y, x, strict=True)]
    return _write_csv(path, ["user", "label", "f0", "f1", "f2"], rows)


def _one_line(error: pytest.ExceptionInfo[Exception], *parts: str) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    for part in parts:
        assert part in message, message
    return message


def _refused(*parts: str, **kwargs: Any) -> str:
    """Load files expecting a DataError whose one-line message contains every part."""
    with pytest.raises(DataError) as error:
        load_files(**kwargs)
    return _one_line(error, *parts)


# ------------------------------------------------------------------------------------------------------- formats
def test_the_config_and_the_loader_read_the_same_formats() -> None:
    """The suffixes the config accepts are the ones the loader reads, and text (flasync.data.text reads it)."""
    assert (*FORMATS, ".txt") == FILE_FORMATS and FORMATS == (".npz", ".pt", ".csv", ".parquet")


def test_npz_arrays_keep_their_shape_and_become_float32(tmp_path: Path) -> None:
    """An .npz of x (N, 2, 3) uint8 and y int32 loads as float32 features of that shape and int64 labels."""
    x = np.arange(60 * 6, dtype=np.uint8).reshape(60, 2, 3)
    np.savez(tmp_path / "d.npz", x=x, y=_Y.astype(np.int32), extra=np.zeros(3))
    data = load_files(tmp_path / "d.npz")
    assert data.train.x.dtype == torch.float32 and data.train.feature_shape == (2, 3)
    assert torch.equal(data.train.x, torch.from_numpy(x.astype(np.float32)))
    assert data.train.y.tolist() == _Y.tolist() and data.train.num_classes == 3
    assert data.test is None and data.clients is None and data.classes is None


def test_pt_dict_of_tensors_loads(tmp_path: Path) -> None:
    """A .pt dict of tensors loads, with a client tensor of integer ids, renamed keys and a given num_classes."""
    users = torch.tensor([7, 3, 7, 5] * 15)
    torch.save({"feats": torch.from_numpy(_X).half(), "target": torch.from_numpy(_Y), "uid": users}, tmp_path / "d.pt")
    data = load_files(tmp_path / "d.pt", features=["feats"], label="target", client_column="uid", num_classes=5)
    assert data.train.num_classes == 5
    assert torch.allclose(data.train.x, torch.from_numpy(_X), atol=1e-2)
    assert data.client_ids == (3, 5, 7)
    assert data.clients is not None and data.clients[:4].tolist() == [2, 0, 2, 1]


def test_csv_with_text_users_and_all_other_columns_as_features(tmp_path: Path) -> None:
    """A CSV's features default to every column but the label and client columns; clients are sorted by value."""
    data = load_files(_table(tmp_path / "d.csv"), label="label", client_column="user")
    assert data.train.feature_shape == (3,)
    assert torch.equal(data.train.x, torch.from_numpy(_X))  # repr() round-trips float32 exactly
    assert data.client_ids == ("alice", "bob", "carol", "dave")
    assert data.clients is not None
    assert np.bincount(data.clients).tolist() == [15, 5, 30, 10]
    assert data.clients[0] == 2  # the file starts with carol's samples


def test_csv_feature_columns_can_be_chosen_and_numeric_user_ids_sort_as_numbers(tmp_path: Path) -> None:
    """Named feature columns are read in the given order; user ids that read as integers sort numerically."""
    rows = [[10, 0, 1.0, 2.0], [9, 1, 3.0, 4.0], [10, 1, 5.0, 6.0]]
    path = _write_csv(tmp_path / "d.csv", ["user", "y", "a", "b"], rows)
    data = load_files(path, features=["b", "a"], client_column="user")
    assert data.train.x.tolist() == [[2.0, 1.0], [4.0, 3.0], [6.0, 5.0]]
    assert data.client_ids == (9, 10) and data.clients is not None and data.clients.tolist() == [1, 0, 1]


def test_text_labels_map_to_sorted_class_ids_over_train_and_test(tmp_path: Path) -> None:
    """Text labels become class ids in sorted order of the labels of both files; whole-number floats are ids."""
    train = _write_csv(tmp_path / "train.csv", ["y", "a"], [["dog", 1], ["cat", 2], ["dog", 3]])
    test = _write_csv(tmp_path / "test.csv", ["y", "a"], [["eel", 1], ["cat", 2]])
    data = load_files(train, test)
    assert data.classes == ("cat", "dog", "eel") and data.train.num_classes == 3
    assert data.train.y.tolist() == [1, 0, 1]
    assert data.test is not None and data.test.y.tolist() == [2, 0]
    floats = _write_csv(tmp_path / "f.csv", ["y", "a"], [["2.0", 1], ["0", 2]])
    assert load_files(floats).train.y.tolist() == [2, 0]


def test_parquet_loads(tmp_path: Path) -> None:
    """A Parquet table with a text user column and a categorical one loads like the CSV."""
    import pyarrow as pa  # in the dev extra: these tests must not skip
    import pyarrow.parquet as pq

    table = pa.table({"user": pa.array(_USERS).dictionary_encode(), "label": _Y, "f0": _X[:, 0], "f1": _X[:, 1]})
    pq.write_table(table, tmp_path / "d.parquet")
    data = load_files(tmp_path / "d.parquet", label="label", client_column="user")
    assert torch.equal(data.train.x, torch.from_numpy(_X[:, :2]))
    assert data.client_ids == ("alice", "bob", "carol", "dave")


def test_digest_is_the_sha256_of_the_files_bytes(tmp_path: Path) -> None:
    """The digest is sha256 of the training file's bytes, then the test file's."""
    train, test = _table(tmp_path / "a.csv"), _table(tmp_path / "b.csv", x=_X + 1)
    assert (
        load_files(train, label="label", client_column="user").sha256 == hashlib.sha256(train.read_bytes()).hexdigest()
    )
    both = hashlib.sha256(train.read_bytes() + test.read_bytes()).hexdigest()
    assert load_files(train, test, label="label", client_column="user").sha256 == both


def test_a_test_file_needs_no_client_column(tmp_path: Path) -> None:
    """The test file is read without its client column, and need not have one."""
    train = _table(tmp_path / "train.csv")
    test = _write_csv(tmp_path / "test.csv", ["label", "f0", "f1", "f2"], [[1, 0.5, 0.5, 0.5]])
    data = load_files(train, test, label="label", client_column="user")
    assert data.test is not None and data.test.x.tolist() == [[0.5, 0.5, 0.5]]


# -------------------------------------------------------------------------------------------------------- errors
def test_missing_file_names_it_and_the_field(tmp_path: Path) -> None:
    """A missing training or test file is named, with its config field."""
    _refused("nope.csv: file not found (data.train)", train=tmp_path / "nope.csv")
    table = _table(tmp_path / "d.csv")
    _refused("gone.csv: file not found (data.test)", train=table, test=tmp_path / "gone.csv", label="label")


def test_a_missing_relative_file_says_the_working_folder_it_was_looked_for_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative path (``--set data.train=...``: a config file's are made absolute) is looked for in the working
    folder, and the error says which."""
    monkeypatch.chdir(tmp_path)
    _refused(
        f"nope.csv: file not found (data.train, looked for in the working folder {tmp_path})", train=Path("nope.csv")
    )


def test_unknown_suffix_is_refused(tmp_path: Path) -> None:
    """A suffix that is not a known format is refused before the file is opened."""
    (tmp_path / "d.json").write_text("{}")
    _refused("d.json: unsupported format '.json'", ".npz, .pt, .csv, .parquet", train=tmp_path / "d.json")


@pytest.mark.parametrize("suffix", FORMATS)
def test_empty_file_is_refused(tmp_path: Path, suffix: str) -> None:
    """A file of 0 bytes, of any format, is refused as empty."""
    (tmp_path / f"d{suffix}").write_bytes(b"")
    _refused(f"d{suffix}: the file is empty (data.train)", train=tmp_path / f"d{suffix}")


def test_csv_with_a_header_and_no_rows_has_no_samples(tmp_path: Path) -> None:
    """A CSV with only its header row has no samples."""
    _refused("d.csv: no samples", train=_write_csv(tmp_path / "d.csv", ["y", "a"], []))


def test_missing_array_lists_what_the_file_holds(tmp_path: Path) -> None:
    """A missing .npz key names the config field and lists the keys present."""
    np.savez(tmp_path / "d.npz", x=_X, label=_Y)
    _refused("d.npz: no array 'y' (data.label); it holds 'x', 'label'", train=tmp_path / "d.npz")
    _refused("no array 'user' (data.client_column)", train=tmp_path / "d.npz", label="label", client_column="user")


def test_missing_column_lists_the_columns(tmp_path: Path) -> None:
    """A missing CSV column names the config field and lists the header."""
    path = _table(tmp_path / "d.csv")
    _refused("d.csv: no column 'y' (data.label); columns: 'user', 'label', 'f0'", train=path)
    _refused("no column 'f9' (data.features)", train=path, label="label", features=["f0", "f9"])
    _refused("no column 'uid' (data.client_column)", train=path, label="label", client_column="uid")


def test_non_numeric_feature_names_column_and_row(tmp_path: Path) -> None:
    """A feature cell that is not a number names the column and the data row."""
    path = _write_csv(tmp_path / "d.csv", ["y", "a", "b"], [[0, 1, 2], [1, 3, "n/a"]])
    _refused("d.csv: feature column 'b' is not numeric ('n/a' in data row 2)", train=path)


def test_text_features_in_an_npz_are_refused(tmp_path: Path) -> None:
    """A text feature array is refused with its dtype."""
    np.savez(tmp_path / "d.npz", x=np.array([["a"], ["b"]]), y=np.array([0, 1]))
    _refused("d.npz: array 'x' must hold numbers; got dtype <U1", train=tmp_path / "d.npz")


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "1e39"])
def test_non_finite_feature_is_refused(tmp_path: Path, bad: str) -> None:
    """NaN, infinities and values beyond float32 in a CSV are refused, naming column and row."""
    path = _write_csv(tmp_path / "d.csv", ["y", "a", "b"], [[0, 1, 2], [1, bad, 4]])
    _refused("d.csv: features has a non-finite value", "column 'a', data row 2", train=path)


def test_nan_in_npz_features_names_the_index(tmp_path: Path) -> None:
    """A NaN in an .npz feature array names the sample's index."""
    x = _X.copy()
    x[7, 1] = np.nan
    np.savez(tmp_path / "d.npz", x=x, y=_Y)
    _refused("d.npz: array 'x' has a non-finite value (nan at index 7", train=tmp_path / "d.npz")


def test_label_out_of_range_of_num_classes(tmp_path: Path) -> None:
    """A label >= num_classes names the file, the value and where it is."""
    np.savez(tmp_path / "d.npz", x=_X, y=_Y)
    _refused(
        "d.npz: label 'y' is out of range (2 at index 2; data.num_classes = 2)", train=tmp_path / "d.npz", num_classes=2
    )


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        (np.array([0.0, 1.5]), "label 'y' is not an integer class id (1.5 at index 1)"),
        (np.array([0, -1]), "label 'y' is negative (-1 at index 1)"),
        (np.array([True, False]), "label 'y' must hold integer class ids; got dtype bool"),
        (np.array([[0], [1]]), "label 'y' must be 1-d; got shape (2, 1)"),
    ],
    ids=["fraction", "negative", "bool", "2-d"],
)
def test_labels_must_be_integer_class_ids(tmp_path: Path, labels: np.ndarray, expected: str) -> None:
    """Fractional, negative, boolean and 2-d labels are refused."""
    np.savez(tmp_path / "d.npz", x=np.zeros((2, 1)), y=labels)
    _refused(f"d.npz: {expected}", train=tmp_path / "d.npz")


def test_csv_label_mixing_numbers_and_text_is_refused(tmp_path: Path) -> None:
    """A label column of numbers with one text cell is refused rather than sorted as text."""
    path = _write_csv(tmp_path / "d.csv", ["y", "a"], [[0, 1], [1, 2], ["cat", 3]])
    _refused("d.csv: label 'y' mixes numbers and text ('cat' in data row 3)", train=path)


def test_text_in_one_file_and_numbers_in_the_other_are_refused(tmp_path: Path) -> None:
    """Text labels in the test file and numbers in the training file are refused."""
    train = _write_csv(tmp_path / "train.csv", ["y", "a"], [[0, 1], [1, 2]])
    test = _write_csv(tmp_path / "test.csv", ["y", "a"], [["cat", 1]])
    _refused("test.csv: label 'y' is text, but in", "train.csv numbers", train=train, test=test)


def test_too_many_text_classes_for_num_classes(tmp_path: Path) -> None:
    """More distinct text labels than num_classes is refused."""
    path = _write_csv(tmp_path / "d.csv", ["y", "a"], [["a", 1], ["b", 2], ["c", 3]])
    _refused("label 'y' has 3 distinct values, but data.num_classes = 2", train=path, num_classes=2)


def test_length_mismatch_between_features_and_labels(tmp_path: Path) -> None:
    """Arrays of different lengths are refused with the lengths."""
    np.savez(tmp_path / "d.npz", x=_X, y=_Y[:-1], u=np.arange(60))
    _refused("d.npz: arrays of different lengths (60 features, 59 labels)", train=tmp_path / "d.npz")
    _refused("(60 features, 59 labels, 60 clients)", train=tmp_path / "d.npz", client_column="u")


def test_ragged_csv_row_names_its_line(tmp_path: Path) -> None:
    """A CSV row with a different number of fields than the header names its line."""
    (tmp_path / "d.csv").write_text("y,a,b\n0,1,2\n1,3\n")
    _refused("d.csv: line 3 has 2 fields, the header has 3", train=tmp_path / "d.csv")


def test_duplicate_csv_column_is_refused(tmp_path: Path) -> None:
    """A header naming a column twice is refused."""
    (tmp_path / "d.csv").write_text("y,a,a\n0,1,2\n")
    _refused("d.csv: column 'a' appears twice in the header", train=tmp_path / "d.csv")


def test_test_file_of_another_feature_shape_is_refused(tmp_path: Path) -> None:
    """A test file whose samples differ in shape from the training file's is refused."""
    np.savez(tmp_path / "a.npz", x=_X, y=_Y)
    np.savez(tmp_path / "b.npz", x=_X[:, :2], y=_Y)
    _refused("b.npz: samples of shape (2,), but", "a.npz has (3,)", train=tmp_path / "a.npz", test=tmp_path / "b.npz")


def test_pickled_npz_is_refused(tmp_path: Path) -> None:
    """An .npz whose array holds Python objects is refused without unpickling it."""
    np.savez(tmp_path / "d.npz", x=np.array([{"a": 1}, None], dtype=object), y=np.array([0, 1]))
    _refused("d.npz: array 'x' holds Python objects", "allow_pickle=False", train=tmp_path / "d.npz")


def test_a_pickle_named_npz_is_refused(tmp_path: Path) -> None:
    """A plain pickle saved as .npz is refused (numpy would have to unpickle it)."""
    import pickle

    (tmp_path / "d.npz").write_bytes(pickle.dumps({"x": [1.0], "y": [0]}))
    _refused("d.npz: not a .npz archive of arrays", train=tmp_path / "d.npz")


class _MakesAFolder:
    """A pickle that calls os.mkdir when it is loaded without weights_only."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.mkdir, (str(self.path),)


def test_pt_with_non_tensor_content_is_refused_by_weights_only(tmp_path: Path) -> None:
    """A .pt file holding an object that runs code when unpickled is refused by weights_only=True; nothing runs."""
    marker = tmp_path / "ran"
    payload = {"x": torch.zeros(2, 1), "y": torch.zeros(2, dtype=torch.int64), "meta": _MakesAFolder(marker)}
    torch.save(payload, tmp_path / "d.pt")
    _refused("d.pt: holds a Python object (posix.mkdir)", "flasync does not unpickle", train=tmp_path / "d.pt")
    assert not marker.exists()


def test_broken_binary_files_never_suggest_unsafe_loading(tmp_path: Path) -> None:
    """Random bytes as .pt or .npz: a plain one-line error, without torch's or numpy's advice to unpickle."""
    for name in ("g.pt", "g.npz"):
        (tmp_path / name).write_bytes(b"\x80\x02 not an archive " * 8)
        message = _refused(name, train=tmp_path / name)
        assert "\x1b" not in message
        assert "weights_only" not in message and "allow_pickle" not in message and "trust" not in message


def test_pt_entries_must_be_tensors_in_a_dict(tmp_path: Path) -> None:
    """A .pt file of a bare tensor, or whose entry is a list, is refused."""
    torch.save(torch.zeros(3), tmp_path / "t.pt")
    _refused("t.pt: holds a Tensor; save a dict of tensors", train=tmp_path / "t.pt")
    torch.save({"x": [[1.0], [2.0]], "y": torch.tensor([0, 1])}, tmp_path / "l.pt")
    _refused("l.pt: 'x' holds a list, not a tensor", train=tmp_path / "l.pt")


def test_garbage_pt_is_refused(tmp_path: Path) -> None:
    """Bytes that are not a torch file are refused in one line."""
    (tmp_path / "d.pt").write_bytes(b"not a torch file at all")
    _refused("d.pt:", train=tmp_path / "d.pt")


def test_client_column_must_be_integers_or_text(tmp_path: Path) -> None:
    """Float client ids, and empty ones in a CSV, are refused."""
    np.savez(tmp_path / "d.npz", x=_X, y=_Y, u=np.linspace(0, 1, 60))
    _refused(
        "client column 'u' must hold integers or text; got dtype float64", train=tmp_path / "d.npz", client_column="u"
    )
    path = _write_csv(tmp_path / "d.csv", ["u", "y", "a"], [["a", 0, 1], ["", 1, 2]])
    _refused("d.csv: client column 'u' is empty in data row 2", train=path, client_column="u")


def test_parquet_with_missing_values_is_refused(tmp_path: Path) -> None:
    """A Parquet feature column with nulls is refused, naming the first null's row."""
    import pyarrow as pa  # in the dev extra: these tests must not skip
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"y": [0, 1, 1], "a": [1.0, None, 2.0]}), tmp_path / "d.parquet")
    _refused(
        "d.parquet: column 'a' has type double with 1 missing values (first in data row 2)",
        train=tmp_path / "d.parquet",
    )


def test_parquet_without_pyarrow_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without pyarrow a .parquet file is refused with the pip command that fixes it."""
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    _refused("d.parquet: reading .parquet needs pyarrow: pip install pyarrow", train=tmp_path / "d.parquet")


# ------------------------------------------------------------------------------------------------ runs end to end
def _files_config(path: Path, *overrides: str, **sections: Any) -> flasync.RunConfig:
    defaults: dict[str, Any] = {
        "data": {"kind": "files", "label": "label", "client_column": "user"},
        "partition": {"kind": "by_column"},
        "population": {"speed": {"kind": "lognormal", "sigma": 0.5}},
        "server": {"kind": "fedbuff", "buffer_size": 2, "concurrency": 3},
    }
    return small_config(f"data.train={path}", *overrides, **{**defaults, **sections})


def _leaf_table(path: Path, users: int = 6, per_user: int = 20) -> Path:
    """Write a LEAF-style table: `users` users holding `per_user` samples each, interleaved in the file."""
    rng = np.random.default_rng(1)
    n = users * per_user
    y = rng.integers(0, 3, size=n)
    x = rng.standard_normal((n, 3)).astype(np.float32)
    x[np.arange(n), y] += 2.0
    ids = np.array([f"user{k:02d}" for k in np.arange(n) % users])
    return _table(path, users=ids, x=x, y=y)


def test_by_column_takes_the_population_from_the_data(tmp_path: Path) -> None:
    """by_column gives one client per user, in sorted order; the run's config says how many; params log it."""
    tracker = MemoryTracker()
    summary = flasync.run(_files_config(_leaf_table(tmp_path / "leaf.csv")), tracker=tracker)
    assert summary.versions == 12
    assert tracker.params["population.num_clients"] == 6
    assert tracker.params["partition.kind"] == "by_column"
    assert tracker.params["data.client_column"] == "user"
    (record,) = tracker.datasets
    assert record["name"] == "leaf"
    assert record["digest"] == hashlib.sha256((tmp_path / "leaf.csv").read_bytes()).hexdigest()[:16]
    assert record["source"] == str(tmp_path / "leaf.csv")
    # 20 per user, a fifth held out per user (LEAF's per-user split): 16 training samples each.
    assert (record["profile"]["clients"], record["profile"]["rows"], record["profile"]["test_rows"]) == (6, 96, 24)
    assert tracker.run_name is not None and tracker.run_name.startswith("fedbuff-leaf-seed0-")
    prepared = RunInputs(_files_config(tmp_path / "leaf.csv")).prepare()
    assert prepared.partition.sizes.tolist() == [16] * 6
    assert len(prepared.test) == 24


async def test_federation_config_is_resolved_by_the_run(tmp_path: Path) -> None:
    """After run(), Federation.config holds the population size taken from the data."""
    federation = flasync.Federation(_files_config(_leaf_table(tmp_path / "leaf.csv", users=5)))
    assert federation.config.population.num_clients == 100  # not known before the data is read
    await federation.run()
    assert federation.config.population.num_clients == 5


def test_by_column_num_clients_must_match_when_given(tmp_path: Path) -> None:
    """A population.num_clients that differs from the data's clients is a one-line error saying what to set."""
    path = _leaf_table(tmp_path / "leaf.csv")
    assert flasync.run(_files_config(path, "population.num_clients=6")).versions == 12
    with pytest.raises(ConfigError) as error:
        flasync.run(_files_config(path, "population.num_clients=8"))
    _one_line(error, "population.num_clients: 8, but data.client_column 'user' of", "gives 6 clients; set 6")


def test_checks_against_the_population_apply_to_the_data_clients(tmp_path: Path) -> None:
    """Concurrency above the number of clients in the data is refused, saying where that number comes from."""
    with pytest.raises(ConfigError) as error:
        flasync.run(_files_config(_leaf_table(tmp_path / "leaf.csv"), "server.concurrency=7"))
    _one_line(error, "server.concurrency: must be <= population.num_clients (6)", "data.client_column 'user'")


def test_min_samples_drops_small_clients(tmp_path: Path) -> None:
    """Users with fewer training samples than partition.min_samples are not clients."""
    path = _table(tmp_path / "d.csv")  # carol 30, alice 15, dave 10, bob 5 -> 24, 12, 8, 4 for training
    tracker = MemoryTracker()
    flasync.run(_files_config(path, "partition.min_samples=8", "server.concurrency=2"), tracker=tracker)
    assert tracker.params["population.num_clients"] == 3
    assert tracker.datasets[0]["profile"]["rows"] == 24 + 12 + 8


def test_every_client_keeps_a_sample_when_the_test_split_is_drawn(tmp_path: Path) -> None:
    """Users of one sample stay clients: the per-user split never takes a user's last sample."""
    users = np.array(["a"] * 20 + ["b"] * 20 + [f"single{k}" for k in range(10)])
    path = _table(tmp_path / "d.csv", users=users, x=_X[:50], y=_Y[:50])
    prepared = RunInputs(_files_config(path)).prepare()
    assert prepared.partition.sizes.tolist() == [16, 16] + [1] * 10
    assert prepared.config.population.num_clients == 12


def test_other_partitions_read_files_too(tmp_path: Path) -> None:
    """Files data with a Dirichlet partition over a set population, and a separate test file, runs."""
    train, test = _leaf_table(tmp_path / "train.csv"), _leaf_table(tmp_path / "test.csv", users=2)
    tracker = MemoryTracker()
    config = _files_config(train, f"data.test={test}", "population.num_clients=10", partition={"kind": "dirichlet"})
    flasync.run(config, tracker=tracker)
    assert tracker.datasets[0]["profile"]["test_rows"] == 40
    assert tracker.datasets[0]["source"] == f"{train}, {test}"


def test_by_column_with_data_given_in_python_is_refused(tmp_path: Path) -> None:
    """A data set given to the Federation has no client column: by_column is refused."""
    path = _leaf_table(tmp_path / "leaf.csv")
    data = load_files(path, label="label", features=["f0", "f1", "f2"]).train
    with pytest.raises(ConfigError, match="a given data set has no clients"):
        flasync.run(_files_config(path), dataset=data)


def test_by_column_run_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """The checkpoint holds the resolved config; resuming from it reproduces the run's weights."""
    config = _files_config(_leaf_table(tmp_path / "leaf.csv"), "stop.max_versions=10", "checkpoint.every_versions=4")
    tracker = MemoryTracker()
    full = flasync.run(config, tracker=tracker)
    resumed_config, state = checkpoint.decode(checkpoint.latest(tracker.artifacts))
    assert resumed_config.population.num_clients == 6
    resumed = flasync.run(resumed_config, resume=checkpoint.ResumePoint(None, state))
    assert resumed.weights_sha256 == full.weights_sha256


def _cli_sha(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["run", *argv, "--no-tracking", "--log-level", "warning"]) == 0
    out = capsys.readouterr().out
    found = re.search(r"weights sha256 +([0-9a-f]{64})", out)
    assert found is not None, out
    return found.group(1)


@pytest.mark.parametrize("fmt", ["csv", "npz"])
def test_cli_runs_a_files_config_deterministically(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """`flasync run cfg.toml` with a data file beside the config runs from any folder, twice to the same weights."""
    folder = tmp_path / "exp"
    folder.mkdir()
    path = _leaf_table(folder / "leaf.csv")
    if fmt == "npz":
        table = np.loadtxt(path, delimiter=",", skiprows=1, dtype=str)
        np.savez(
            folder / "leaf.npz", x=table[:, 2:].astype(np.float32), label=table[:, 1].astype(int), user=table[:, 0]
        )
    (folder / "cfg.toml").write_text(
        f'seed = 3\n[data]\nkind = "files"\ntrain = "leaf.{fmt}"\nlabel = "label"\nclient_column = "user"\n'
        '[partition]\nkind = "by_column"\n[server]\nkind = "fedbuff"\nbuffer_size = 2\nconcurrency = 3\n'
        "[model]\nhidden = [16]\n[stop]\nmax_versions = 6\n[diagnostics]\nplots = false\n"
    )
    monkeypatch.chdir(tmp_path)  # the data path is relative to the config's folder, not to this one
    first = _cli_sha(capsys, "exp/cfg.toml")
    assert _cli_sha(capsys, "exp/cfg.toml") == first
    assert _cli_sha(capsys, "exp/cfg.toml", "--set", "seed=4") != first


def test_cli_reports_a_bad_data_file_in_one_line_and_exits_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A data file the run cannot use exits 2 with one line naming the file and the column."""
    monkeypatch.chdir(tmp_path)
    _write_csv(tmp_path / "d.csv", ["user", "label", "a"], [["u", 0, 1.0], ["v", 1, "x"]])
    argv = [
        "run",
        "--no-tracking",
        "--set",
        "data.kind=files",
        "--set",
        "data.train=d.csv",
        "--set",
        "data.label=label",
    ]
    assert main([*argv, "--set", "data.client_column=user", "--set", "partition.kind=by_column"]) == 2
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if " run.phase " not in line]
    assert lines == ["flasync: error: d.csv: feature column 'a' is not numeric ('x' in data row 2)"]


def test_print_config_leaves_the_population_to_the_data(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--print-config of a by_column run prints no num_clients, so the printed YAML runs as the original."""
    path = _leaf_table(tmp_path / "leaf.csv")
    argv = ["--set", "data.kind=files", "--set", f"data.train={path}", "--set", "data.label=label"]
    argv += ["--set", "data.client_column=user", "--set", "partition.kind=by_column", "--no-system-metrics"]
    assert main(["run", "--print-config", *argv]) == 0
    (tmp_path / "printed.yaml").write_text(capsys.readouterr().out)
    printed = load_config(tmp_path / "printed.yaml")
    assert "num_clients" not in printed.population.model_fields_set
    assert printed == load_config(None, [a for a in argv if a not in ("--set", "--no-system-metrics")])


@pytest.mark.slow
def test_example_script_writes_the_same_samples_in_every_format(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """examples/make_files_data.py writes digits by writer as CSV, .npz and Parquet that load to the same tensors,
    and the example config trains on them with one client per writer."""
    paths = [tmp_path / f"digits.{suffix}" for suffix in ("csv", "npz", "parquet")]
    for path in paths:
        monkeypatch.setattr(sys, "argv", ["make_files_data.py", "--out", str(path)])
        runpy.run_path(str(EXAMPLES / "make_files_data.py"), run_name="__main__")
        printed = capsys.readouterr().out
        assert (
            printed
            == f"wrote {path}: 1797 samples of 39 writers (4 to 208 samples each, median 31; 1 of the 40 drew none)\n"
        )
    loaded = [load_files(path, label="label", client_column="writer") for path in paths]
    for other in loaded[1:]:
        assert torch.equal(other.train.x, loaded[0].train.x) and torch.equal(other.train.y, loaded[0].train.y)
        assert other.client_ids == loaded[0].client_ids and np.array_equal(other.clients, loaded[0].clients)  # type: ignore[arg-type]
    assert len(loaded[0].train) == 1797 and loaded[0].train.feature_shape == (64,)
    config = load_config(EXAMPLES / "files_by_column.toml", [f"data.train={paths[1]}", "stop.max_versions=5"])
    tracker = MemoryTracker()
    flasync.run(config, tracker=tracker)
    assert tracker.params["population.num_clients"] == len(loaded[0].client_ids) - 1  # one writer below min_samples
