"""CPU per client of one vectorized cohort: the model's own ``cohort_forward`` against ``vmap`` over ``forward``.

The tutorial workload (MLP 32-64-10, 200 samples per client, batch 32, 1 local epoch, SGD lr 0.01), one intra-op
thread. For each cohort size, both trainers train the same cohort from the same weights, interleaved, ``--repeats``
times; printed are the medians of the calling thread's CPU seconds per client (``time.thread_time``: what other
processes on a shared machine do weighs less on it than on wall time) and their ratio, and whether the deltas of
the two paths are equal bit for bit.

    python benchmarks/cohort_step.py [--sizes 8 16 32 100] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from cohort import CFG, FEATURES, HIDDEN, Workload

from flasync.cohort import CohortMember, CohortTrainer
from flasync.models import MLP

CLASSES = 10


def per_client_cpu_ms(trainer: CohortTrainer, work: Workload, size: int, calls: int = 5) -> float:
    """Train the first ``size`` clients ``calls`` times; return CPU milliseconds per client."""
    began = time.thread_time()
    for _ in range(calls):
        members = [CohortMember(indices=work.parts[c], generator=work.generator(c)) for c in range(size)]
        trainer.train(work.base, work.x, work.y, members, CFG)
    return 1e3 * (time.thread_time() - began) / calls / size


def main() -> None:
    """Print CPU per client of both paths and their ratio for each cohort size."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 100])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Workload(max(args.sizes), torch.device("cpu"))
    own = CohortTrainer(MLP(FEATURES, HIDDEN, CLASSES))
    plain = CohortTrainer(MLP(FEATURES, HIDDEN, CLASSES))
    plain._cohort_forward = None  # vmap over forward
    print(f"{'K':>5} {'cohort_forward':>15} {'vmap':>9} {'ratio':>7}  deltas")
    for size in args.sizes:
        members = [CohortMember(indices=work.parts[c], generator=work.generator(c)) for c in range(size)]
        a = own.train(work.base, work.x, work.y, members, CFG).results
        members = [CohortMember(indices=work.parts[c], generator=work.generator(c)) for c in range(size)]
        b = plain.train(work.base, work.x, work.y, members, CFG).results
        same = all(torch.equal(x.delta, y.delta) for x, y in zip(a, b, strict=True))
        fast: list[float] = []
        slow: list[float] = []
        for _ in range(args.repeats):
            fast.append(per_client_cpu_ms(own, work, size))
            slow.append(per_client_cpu_ms(plain, work, size))
        f, s = statistics.median(fast), statistics.median(slow)
        print(f"{size:>5} {f:12.3f} ms {s:6.3f} ms {s / f:6.2f}x  {'equal' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
