"""Error-feedback residuals of many clients, bounded in memory, spilled to disk.

With error feedback (Stich, Cordonnier and Jaggi 2018, "Sparsified SGD with memory"; Lin et al. 2018, "Deep
Gradient Compression") every client keeps the part of its updates that compression has not sent yet,
``e_{t+1} = x_t + e_t - C(x_t + e_t)``: one dense float32 vector as long as the model, per client. A population of
thousands of clients does not fit in memory for any model of size, so :class:`ResidualStore` keeps the most
recently used ones in memory and writes the others to disk as raw little-endian float32 files.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
from collections import OrderedDict
from pathlib import Path
from types import TracebackType

import numpy as np
import torch

from flasync.core.errors import FlasyncError
from flasync.core.scratch import make_scratch

__all__ = ["RESIDUALS_PREFIX", "ResidualCapacityError", "ResidualStore"]

RESIDUALS_PREFIX = "residuals-"
"""Name start of the folder a store spills into (inside ``spill_dir``; removed by later runs if its run was killed)."""

_BYTES_PER_ELEMENT = 4


class ResidualCapacityError(FlasyncError, RuntimeError):
    """More clients hold a residual than a store without a spill folder may keep in memory."""


class ResidualStore:
    """Per-client residuals: an in-memory LRU of at most ``max_in_memory`` vectors; older ones spill to disk.

    Spilled vectors are raw little-endian float32 files (``np.tofile`` / ``np.fromfile``; never pickle) in a private
    folder the store makes inside ``spill_dir``, read back on demand.

    Cost, for a model of n parameters: a residual is ``4 n`` bytes (plus about 100 bytes of bookkeeping), so memory
    is at most ``max_in_memory * 4 n`` bytes (1024 clients of an 11M-parameter ResNet-18: 45 GB; choose the bound
    from the memory you have) and disk is ``4 n`` bytes per spilled client. A participation is one :meth:`get` and
    one :meth:`put`: free for a client in memory; for a spilled client, one ``4 n``-byte read, and when the memory is
    full one ``4 n``-byte write of the least recently used client. :meth:`get` does not bring a vector back into
    memory (the :meth:`put` that follows does), so one participation never costs two writes.

    The store is safe to use from several threads; disk I/O happens under its lock.

    Args:
        num_elements: Length n of every residual (the model's parameter count).
        max_in_memory: Most residuals held in memory at once.
        spill_dir: Folder for spilled residuals (created if needed); ``None`` for no spilling, in which case
            holding residuals of more than ``max_in_memory`` clients raises :class:`ResidualCapacityError`.

    Raises:
        ValueError: If ``num_elements`` is negative or ``max_in_memory`` below 1.
    """

    def __init__(self, num_elements: int, *, max_in_memory: int = 1024, spill_dir: str | Path | None = None) -> None:
        if num_elements < 0:
            raise ValueError(f"num_elements must be at least 0, got {num_elements}")
        if max_in_memory < 1:
            raise ValueError(f"max_in_memory must be at least 1, got {max_in_memory}")
        self._num_elements = num_elements
        self._max_in_memory = max_in_memory
        self._memory: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._on_disk: set[int] = set()
        self._lock = threading.Lock()
        self._spills = 0
        self._loads = 0
        self._parent: Path | None = None
        self._folder: Path | None = None
        self._created_parent = False
        if spill_dir is not None:
            parent = Path(spill_dir)
            self._created_parent = not parent.exists()
            parent.mkdir(parents=True, exist_ok=True)
            self._parent = parent
            self._folder = make_scratch(RESIDUALS_PREFIX, parent)

    @property
    def num_elements(self) -> int:
        """Length of every residual."""
        return self._num_elements

    @property
    def memory_bytes(self) -> int:
        """Bytes of residual values held in memory."""
        return len(self._memory) * _BYTES_PER_ELEMENT * self._num_elements

    @property
    def disk_bytes(self) -> int:
        """Bytes of residual values in spill files."""
        return len(self._on_disk) * _BYTES_PER_ELEMENT * self._num_elements

    @property
    def spills(self) -> int:
        """Residuals written to disk so far."""
        return self._spills

    @property
    def loads(self) -> int:
        """Residuals read back from disk so far."""
        return self._loads

    @property
    def spill_folder(self) -> Path | None:
        """The private folder spill files go to, or ``None`` without spilling."""
        return self._folder

    def __len__(self) -> int:
        """Return the number of clients with a residual."""
        return len(self._memory) + len(self._on_disk)

    def __contains__(self, client_id: object) -> bool:
        """Return whether the client has a residual."""
        return client_id in self._memory or client_id in self._on_disk

    def get(self, client_id: int) -> torch.Tensor | None:
        """Return a copy of the client's residual (the caller owns it), or ``None`` if it has none yet."""
        with self._lock:
            held = self._memory.get(client_id)
            if held is not None:
                self._memory.move_to_end(client_id)
                return held.clone()
            if client_id in self._on_disk:
                return self._load(client_id)
            return None

    def put(self, client_id: int, residual: torch.Tensor) -> None:
        """Store a copy of the client's residual as the most recently used, spilling the least recent if full.

        Raises:
            ValueError: If ``residual`` is not a 1-D vector of ``num_elements`` values.
            ResidualCapacityError: If the store has no spill folder and would hold more than ``max_in_memory``.
        """
        if residual.dim() != 1 or residual.numel() != self._num_elements:
            raise ValueError(
                f"a residual must be a 1-D vector of {self._num_elements} values, got shape {tuple(residual.shape)}"
            )
        copy = residual.detach().to("cpu", torch.float32, copy=True).contiguous()
        with self._lock:
            if client_id not in self._memory and len(self._memory) >= self._max_in_memory:
                if self._folder is None:
                    raise ResidualCapacityError(
                        f"residuals of {self._max_in_memory} clients are already held in memory "
                        f"(max_in_memory={self._max_in_memory}, {self.memory_bytes} bytes) and there is no "
                        "spill_dir; raise max_in_memory or give a spill_dir to spill older residuals to disk"
                    )
                self._spill_oldest()
            self._memory[client_id] = copy
            self._memory.move_to_end(client_id)
            if client_id in self._on_disk:
                self._path(client_id).unlink(missing_ok=True)
                self._on_disk.discard(client_id)

    def client_ids(self) -> list[int]:
        """Return the ids of the clients that hold a residual, in memory or on disk, sorted."""
        with self._lock:
            return sorted({*self._memory, *self._on_disk})

    def norm(self, client_id: int) -> float | None:
        """Return the L2 norm of the client's residual, or ``None`` if it has none (reads a spilled one back)."""
        residual = self.get(client_id)
        return None if residual is None else float(torch.linalg.vector_norm(residual))

    def close(self) -> None:
        """Forget every residual and delete the spill files and folders the store made."""
        with self._lock:
            self._memory.clear()
            self._on_disk.clear()
            if self._folder is not None:
                shutil.rmtree(self._folder, ignore_errors=True)
                if self._created_parent and self._parent is not None:
                    # Only if still empty: something else may have been put there since.
                    with contextlib.suppress(OSError):
                        self._parent.rmdir()
                self._folder = None

    def __enter__(self) -> ResidualStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ResidualStore(num_elements={self._num_elements}, clients={len(self)}, "
            f"in_memory={len(self._memory)}/{self._max_in_memory}, spill_folder={self._folder})"
        )

    def _path(self, client_id: int) -> Path:
        assert self._folder is not None  # only called once spilling is known to be on
        return self._folder / f"{int(client_id)}.f32"

    def _spill_oldest(self) -> None:
        client_id, vector = self._memory.popitem(last=False)
        vector.numpy().astype("<f4", copy=False).tofile(self._path(client_id))
        self._on_disk.add(client_id)
        self._spills += 1

    def _load(self, client_id: int) -> torch.Tensor:
        path = self._path(client_id)
        values = np.fromfile(path, dtype="<f4")
        if values.size != self._num_elements:
            raise OSError(f"spill file {path} holds {values.size} values, expected {self._num_elements}")
        self._loads += 1
        return torch.from_numpy(values.astype(np.float32, copy=False))
