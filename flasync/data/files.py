"""Read a labelled data set from your own files: ``.npz``, ``.pt``, ``.csv`` or ``.parquet``.

The format follows from the file's suffix. Arrays (``.npz``, ``.pt``) name their features, labels and clients by
key; tables (``.csv`` with a header row, ``.parquet``) by column. Nothing in a file can run code: ``.npz`` files are
read with ``allow_pickle=False``, ``.pt`` files with ``torch.load(weights_only=True)`` and must hold a dict of
tensors. Every problem is a one-line :class:`~flasync.core.errors.DataError` naming the file and the key, column or
line.

Features become ``float32`` and must be finite. Labels are integer class ids (whole floats such as ``3.0`` count)
or text, which is mapped to class ids in sorted order over the training and test files together. Client values
(a user or device id, for ``partition.kind = "by_column"``) are integers or text; clients are numbered in sorted
order of their values.
"""

from __future__ import annotations

import csv
import hashlib
import pickle
import re
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flasync.core.errors import DataError
from flasync.data import ArrayData

__all__ = ["FORMATS", "FileData", "load_files", "missing"]

FORMATS = (".npz", ".pt", ".csv", ".parquet")
"""The suffixes :func:`load_files` reads (case-insensitively)."""

_DEFAULT_FEATURES_KEY = "x"
_SHOWN_NAMES = 8  # names listed in a "not found" message before "... (N in all)"


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class FileData:
    """A data set read by :func:`load_files`.

    Attributes:
        train: The training samples, in file order.
        test: The samples of the test file, or ``None`` when none was named.
        clients: Client of each training sample, ``int64`` of shape ``(len(train),)``, an index into
            ``client_ids``; ``None`` without a client column.
        client_ids: The distinct values of the client column in sorted order (client ``k`` is ``client_ids[k]``).
        classes: The text label of each class id, or ``None`` for integer labels.
        sha256: Hex SHA-256 of the training file's bytes followed by the test file's.
    """

    train: ArrayData
    test: ArrayData | None
    clients: np.ndarray | None
    client_ids: tuple[int | str, ...]
    classes: tuple[str, ...] | None
    sha256: str


@dataclass(frozen=True, slots=True, eq=False)
class _Raw:
    """One file's columns before labels are turned into class ids."""

    path: Path
    x: np.ndarray  # float32, (N, ...)
    y: np.ndarray  # int64 or text, (N,)
    clients: np.ndarray | None  # int64 or text, (N,)
    table: bool  # rows are counted from 1 after the header, not indexed from 0


def load_files(
    train: str | Path,
    test: str | Path | None = None,
    *,
    features: Sequence[str] | None = None,
    label: str = "y",
    client_column: str | None = None,
    num_classes: int | None = None,
) -> FileData:
    """Read a training file (and a test file in the same layout) into tensors.

    Args:
        train: The training file: ``.npz``, ``.pt``, ``.csv`` or ``.parquet``.
        test: A held-out file in the same layout; its client column, if any, is ignored.
        features: Arrays: one key (default ``"x"``), of shape ``(N, ...)``. Tables: the feature columns (default:
            every column but ``label`` and ``client_column``).
        label: The label key or column, shape ``(N,)``.
        client_column: The key or column naming each training sample's client; never a feature.
        num_classes: Number of classes; inferred when ``None`` (the largest label + 1, or the number of distinct
            text labels).

    Returns:
        The samples, the training samples' clients and the files' digest.

    Raises:
        DataError: With a one-line message naming the file and what is wrong in it: missing or empty file,
            unknown suffix, missing key or column, non-numeric or non-finite features, labels that are not
            class ids or are out of range, arrays of different lengths, or content that needs unpickling.
    """
    names = tuple(features) if features is not None else None
    if names is not None and (not names or not all(isinstance(n, str) and n for n in names)):
        raise DataError(f"features must name at least one key or column; got {features!r}")
    for path, role in ((train, "train"), (test, "test")):
        if path is not None:
            _check_path(Path(path), role)
    digest = hashlib.sha256()
    raw_train = _read(Path(train), "train", names, label, client_column, need_clients=True, digest=digest)
    raw_test = None
    if test is not None:
        raw_test = _read(Path(test), "test", names, label, client_column, need_clients=False, digest=digest)
        if raw_test.x.shape[1:] != raw_train.x.shape[1:]:
            raise DataError(
                f"{raw_test.path}: samples of shape {raw_test.x.shape[1:]}, but {raw_train.path} has "
                f"{raw_train.x.shape[1:]}"
            )
    raws = [raw_train] if raw_test is None else [raw_train, raw_test]
    labels, classes, count = _class_ids(raws, label, num_classes)
    data = [
        ArrayData(x=torch.from_numpy(r.x), y=torch.from_numpy(y), num_classes=count)
        for r, y in zip(raws, labels, strict=True)
    ]
    codes, client_ids = None, ()
    if raw_train.clients is not None:
        values, inverse = np.unique(raw_train.clients, return_inverse=True)
        codes = inverse.reshape(-1).astype(np.int64)
        client_ids = tuple(values.tolist())
    return FileData(
        train=data[0],
        test=data[1] if len(data) > 1 else None,
        clients=codes,
        client_ids=client_ids,
        classes=classes,
        sha256=digest.hexdigest(),
    )


