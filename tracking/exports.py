"""Models exported once and kept across processes: a tracked run's model logged without ``torch.export``.

Saving a model in MLflow's ``pt2`` format traces it with ``torch.export``: in a fresh process that costs importing
torch in the writer's helper and a first trace (some three seconds of CPU together, see
:mod:`flasync.tracking._model`), on cores that training needs. Yet the same command run again exports the same
graph: only the weights differ. An :class:`ExportCache` keeps the saved folder of each model structure it was
given (the ``pt2`` archive and MLflow's files: signature, input example, environment), by a key naming the builder,
its arguments but the weights, the input example and the torch and MLflow versions; :func:`swap_weights` writes
another model's weights into a copy of that archive, byte for byte, without torch's exporter or loader (reading
an archive back imports torch's compiler stack: over a second). So a later run's process saves its model in
milliseconds: the weights swapped in by the process that holds them, the folder sent by the writer process.

An entry is kept only once a weight swap into it was read back by ``torch.export.load`` with exactly the weights
written (:meth:`ExportCache.put`, in the process that exported the model); a swap refuses an archive whose
weights it does not know how to lay out (shared or strided storages, pickled tensors, constants), and the caller
then exports the model as it would have.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import struct
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch.export import ExportedProgram

__all__ = ["CachedExport", "ExportCache", "default_export_cache", "save_from_cache", "swap_weights"]

_META = "export.json"
"""The file of an entry that says which file of its folder is the archive (written last: an entry without it is
incomplete)."""
_FILES = "files"
_HINTS = "hints"
_WEIGHTS_CONFIG = "data/weights/model_weights_config.json"
_CONSTANTS_CONFIG = "data/constants/model_constants_config.json"
_ALIGNMENT = 64
"""torch's archive writer starts each record's data at a multiple of 64 bytes; the swap keeps that."""
_DTYPES = {4: "<i4", 5: "<i8", 7: "<f4", 8: "<f8", 12: "|b1"}
"""``torch.export``'s serialized scalar types (int, long, float, double, bool) as NumPy dtypes."""
_STRIDED = 7
"""``torch.export``'s serialized layout of a dense tensor."""


def default_export_cache() -> Path:
    """Return the folder where exported models are kept for reuse: ``$XDG_CACHE_HOME/flasync/model-exports``, or
    ``~/.cache/flasync/model-exports``."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "flasync" / "model-exports"


@dataclass(frozen=True)
class CachedExport:
    """A model's saved folder kept by an :class:`ExportCache`."""

    folder: Path
    """The saved folder (MLflow's files and the archive)."""
    archive: str
    """The archive's path relative to :attr:`folder` (``data/model.pt2``)."""


