"""What making a model version costs the event loop, by model size: FedBuff runs whose loop CPU is mostly the
version's own tensor work once the model is large.

Each run is ``flasync.run`` of FedBuff (buffer ``K=2``, 4 tasks in flight, 8 clients, every client's 20 samples
one batch) on an MLP of 32 inputs, the given hidden layers and 10 classes, with the default diagnostics (the
profiler and the ``basic`` alert monitor: each version's weight norm, drift and step) and tracking off. The figure
is the event loop thread's CPU time in the server's run (``time.thread_time``) over the versions it made: the
aggregator's step, the finite check, the published copy, the monitor's figures, and the loop's per-update work,
which is small next to them here. With ``--baseline CHECKOUT`` each run of this tree and of that checkout is made in
its own process (after a warm-up run there), interleaved, and the paired ratio of their figures printed.

    python benchmarks/version_cost.py [--hidden 64 1024,1024 2048,2048] [--versions 40] [--repeats 5]
        [--baseline CHECKOUT]

The figures go to ``benchmarks/results/version_cost.json`` (``--out``; see ``benchmarks/record.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import flasync

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cohort import phase_marks
from record import Figure, machine, store

FEATURES, CLASSES = 32, 10


def config(hidden: list[int], versions: int) -> dict[str, Any]:
    """The run measured: FedBuff over a model of ``hidden`` layers until ``versions`` versions are made."""
    return {
        "seed": 0,
        "data": {"kind": "synthetic", "samples_per_client": 20, "num_features": FEATURES, "test_samples": 100},
        "partition": {"kind": "iid"},
        "model": {"kind": "mlp", "hidden": hidden},
        "population": {"num_clients": 8},
        "client": {"epochs": 1, "batch_size": 20, "lr": 0.01},
        "server": {"kind": "fedbuff", "buffer_size": 2, "concurrency": 4},
        "executor": {"kind": "vectorized"},
        "eval": {"every_versions": 100_000},
        "stop": {"max_versions": versions},
        "tracking": {"enabled": False, "log_level": "warning", "log_model": False},
    }


def loop_ms_per_version(hidden: list[int], versions: int) -> tuple[float, int]:
    """Run once; return the loop thread's CPU ms per version made and the model's parameter count."""
    with phase_marks() as marks:  # the server run's CPU clock of the event loop's thread, as cohort.py reads it
        summary = flasync.run(config(hidden, versions))
    ((cpu_start, cpu_end),) = marks["serve_cpu"]
    params = sum(a * b + b for a, b in zip([FEATURES, *hidden], [*hidden, CLASSES], strict=True))
    return 1000 * (cpu_end - cpu_start) / summary.versions, params


def measured_in(tree: Path, hidden: list[int], versions: int) -> float:
    """:func:`loop_ms_per_version` in a fresh process importing flasync from ``tree``, after a warm-up run there."""
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", ",".join(map(str, hidden))]
    command += ["--versions", str(versions)]
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    figure: float = json.loads(done.stdout.strip().splitlines()[-1])
    return figure


def main() -> None:
    """Measure each model size; print and store the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--hidden", nargs="+", default=["64", "1024,1024", "2048,2048"], help="each model's hidden layers, e.g. 512,512"
    )
    parser.add_argument("--versions", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", type=Path, default=None, help="an older checkout of flasync, measured alike")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help="result file (default: benchmarks/results/)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.worker is not None:
        hidden = [int(h) for h in args.worker.split(",")]
        loop_ms_per_version(hidden, 4)
        print(json.dumps(loop_ms_per_version(hidden, args.versions)[0]))
        return
    described = machine()
    trees = {"this tree": Path(__file__).resolve().parent.parent}
    if args.baseline is not None:
        trees["baseline"] = args.baseline
    headline: list[Figure] = []
    figures: dict[str, Any] = {}
    print(f"{'model':>22} {'params':>10} " + " ".join(f"{name:>11}" for name in trees) + "   (loop CPU ms per version)")
    for spec in args.hidden:
        hidden = [int(h) for h in spec.split(",")]
        _, params = loop_ms_per_version(hidden, 4)  # the model's size (and a warm-up when no baseline is run)
        rows: dict[str, list[float]] = {name: [] for name in trees}
        for _ in range(args.repeats):
            for name, tree in trees.items():
                if args.baseline is None:
                    rows[name].append(loop_ms_per_version(hidden, args.versions)[0])
                else:
                    rows[name].append(measured_in(tree, hidden, args.versions))
        medians = {name: statistics.median(values) for name, values in rows.items()}
        label = f"MLP {FEATURES}-{'-'.join(map(str, hidden))}-{CLASSES}"
        line = f"{label:>22} {params:>10,} " + " ".join(f"{medians[name]:11.3f}" for name in trees)
        ratio = None
        if args.baseline is not None:
            pairs = [ours / theirs for ours, theirs in zip(rows["this tree"], rows["baseline"], strict=True)]
            ratio = statistics.median(pairs)
            line += f"   {ratio:.2f}x (paired; {min(pairs):.2f}x to {max(pairs):.2f}x)"
        print(line, flush=True)
        headline.append(
            Figure(
                name=f"{label} ({params:,} parameters): loop CPU per version",
                value=medians["this tree"],
                unit="ms",
                baseline=None if ratio is None else f"baseline checkout ({medians['baseline']:.3f} ms)",
                ratio=ratio,
            )
        )
        figures[label] = {"params": params, "loop_ms_per_version": rows}
    settings = {"versions": args.versions, "repeats": args.repeats, "baseline": args.baseline is not None}
    store("version_cost", described, settings=settings, headline=headline, figures=figures, out=args.out)


if __name__ == "__main__":
    main()