# ----------------------------------------------------------------------------------------------------- reading
def _read(
    path: Path,
    role: str,
    features: tuple[str, ...] | None,
    label: str,
    client_column: str | None,
    *,
    need_clients: bool,
    digest: Any,
) -> _Raw:
    suffix = path.suffix.lower()
    try:
        with path.open("rb") as stream:
            size = 0
            while chunk := stream.read(1 << 20):
                digest.update(chunk)
                size += len(chunk)
    except OSError as exc:
        raise DataError(f"{path}: cannot read it (data.{role}): {exc.strerror or exc}") from None
    if size == 0:
        raise DataError(f"{path}: the file is empty (data.{role})")
    clients = client_column if need_clients else None
    if suffix in (".npz", ".pt"):
        raw = _read_arrays(path, features, label, clients)
    else:
        raw = _read_table(path, features, label, clients, skip=client_column)
    lengths = {"features": raw.x.shape[0], "labels": raw.y.shape[0]}
    if raw.clients is not None:
        lengths["clients"] = raw.clients.shape[0]
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{n} {what}" for what, n in lengths.items())
        raise DataError(f"{path}: arrays of different lengths ({shown})")
    if raw.x.shape[0] == 0:
        raise DataError(f"{path}: no samples")
    return raw


def missing(path: Path, role: str) -> DataError:
    """Return the error for the data file ``path`` (``data.<role>``) that does not exist; a relative path (one
    ``--set`` gave: a config file's are made absolute against its folder) says which folder it was looked for in."""
    where = "" if path.is_absolute() else f", looked for in the working folder {Path.cwd()}"
    return DataError(f"{path}: file not found (data.{role}{where})")


def _check_path(path: Path, role: str) -> None:
    """Refuse a file of an unknown format, a missing one, or a folder, before anything is read."""
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise DataError(
            f"{path}: unsupported format {suffix or '(no suffix)'!r} (data.{role}; use {', '.join(FORMATS)})"
        )
    if not path.exists():
        raise missing(path, role)
    if not path.is_file():
        raise DataError(f"{path}: not a file (data.{role})")


def _read_arrays(path: Path, features: tuple[str, ...] | None, label: str, client_column: str | None) -> _Raw:
    if features is not None and len(features) != 1:
        raise DataError(f"{path}: arrays hold the features in one key; data.features names {len(features)}")
    wanted = {features[0] if features is not None else _DEFAULT_FEATURES_KEY: "features", label: "label"}
    if client_column is not None:
        wanted[client_column] = "client_column"
    arrays, names = _read_npz(path, wanted) if path.suffix.lower() == ".npz" else _read_pt(path, wanted)
    for name, field in wanted.items():
        if name not in arrays:
            raise DataError(f"{path}: no array {name!r} (data.{field}); it holds {_listing(names)}")
    key = next(iter(wanted))
    return _Raw(
        path,
        _features(path, arrays[key], what=f"array {key!r}"),
        _labels(path, label, arrays[label], table=False),
        _client_values(path, client_column, arrays[client_column], table=False) if client_column else None,
        table=False,
    )