class ExportCache:
    """Saved ``pt2`` model folders by what they were exported from (see the module's docstring).

    Args:
        root: The cache's folder (made when an entry is first kept).
    """

    def __init__(self, root: Path) -> None:
        """Hold the folder."""
        self.root = root

    @staticmethod
    def key(builder: str, kwargs: Mapping[str, Any], input_example: Sequence[Any], input_dtype: str) -> str:
        """Return the key of the export of ``builder(**kwargs)`` traced on ``input_example``: a digest of the builder,
        its arguments but ``weights`` (whose values the export does not keep), the example, the installed torch and
        MLflow (an export is read back by the torch that wrote it) and the Python running it (the saved folder names
        it, in ``MLmodel`` and ``python_env.yaml``, as the one to serve the model with)."""
        what = {
            "builder": builder,
            "kwargs": {k: v for k, v in kwargs.items() if k != "weights"},
            "input_example": list(input_example),
            "input_dtype": input_dtype,
            "torch": _version("torch"),
            "mlflow": _version("mlflow"),
            "python": platform.python_version(),
        }
        return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:32]

    def get(self, key: str) -> CachedExport | None:
        """Return the entry kept for ``key``, or None."""
        folder = self.root / key
        try:
            meta = json.loads((folder / _META).read_text())
        except (OSError, ValueError):
            return None
        archive = meta.get("archive") if isinstance(meta, dict) else None
        if not isinstance(archive, str) or not (folder / _FILES / archive).is_file():
            return None
        return CachedExport(folder / _FILES, archive)

    def put(
        self, key: str, files: Mapping[str, bytes], archive: str, archive_path: str, program: ExportedProgram
    ) -> bool:
        """Keep a saved folder for ``key``: ``files`` (its files but the archive, by relative path) and the archive at
        ``archive_path`` (kept as ``archive``). Kept only when a swap of other weights into the archive reads back,
        through ``torch.export.load``, as exactly those weights (``program``: the archive's exported program, whose
        tensors give the weights' names, shapes and dtypes). Never raises for a cache that cannot be written.

        Returns:
            Whether the entry is kept.
        """
        import numpy as np
        import torch

        if self.get(key) is not None:
            return True
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=self.root))
        except OSError:
            return False
        try:
            for relative, content in files.items():
                path = staging / _FILES / relative
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(content)
            target = staging / _FILES / archive
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(archive_path, target)
            probe = {name: _probe(tensor) for name, tensor in _program_tensors(program).items()}
            check = staging / "check.pt2"
            if not swap_weights(target, check, probe):
                return False
            loaded = _program_tensors(torch.export.load(str(check)))
            if loaded.keys() != probe.keys() or not all(
                np.array_equal(loaded[name].detach().cpu().numpy(), value) for name, value in probe.items()
            ):
                return False
            check.unlink()
            (staging / _META).write_text(json.dumps({"archive": archive}))
            os.replace(staging, self.root / key)  # fails (kept as it was) when another process kept it first
            return True
        except OSError:
            return False
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def mark(self, hint: str, key: str) -> None:
        """Note that what ``hint`` names (e.g. a run's config) exported the entry ``key`` (see :meth:`marked`)."""
        with contextlib.suppress(OSError):
            folder = self.root / _HINTS
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / _safe(hint)
            temporary = path.with_suffix(".tmp")
            temporary.write_text(key)
            os.replace(temporary, path)

    def marked(self, hint: str) -> bool:
        """Tell whether :meth:`mark` noted an entry for ``hint`` that is still kept: a guess, made before the model
        and its input example exist, that its export will be found (so nothing needs to be warmed up for it)."""
        try:
            key = (self.root / _HINTS / _safe(hint)).read_text().strip()
        except OSError:
            return False
        return bool(key) and self.get(key) is not None


def swap_weights(source: Path, target: Path, tensors: Mapping[str, np.ndarray]) -> bool:
    """Write the ``pt2`` archive ``source`` to ``target`` with ``tensors`` as its weights, every other record as it
    is; False (nothing written) when the archive's weights are not exactly ``tensors``' names, shapes and dtypes,
    each a dense, unshared record, or when the archive holds constants.

    Args:
        source: A ``pt2`` archive of one exported program.
        target: Where to write the new archive (replaced).
        tensors: The weights by their names in the program's state dict (parameters and persistent buffers).
    """
    try:
        with zipfile.ZipFile(source) as archive:
            records = archive.infolist()
            configs = [r.filename for r in records if r.filename.endswith("/" + _WEIGHTS_CONFIG)]
            constants = [r.filename for r in records if r.filename.endswith("/" + _CONSTANTS_CONFIG)]
            if len(configs) != 1 or len(constants) > 1:
                return False
            prefix = configs[0][: -len(_WEIGHTS_CONFIG)]
            if constants and json.loads(archive.read(constants[0])).get("config"):
                return False
            config = json.loads(archive.read(configs[0]))["config"]
            sizes = {r.filename: r.file_size for r in records}
            replaced = _replacements(config, tensors, prefix, sizes)
            if replaced is None:
                return False
            with zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as out:
                for record in records:
                    data = replaced.get(record.filename)
                    _write_aligned(out, record, archive.read(record) if data is None else data)
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile):
        with contextlib.suppress(OSError):
            target.unlink()
        return False
    return True


