"""CPU per client of one vectorized cohort: the model's own ``cohort_forward`` against ``vmap`` over ``forward``.

The tutorial workload (MLP 32-64-10, 200 samples per client, batch 32, 1 local epoch, SGD lr 0.01), one intra-op
thread. For each cohort size, both trainers train the same cohort from the same weights, interleaved, ``--repeats``
times; printed are the medians of the calling thread's CPU seconds per client (``time.thread_time``: what other
processes on a shared machine do weighs less on it than on wall time) and their ratio, and whether the deltas of
the two paths are equal bit for bit.

    python benchmarks/cohort_step.py [--sizes 8 16 32 100] [--repeats 7]

With ``--baseline DIR`` (another flasync checkout) it prints instead the CPU per client of the model's own path in
this tree and in ``DIR``, each measured in a fresh interpreter with that tree's flasync, the two trees interleaved in
every repeat, and the ratio of their medians: what a change to the cohort trainer or the MLP's step gained.

Either way the medians go to ``benchmarks/results/cohort_step.json`` (``--out``; see ``benchmarks/record.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from cohort import CFG, FEATURES, HIDDEN, Workload
from record import Figure, machine, store

from flasync.training.cohort import CohortMember, CohortTrainer
from flasync.training.models import MLP

CLASSES = 10
ROOT = Path(__file__).resolve().parents[1]

# Run in a fresh interpreter with a tree's flasync and benchmarks first on sys.path: argv = the cohort sizes, the
# calls per size. Prints one JSON object, size -> CPU milliseconds per client of the model's own path.
DRIVER = """
import json, sys, time
import torch
from cohort import CFG, FEATURES, HIDDEN, Workload
from record import Figure, machine, store
from flasync.training.cohort import CohortMember, CohortTrainer
from flasync.training.models import MLP
torch.set_num_threads(1)
sizes, calls = [int(s) for s in sys.argv[1].split(",")], int(sys.argv[2])
work = Workload(max(sizes), torch.device("cpu"))
trainer = CohortTrainer(MLP(FEATURES, HIDDEN, 10))
figures = {}
for size in sizes:
    for warm in (True, False):
        began = time.thread_time()
        for _ in range(1 if warm else calls):
            members = [CohortMember(indices=work.parts[c], generator=work.generator(c)) for c in range(size)]
            trainer.train(work.base, work.x, work.y, members, CFG)
    figures[size] = 1e3 * (time.thread_time() - began) / calls / size
print(json.dumps(figures))
"""


def per_client_cpu_ms(trainer: CohortTrainer, work: Workload, size: int, calls: int = 5) -> float:
    """Train the first ``size`` clients ``calls`` times; return CPU milliseconds per client."""
    began = time.thread_time()
    for _ in range(calls):
        members = [CohortMember(indices=work.parts[c], generator=work.generator(c)) for c in range(size)]
        trainer.train(work.base, work.x, work.y, members, CFG)
    return 1e3 * (time.thread_time() - began) / calls / size


def tree_cpu_ms(tree: Path, sizes: list[int], calls: int = 5) -> dict[int, float]:
    """Return CPU milliseconds per client of the model's own path for each size, measured with ``tree``'s flasync."""
    path = os.pathsep.join([str(tree / "benchmarks"), str(tree), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, ",".join(map(str, sizes)), str(calls)],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"the measurement failed in {tree}:\n{done.stderr[-3000:]}")
    return {int(size): ms for size, ms in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def against_baseline(baseline: Path, sizes: list[int], repeats: int, out: Path | None) -> None:
    """Print the model's own path's CPU per client in this tree and in ``baseline``, interleaved, and the ratio; store
    them."""
    described = machine()
    trees = {"this": ROOT, "baseline": baseline.resolve()}
    runs: dict[str, list[dict[int, float]]] = {name: [] for name in trees}
    for _ in range(repeats):
        for name, tree in trees.items():
            runs[name].append(tree_cpu_ms(tree, sizes))
    print(f"CPU per client of the model's own path, medians of {repeats} interleaved repeats ({trees['baseline']})")
    print(f"{'K':>5} {'this':>10} {'baseline':>10} {'baseline/this':>14}")
    headline: list[Figure] = []
    for size in sizes:
        this = statistics.median(run[size] for run in runs["this"])
        base = statistics.median(run[size] for run in runs["baseline"])
        print(f"{size:>5} {this:7.3f} ms {base:7.3f} ms {base / this:13.2f}x")
        headline.append(Figure(f"K {size}: CPU per client, this tree", this, "ms", "baseline tree", this / base))
    settings = {"mode": "baseline", "baseline": str(trees["baseline"]), "sizes": sizes, "repeats": repeats}
    store("cohort_step", described, settings=settings, headline=headline, figures=runs, out=out)


def main() -> None:
    """Print CPU per client of both paths and their ratio for each cohort size."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 100])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--baseline", type=Path, help="another flasync checkout: compare the model's own path")
    parser.add_argument("--out", type=Path, default=None, help="result file (default: benchmarks/results/)")
    args = parser.parse_args()
    if args.baseline is not None:
        against_baseline(args.baseline, args.sizes, args.repeats, args.out)
        return
    described = machine()
    headline: list[Figure] = []
    figures: dict[str, dict[str, object]] = {}
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
        figures[str(size)] = {"cohort_forward_ms": fast, "vmap_ms": slow, "equal_deltas": same}
        headline.append(Figure(f"K {size}: CPU per client, cohort_forward", f, "ms", "vmap over forward", f / s))
    settings = {"mode": "paths", "sizes": args.sizes, "repeats": args.repeats}
    store("cohort_step", described, settings=settings, headline=headline, figures=figures, out=args.out)


if __name__ == "__main__":
    main()
