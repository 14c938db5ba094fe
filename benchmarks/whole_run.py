"""The whole ``flasync.run(config)`` call, tracked and untracked: what tracking costs a short run, as a user waits.

The tutorial workload at 100 clients x 20 FedAvg rounds (MLP 32-64-10, 200 samples per client, batch 32, 1 epoch,
SGD 0.01; ``executor.kind = "auto"``, as a user gets it). Each run is a fresh interpreter that imports torch and
flasync first and then times the call alone, as a script that trains would: with tracking off, with tracking on (the
defaults: MLflow's writer process, the artifacts, the plots and the model in ``pt2``) into a store that exists, and
tracking on without the model. Runners alternate within each repeat, so a shared machine's drift hits them alike.

Printed per runner: the medians of the call's seconds, of client updates per second of the call, of the
federation's own ``wall_s``, and of the CPU seconds of the process and of its children (MLflow's writer process);
then each tracked runner's updates/s against the untracked one of the same repeat (median of the per-repeat ratios).

    python benchmarks/whole_run.py                        # 5 repeats: about 3 minutes on 2 cores
    python benchmarks/whole_run.py --baseline ../flasync-old   # also an older checkout, interleaved, same runners
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run in each fresh interpreter: argv = tracking ("off", "on" or "no-model"), the store's URI.
DRIVER = """
import json, resource, sys, time
import torch
import flasync
mode, uri = sys.argv[1], sys.argv[2]
config = {
    "seed": 0,
    "data": {"kind": "synthetic", "samples_per_client": 200, "num_features": 32, "num_classes": 10},
    "partition": {"kind": "iid"},
    "model": {"kind": "mlp", "hidden": [64]},
    "population": {"num_clients": 100},
    "client": {"epochs": 1, "batch_size": 32, "lr": 0.01},
    "server": {"kind": "fedavg", "clients_per_round": 100},
    "stop": {"max_versions": 20},
    "tracking": {"enabled": mode != "off", "uri": uri, "log_model": mode == "on", "log_level": "warning"},
}
began = time.perf_counter()
summary = flasync.run(config)
call_s = time.perf_counter() - began
me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({
    "call_s": call_s,
    "updates_per_s": summary.updates_accepted / call_s,
    "wall_s": summary.wall_s,
    "cpu_s": me.ru_utime + me.ru_stime,
    "child_cpu_s": children.ru_utime + children.ru_stime,
}))
"""
RUNNERS = ("off", "on", "no-model")
LABELS = {"off": "tracking off", "on": "tracking on", "no-model": "tracking on, no model"}
FIGURES = ("call_s", "updates_per_s", "wall_s", "cpu_s", "child_cpu_s")


def one(tree: Path, mode: str, uri: str, cache: Path) -> dict[str, float]:
    """Run the driver once with ``tree``'s flasync; return its figures."""
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    env["XDG_CACHE_HOME"] = str(cache)
    # Run from the cache's folder: `python -c` puts the working directory first on sys.path, before PYTHONPATH.
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, mode, uri],
        cwd=cache.parent,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"the run failed ({tree}, {mode}):\n{done.stderr[-3000:]}")
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def main() -> None:
    """Run the repeats and print the medians and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", type=Path, help="another flasync checkout to run the same way, interleaved")
    args = parser.parse_args()
    trees = {"this": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    results: dict[tuple[str, str], list[dict[str, float]]] = {(t, m): [] for t in trees for m in RUNNERS}
    with tempfile.TemporaryDirectory(prefix="flasync-whole-run-") as tmp:
        for name, tree in trees.items():  # each tree's store exists before the timed runs
            one(tree, "on", f"sqlite:///{tmp}/{name}/mlflow.db", Path(tmp, "cache"))
        for _ in range(args.repeats):
            for name, tree in trees.items():
                for mode in RUNNERS:
                    uri = f"sqlite:///{tmp}/{name}/mlflow.db"
                    results[name, mode].append(one(tree, mode, uri, Path(tmp, "cache")))

    print(f"flasync.run(config), tutorial FedAvg 100 clients x 20 rounds, a fresh process each; {args.repeats} repeats")
    print("medians:")
    print(f"{'tree':<9} {'runner':<22} {'call s':>7} {'updates/s':>10} {'wall_s':>7} {'CPU s':>6} {'child CPU s':>12}")
    for (name, mode), runs in results.items():
        med = {f: statistics.median(r[f] for r in runs) for f in FIGURES}
        print(
            f"{name:<9} {LABELS[mode]:<22} {med['call_s']:>7.2f} {med['updates_per_s']:>10.1f} {med['wall_s']:>7.2f}"
            f" {med['cpu_s']:>6.2f} {med['child_cpu_s']:>12.2f}"
        )
    print("tracked updates/s against untracked, per repeat (median; the goal is >= 0.85x):")
    for name in trees:
        off = results[name, "off"]
        for mode in RUNNERS[1:]:
            ratios = [a["updates_per_s"] / b["updates_per_s"] for a, b in zip(results[name, mode], off, strict=True)]
            extra = statistics.median(a["call_s"] - b["call_s"] for a, b in zip(results[name, mode], off, strict=True))
            print(f"  {name:<9} {LABELS[mode]:<22} {statistics.median(ratios):.2f}x  ({extra:+.2f} s a call)")


if __name__ == "__main__":
    main()
