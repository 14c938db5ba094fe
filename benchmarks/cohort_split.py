"""When a group pays for being split: one cohort on one thread against two cohorts side by side on two threads.

A training thread makes a few dozen tensor calls per cohort step whatever the cohort's size, and two threads making
small calls at once wait for each other at the GIL; splitting a group across the cores pays once each cohort's calls
are large. For each model and group size, interleaved ``--repeats`` times on a pool of two training threads (one
intra-op thread each, as the vectorized executor's), the script times the group trained as one cohort on one thread
and as two cohorts of half its size on both, and prints the medians of the wall times, ``one / split`` (above 1: the
split pays), the CPU per member of the single cohort, and how many cohorts
:func:`flasync.training.executors.threads.cohorts_for` makes of the group at that pace (the batcher's ``MIN_SPLIT`` and
``MIN_PART_S``).

Models: the tutorial MLP (32-64-10, 200 samples per client, batch 32: its own ``cohort_forward``) and the built-in
CNN on 8 x 8 images (50 samples per client, batch 16: through ``vmap``).

    python benchmarks/cohort_split.py [--sizes 64 100 160 256 400] [--repeats 5] [--models mlp cnn]

The medians go to ``benchmarks/results/cohort_split.json`` (``--out``; see ``benchmarks/record.py``), headed by the
split group's wall time against the single cohort's.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from cohort import CFG, CLASSES, FEATURES, HIDDEN, Workload
from record import Figure, machine, store

from flasync.core import seeding
from flasync.training.cohort import CohortMember, CohortResult, CohortTrainer
from flasync.training.executors.threads import CohortBatcher, _init_worker, cohorts_for
from flasync.training.local import LocalTraining, flat_parameters
from flasync.training.models import MLP, SmallCNN

CNN_SAMPLES = 50
CNN_CFG = LocalTraining(epochs=1, batch_size=16, lr=0.05)


class Group:
    """The data, partition and initial weights of the largest group of one model, and how to train a cohort of it."""

    def __init__(self, model: str, clients: int) -> None:
        """Draw the data."""
        if model == "mlp":
            work = Workload(clients, torch.device("cpu"))
            self.factory: Callable[[], torch.nn.Module] = lambda: MLP(FEATURES, HIDDEN, CLASSES)
            self.x, self.y, self.parts, self.base, self.cfg = work.x, work.y, work.parts, work.base, CFG
        else:
            generator = torch.Generator().manual_seed(0)
            self.x = torch.randn(clients * CNN_SAMPLES, 64, generator=generator)
            self.y = torch.randint(0, 10, (clients * CNN_SAMPLES,), generator=generator)
            self.parts = list(torch.arange(clients * CNN_SAMPLES).split(CNN_SAMPLES))
            self.factory = lambda: SmallCNN(in_channels=1, image_size=(8, 8), num_classes=10)
            torch.manual_seed(0)
            self.base = flat_parameters(self.factory())
            self.cfg = CNN_CFG
        self._local = threading.local()

    def train(self, clients: range) -> tuple[CohortResult, float]:
        """Train ``clients`` as one cohort on the calling thread's trainer; return the result and its CPU seconds."""
        trainer = getattr(self._local, "trainer", None)
        if trainer is None:
            trainer = self._local.trainer = CohortTrainer(self.factory())
        members = [
            CohortMember(indices=self.parts[c], generator=seeding.torch_stream(0, seeding.TASK, c, 0)) for c in clients
        ]
        began = time.thread_time()
        result = trainer.train(self.base, self.x, self.y, members, self.cfg)
        return result, time.thread_time() - began


def main() -> None:
    """Print one row per model and size."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 100, 160, 256, 400])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", nargs="+", choices=["mlp", "cnn"], default=["mlp", "cnn"])
    parser.add_argument("--out", type=Path, default=None, help="result file (default: benchmarks/results/)")
    args = parser.parse_args()
    described = machine()
    headline: list[Figure] = []
    figures: dict[str, dict[str, object]] = {}
    torch.set_num_threads(1)
    pool = ThreadPoolExecutor(2, initializer=_init_worker, initargs=(1, 1))
    header = f"{'model':>5} {'clients':>7} {'one cohort':>11} {'two cohorts':>12} {'one/split':>10}"
    print(f"{header} {'CPU/member':>11} parts")
    for model in args.models:
        group = Group(model, max(args.sizes))
        for _ in range(2):  # each thread builds its trainer, the first calls warm up
            for future in [pool.submit(group.train, range(8)) for _ in range(2)]:
                future.result()
        for size in args.sizes:
            one: list[float] = []
            split: list[float] = []
            cpu: list[float] = []
            for _ in range(args.repeats):
                began = time.perf_counter()
                _, seconds = pool.submit(group.train, range(size)).result()
                one.append(time.perf_counter() - began)
                cpu.append(seconds / size)
                began = time.perf_counter()
                halves = [pool.submit(group.train, r) for r in (range(size // 2), range(size // 2, size))]
                for future in halves:
                    future.result()
                split.append(time.perf_counter() - began)
            parts = cohorts_for(
                size,
                parallel=2,
                member_cpu_s=statistics.median(cpu),
                min_split=CohortBatcher.MIN_SPLIT,
                min_part_s=CohortBatcher.MIN_PART_S,
            )
            a, b = statistics.median(one), statistics.median(split)
            print(
                f"{model:>5} {size:>7} {1e3 * a:8.1f} ms {1e3 * b:9.1f} ms {a / b:9.2f}x"
                f" {1e3 * statistics.median(cpu):8.3f} ms {parts:>5}"
            )
            figures.setdefault(model, {})[str(size)] = {
                "one_s": one,
                "split_s": split,
                "cpu_per_member_s": cpu,
                "parts": parts,
            }
            headline.append(Figure(f"{model}, {size} clients: two cohorts side by side", b, "s", "one cohort", b / a))
    pool.shutdown()
    settings = {"sizes": args.sizes, "repeats": args.repeats, "models": args.models}
    store("cohort_split", described, settings=settings, headline=headline, figures=figures, out=args.out)


if __name__ == "__main__":
    main()