def _replacements(
    config: Mapping[str, Any], tensors: Mapping[str, np.ndarray], prefix: str, sizes: Mapping[str, int]
) -> dict[str, bytes] | None:
    """Return the new content of each weight record, by its name in the archive; None when a weight does not fit."""
    import numpy as np

    if set(config) != set(tensors):
        return None
    replaced: dict[str, bytes] = {}
    for name, entry in config.items():
        meta = entry["tensor_meta"]
        record = f"{prefix}data/weights/{entry['path_name']}"
        value = np.asarray(tensors[name])
        shape = [int(size["as_int"]) for size in meta["sizes"]]
        strides = [int(stride["as_int"]) for stride in meta["strides"]]
        dtype = _DTYPES.get(int(meta["dtype"]))
        if (
            entry.get("use_pickle")
            or dtype is None
            or np.dtype(dtype) != value.dtype.newbyteorder("<")
            or list(value.shape) != shape
            or strides != _contiguous(shape)
            or int(meta["storage_offset"]["as_int"]) != 0
            or int(meta["layout"]) != _STRIDED
            or meta["device"]["type"] != "cpu"
            or record in replaced
            or sizes.get(record) != value.nbytes
        ):
            return None
        replaced[record] = np.ascontiguousarray(value, dtype=dtype).tobytes()
    return replaced


def _write_aligned(out: zipfile.ZipFile, record: zipfile.ZipInfo, data: bytes) -> None:
    """Add ``record`` with ``data``, uncompressed, its data starting at a multiple of :data:`_ALIGNMENT` bytes (a
    padding extra field, as torch's writer pads)."""
    info = zipfile.ZipInfo(record.filename, date_time=record.date_time)
    info.compress_type = zipfile.ZIP_STORED
    assert out.fp is not None
    start = out.fp.tell() + 30 + len(record.filename.encode()) + 4  # local header, name, the extra field's header
    padding = -start % _ALIGNMENT
    info.extra = struct.pack("<HH", 0x4246, padding) + b"Z" * padding  # "FB": torch's padding field
    out.writestr(info, data)


def _contiguous(shape: Sequence[int]) -> list[int]:
    """Return the strides of a dense, row-major tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]


def _program_tensors(program: ExportedProgram) -> dict[str, torch.Tensor]:
    """Return an exported program's weights (its state dict: parameters and persistent buffers)."""
    return dict(program.state_dict)


def _probe(tensor: torch.Tensor) -> np.ndarray:
    """Return values of ``tensor``'s shape and dtype that differ from any it is likely to hold (a swap's check)."""
    import numpy as np

    value = tensor.detach().cpu().numpy()
    if value.dtype == np.bool_:
        return ~value
    return (np.arange(value.size, dtype=np.float64).reshape(value.shape) % 7 + 0.5).astype(value.dtype)


def _safe(hint: str) -> str:
    """Return a file name for ``hint``."""
    return hashlib.sha256(hint.encode()).hexdigest()[:32]


def _version(distribution: str) -> str:
    """Return the installed version of ``distribution`` ("" when it is not installed)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


def save_from_cache(entry: CachedExport, tensors: Mapping[str, np.ndarray], folder: Path) -> bool:
    """Write the kept folder ``entry`` to ``folder`` (which must not exist) with ``tensors`` swapped in as its
    archive's weights (see :func:`swap_weights`); False when they do not fit (``folder`` may be left partly
    written).

    Args:
        entry: A kept export.
        tensors: The model's state dict as arrays, by name.
        folder: Where to write the saved model.
    """
    shutil.copytree(entry.folder, folder)
    return swap_weights(entry.folder / entry.archive, folder / entry.archive, tensors)
