"""Where local training runs: worker threads that each reuse one model.

PyTorch releases the GIL inside its kernels, so a small pool of threads overlaps client training without
pickling models or data between processes. Each worker thread builds its model once, on first use, and reuses it
for every client it trains (weights are loaded with one ``copy_``).

Each worker also gets its own intra-op thread count: with torch's OpenMP backend, ``torch.set_num_threads`` called in
a thread sizes that thread's OpenMP team. The default of one is what small FL models want: an intra-op team per
worker would spin on the cores the event loop and the other workers need, which measured 3.6x slower per client on
two cores.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor

import torch
from torch import nn

from flasync.training import FlatModel

__all__ = ["ModelPool", "ThreadTrainingExecutor"]


class ModelPool:
    """One :class:`FlatModel` per worker thread, built lazily from a factory."""

    def __init__(self, factory: Callable[[], nn.Module]) -> None:
        """Remember the factory; nothing is built yet."""
        self._factory = factory
        self._local = threading.local()
        self._lock = threading.Lock()
        self.built = 0

    def get(self) -> FlatModel:
        """Return the calling thread's model, building it on first use."""
        model: FlatModel | None = getattr(self._local, "model", None)
        if model is None:
            model = FlatModel(self._factory())
            self._local.model = model
            with self._lock:
                self.built += 1
        return model


def _init_worker(threads: int, default: int) -> None:
    """Size this worker's OpenMP team, leaving torch's default for other threads as it was."""
    # torch sizes a thread's team from the process default on the thread's first parallel call; make that happen
    # now, or it would later undo the size set below.
    torch.get_num_threads()
    torch.set_num_threads(threads)
    # set_num_threads also stores the count that threads created later start with; a throwaway thread puts that
    # default back without touching this worker's own team.
    restore = threading.Thread(target=torch.set_num_threads, args=(default,), name="flasync-threads-restore")
    restore.start()
    restore.join()


class ThreadTrainingExecutor:
    """A thread pool plus the per-thread models its jobs train.

    Args:
        factory: Builds the user's ``nn.Module`` (called once per worker thread).
        workers: Number of threads.
        threads_per_worker: Intra-op (OpenMP) threads of each worker's torch kernels.
    """

    def __init__(self, factory: Callable[[], nn.Module], *, workers: int, threads_per_worker: int = 1) -> None:
        """Start no threads yet; they start with the first job."""
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {threads_per_worker}")
        self.workers = workers
        self.threads_per_worker = threads_per_worker
        self.models = ModelPool(factory)
        self.pool: Executor = ThreadPoolExecutor(
            max_workers=workers,
            thread_name_prefix="flasync-train",
            initializer=_init_worker,
            initargs=(threads_per_worker, torch.get_num_threads()),
        )

    def shutdown(self) -> None:
        """Cancel queued jobs and wait for running ones."""
        self.pool.shutdown(wait=True, cancel_futures=True)