def _read_npz(path: Path, wanted: Mapping[str, str]) -> tuple[dict[str, np.ndarray], list[str]]:
    try:
        loaded = np.load(path, allow_pickle=False)
    except ValueError:  # not a zip nor .npy: numpy would unpickle it, which allow_pickle=False refuses
        raise DataError(f"{path}: not a .npz archive of arrays (save them with numpy.savez)") from None
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: not a readable .npz archive ({_first_line(exc)})") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise DataError(f"{path}: holds a single array; save named arrays with numpy.savez (e.g. x=..., y=...)")
    with loaded:
        out: dict[str, np.ndarray] = {}
        for name in wanted:
            if name not in loaded.files:
                continue
            try:
                out[name] = loaded[name]
            except ValueError:
                raise DataError(
                    f"{path}: array {name!r} holds Python objects, which need unpickling (refused: "
                    "allow_pickle=False); save numbers or text"
                ) from None
            except (OSError, EOFError, zipfile.BadZipFile) as exc:
                raise DataError(f"{path}: array {name!r} cannot be read ({_first_line(exc)})") from None
        return out, list(loaded.files)


def _read_pt(path: Path, wanted: Mapping[str, str]) -> tuple[dict[str, np.ndarray], list[str]]:
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message suggests weights_only=False, which would run the file's code: say what is in it instead.
        found = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)", str(exc))
        what = f"a Python object ({found.group(1)})" if found else "something other than tensors"
        raise DataError(f"{path}: holds {what}, which flasync does not unpickle; save a dict of tensors only") from None
    except (RuntimeError, OSError, EOFError, ValueError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: not a readable torch file ({_first_line(exc)})") from None
    if not isinstance(loaded, Mapping) or not all(isinstance(k, str) for k in loaded):
        raise DataError(
            f"{path}: holds a {type(loaded).__name__}; save a dict of tensors, e.g. torch.save({{'x': x, 'y': y}}, f)"
        )
    out: dict[str, np.ndarray] = {}
    for name in wanted:
        if name not in loaded:
            continue
        value = loaded[name]
        if not isinstance(value, torch.Tensor):
            raise DataError(f"{path}: {name!r} holds a {type(value).__name__}, not a tensor")
        tensor = value.detach().cpu()
        if tensor.dtype in (torch.bfloat16, torch.float16):
            tensor = tensor.float()  # numpy has no bfloat16
        try:
            out[name] = tensor.numpy()
        except TypeError as exc:  # e.g. quantized tensors
            raise DataError(f"{path}: tensor {name!r} of dtype {tensor.dtype} cannot be read ({exc})") from None
    return out, list(loaded)


def _read_table(
    path: Path, features: tuple[str, ...] | None, label: str, client_column: str | None, *, skip: str | None
) -> _Raw:
    columns = _read_csv(path) if path.suffix.lower() == ".csv" else _read_parquet(path)

    def column(name: str, field: str) -> np.ndarray:
        found = columns.get(name)
        if found is None:
            raise DataError(f"{path}: no column {name!r} (data.{field}); columns: {_listing(list(columns))}")
        if isinstance(found, str):
            raise DataError(f"{path}: column {name!r} has type {found}, which flasync does not read (data.{field})")
        return found

    if features is None:
        names = [n for n in columns if n not in (label, skip)]
        if not names:
            raise DataError(f"{path}: no feature columns besides the label and client columns")
    else:
        names = list(features)
    labels = _labels(path, label, column(label, "label"), table=True)
    clients = None
    if client_column is not None:
        clients = _client_values(path, client_column, column(client_column, "client_column"), table=True)
    x = np.stack([_feature_column(path, name, column(name, "features")) for name in names], axis=1)
    return _Raw(path, _features(path, x, what="features", columns=names), labels, clients, table=True)


def _read_csv(path: Path) -> dict[str, np.ndarray | str]:
    """Read a CSV file with a header row into one text column per name."""
    try:
        with path.open(newline="", encoding="utf-8-sig") as stream:
            reader = csv.reader(stream)
            header = next(reader, None)
            rows = []
            for row in reader:
                if not row:  # a blank line
                    continue
                if header is not None and len(row) != len(header):
                    raise DataError(
                        f"{path}: line {reader.line_num} has {len(row)} fields, the header has {len(header)}"
                    )
                rows.append(row)
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except csv.Error as exc:
        raise DataError(f"{path}: not valid CSV ({exc})") from None
    if header is None:
        raise DataError(f"{path}: no header row")
    names = [name.strip() for name in header]
    seen: set[str] = set()
    for name in names:
        if not name:
            raise DataError(f"{path}: the header has an empty column name")
        if name in seen:
            raise DataError(f"{path}: column {name!r} appears twice in the header")
        seen.add(name)
    cells = list(zip(*rows, strict=True)) if rows else [() for _ in names]
    return {name: np.array(column, dtype=np.str_) for name, column in zip(names, cells, strict=True)}


def _read_parquet(path: Path) -> dict[str, np.ndarray | str]:
    """Read a Parquet file into one array per column (the type's name for a column of a type not read)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading .parquet needs pyarrow: pip install pyarrow") from None
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable Parquet file ({_first_line(exc)})") from None
    out: dict[str, np.ndarray | str] = {}
    for name, column in zip(table.column_names, table.columns, strict=True):
        kind = column.type
        if pa.types.is_dictionary(kind):  # categorical columns
            column, kind = column.cast(kind.value_type), kind.value_type
        if column.null_count:
            first = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
            out[name] = f"{kind} with {column.null_count} missing values (first in data row {first + 1})"
        elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
            out[name] = np.array(column.to_pylist(), dtype=np.str_)
        elif pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
            out[name] = column.to_numpy()
        else:
            out[name] = str(kind)
    return out


# ---------------------------------------------------------------------------------------------------- checking
def _at(index: int, table: bool) -> str:
    """Say where sample ``index`` is: in data row ``index + 1`` of a table, at index ``index`` of an array."""
    return f"in data row {index + 1}" if table else f"at index {index}"


def _feature_column(path: Path, name: str, column: np.ndarray) -> np.ndarray:
    if column.dtype.kind != "U":
        return column
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            return np.array(column, dtype=np.float32)
    except ValueError:
        bad = next(i for i, cell in enumerate(column.tolist()) if not _is_float(cell))
        raise DataError(
            f"{path}: feature column {name!r} is not numeric ({column[bad].item()!r} {_at(bad, True)})"
        ) from None


def _features(path: Path, array: np.ndarray, *, what: str, columns: Sequence[str] | None = None) -> np.ndarray:
    """Return the features as finite, contiguous float32."""
    if array.ndim < 1:
        raise DataError(f"{path}: {what} must have a sample dimension; got a scalar")
    if array.dtype.kind not in "biuf":
        raise DataError(f"{path}: {what} must hold numbers; got dtype {array.dtype}")
    with np.errstate(over="ignore", invalid="ignore"):
        x = np.ascontiguousarray(array, dtype=np.float32)
    finite = np.isfinite(x)
    if not finite.all():
        at = np.unravel_index(int(np.argmin(finite.reshape(-1))), x.shape)
        row = int(at[0])
        where = _at(row, False) if columns is None else f"in column {columns[int(at[1])]!r}, data row {row + 1}"
        raise DataError(
            f"{path}: {what} has a non-finite value ({array[at].item()!r} {where}; NaN, Inf or beyond float32)"
        )
    return x


def _labels(path: Path, name: str, array: np.ndarray, *, table: bool) -> np.ndarray:
    """Return labels as ``int64`` class ids or as text, checking that numbers are whole and non-negative."""
    if array.ndim != 1:
        raise DataError(f"{path}: label {name!r} must be 1-d; got shape {array.shape}")
    if array.dtype.kind in "US":
        text = np.char.strip(array.astype(np.str_))
        numbers = [_is_float(cell) for cell in text.tolist()]
        if not any(numbers):
            return text
        if not all(numbers):
            bad = numbers.index(False)
            cell = text[bad].item()
            if not cell:
                raise DataError(f"{path}: label {name!r} has an empty cell {_at(bad, table)}")
            raise DataError(f"{path}: label {name!r} mixes numbers and text ({cell!r} {_at(bad, table)})")
        array = text.astype(np.float64)
    if array.dtype.kind not in "iuf":
        raise DataError(f"{path}: label {name!r} must hold integer class ids; got dtype {array.dtype}")
    if array.dtype.kind == "f":
        whole = np.isfinite(array) & (np.floor(array) == array) & (np.abs(array) < 2**62)
        if not whole.all():
            bad = int(np.argmin(whole))
            raise DataError(
                f"{path}: label {name!r} is not an integer class id ({array[bad].item()!r} {_at(bad, table)})"
            )
    if array.shape[0] and array.min() < 0:
        bad = int(np.argmin(array))
        raise DataError(f"{path}: label {name!r} is negative ({array[bad].item()!r} {_at(bad, table)})")
    if array.dtype == np.uint64 and array.shape[0] and int(array.max()) >= 2**63:
        raise DataError(f"{path}: label {name!r} is too large for a class id ({int(array.max())})")
    return array.astype(np.int64)


def _client_values(path: Path, name: str, array: np.ndarray, *, table: bool) -> np.ndarray:
    """Return client values as ``int64`` or text (text that reads as integers becomes integers)."""
    if array.ndim != 1:
        raise DataError(f"{path}: client column {name!r} must be 1-d; got shape {array.shape}")
    if array.dtype.kind in "US":
        text = np.char.strip(array.astype(np.str_))
        empty = np.flatnonzero(text == "")
        if empty.shape[0]:
            raise DataError(f"{path}: client column {name!r} is empty {_at(int(empty[0]), table)}")
        try:
            return np.array(text, dtype=np.int64)
        except (ValueError, OverflowError):
            return text
    if array.dtype.kind in "iu" and (array.dtype != np.uint64 or not array.shape[0] or int(array.max()) < 2**63):
        return array.astype(np.int64)
    raise DataError(f"{path}: client column {name!r} must hold integers or text; got dtype {array.dtype}")


def _class_ids(
    raws: Sequence[_Raw], label: str, num_classes: int | None
) -> tuple[list[np.ndarray], tuple[str, ...] | None, int]:
    """Turn every file's labels into class ids (text in sorted order, integers as they are); check their range."""
    text = [r.y.dtype.kind == "U" for r in raws]
    if any(text) and not all(text):
        raise DataError(
            f"{raws[text.index(True)].path}: label {label!r} is text, but in {raws[text.index(False)].path} numbers"
        )
    if all(text):
        classes = np.unique(np.concatenate([r.y for r in raws]))
        count = num_classes if num_classes is not None else len(classes)
        if len(classes) > count:
            raise DataError(
                f"{raws[0].path}: label {label!r} has {len(classes)} distinct values, but data.num_classes = {count}"
            )
        ids = [np.searchsorted(classes, r.y).astype(np.int64) for r in raws]
        return ids, tuple(str(c) for c in classes.tolist()), count
    count = num_classes if num_classes is not None else max(int(r.y.max()) for r in raws) + 1
    for r in raws:
        bad = np.flatnonzero(r.y >= count)
        if bad.shape[0]:
            raise DataError(
                f"{r.path}: label {label!r} is out of range ({int(r.y[bad[0]])} {_at(int(bad[0]), r.table)}; "
                f"data.num_classes = {count})"
            )
    return [r.y for r in raws], None, count


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _listing(names: Sequence[str]) -> str:
    if not names:
        return "nothing"
    shown = ", ".join(repr(n) for n in names[:_SHOWN_NAMES])
    return shown if len(names) <= _SHOWN_NAMES else f"{shown}, ... ({len(names)} in all)"


def _first_line(exc: BaseException) -> str:
    text = _ANSI.sub("", str(exc)).strip().splitlines()
    return text[0] if text else type(exc).__name__


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
