"""The whole ``flasync.run(config)`` call, tracked and untracked: what tracking costs a short run, as a user waits.

The tutorial workload at 100 clients x 20 FedAvg rounds (MLP 32-64-10, 200 samples per client, batch 32, 1 epoch,
SGD 0.01; ``executor.kind = "auto"``, as a user gets it), with tracking off, with tracking on (the defaults: MLflow's
writer process, the artifacts, the plots and the model in ``pt2``) into a store that exists, and tracking on without
the model. Two ways to call it:

* ``fresh``: each call in a fresh interpreter that imports torch and flasync first and then times the call alone, as
  a script that trains once would: every tracked call is the first of its process;
* ``session``: one interpreter makes ``--session-pairs`` pairs of calls (untracked, then tracked, the same store), as
  a sweep, a notebook or a service embedding flasync does: its first tracked call starts MLflow's writer process,
  the later ones reuse it (kept idle between runs, see :mod:`flasync.tracking._child`).

Runners alternate within each repeat, so a shared machine's drift hits them alike. Printed per runner: the medians of
the call's seconds, of client updates per second of the call, of the federation's own ``wall_s``, of the seconds of
the call outside the federation (start-up and end: the run's artifacts, plots and model), and of the CPU seconds of
the process and of its child processes during the call (MLflow's writer process, the plots' one-shot process); then
each tracked runner's updates/s against the untracked one of the same repeat (median of the per-repeat ratios; in a
session, against the untracked call just before it).

    python benchmarks/whole_run.py                        # 5 repeats: about 4 minutes on 2 cores
    python benchmarks/whole_run.py --baseline ../flasync-old   # also an older checkout, interleaved, same runners

Every call's figures, the medians and the ratios go to ``benchmarks/results/whole_run.json`` (``--out``; see
``benchmarks/record.py``), headed by each tracked runner's updates per second over the untracked runner's of the same
repeat and its extra seconds a call.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import Figure, machine, store  # noqa: E402

# Run in each fresh interpreter: argv = the calls' tracking modes ("off", "on" or "no-model", comma-separated), the
# store's URI. One JSON line of figures per call.
DRIVER = """
import json, resource, sys, time
import psutil
import torch
import flasync
modes, uri = sys.argv[1].split(","), sys.argv[2]
me = psutil.Process()

def children_cpu():
    # CPU seconds of the live child processes, and of those already reaped.
    total = 0.0
    for child in me.children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    ended = resource.getrusage(resource.RUSAGE_CHILDREN)
    return total + ended.ru_utime + ended.ru_stime

def config(mode):
    return {
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

for mode in modes:
    cpu, child_cpu = time.process_time(), children_cpu()
    began = time.perf_counter()
    summary = flasync.run(config(mode))
    call_s = time.perf_counter() - began
    print(json.dumps({
        "mode": mode,
        "call_s": call_s,
        "updates_per_s": summary.updates_accepted / call_s,
        "wall_s": summary.wall_s,
        "outside_s": call_s - summary.wall_s,
        "cpu_s": time.process_time() - cpu,
        "child_cpu_s": children_cpu() - child_cpu,
    }), flush=True)
"""
RUNNERS = ("off", "on", "no-model")
LABELS = {
    "off": "tracking off",
    "on": "tracking on",
    "no-model": "tracking on, no model",
    "session-off": "session: off",
    "session-first": "session: 1st tracked",
    "session-later": "session: later tracked",
}
FIGURES = ("call_s", "updates_per_s", "wall_s", "outside_s", "cpu_s", "child_cpu_s")
Figures = dict[str, float]


def calls(tree: Path, modes: list[str], uri: str, cache: Path) -> list[Figures]:
    """Run the driver once with ``tree``'s flasync, making one call per mode; return each call's figures."""
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    env["XDG_CACHE_HOME"] = str(cache)
    # Every fresh process's writer a process of its own: a writer server left by an earlier command (which
    # benchmarks/startup.py measures) would make the fresh calls cheaper only where one happens to be running.
    env["FLASYNC_WRITER_SERVER"] = "0"
    # Run from the cache's folder: `python -c` puts the working directory first on sys.path, before PYTHONPATH.
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, ",".join(modes), uri],
        cwd=cache.parent,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"the run failed ({tree}, {modes}):\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.strip().splitlines() if line.startswith("{")]


def session(tree: Path, pairs: int, uri: str, cache: Path) -> dict[str, list[tuple[Figures, Figures]]]:
    """Run ``pairs`` (untracked, tracked) pairs of calls in one interpreter; return them as the first tracked pair
    and the later ones."""
    figures = calls(tree, ["off", "on"] * pairs, uri, cache)
    paired = list(zip(figures[::2], figures[1::2], strict=True))
    return {"session-first": paired[:1], "session-later": paired[1:]}


def print_medians(label: str, runs: list[Figures]) -> None:
    """Print one row of medians."""
    med = medians(runs)
    print(
        f"{label:<40} {med['call_s']:>7.2f} {med['updates_per_s']:>10.1f} {med['wall_s']:>7.2f}"
        f" {med['outside_s']:>8.2f} {med['cpu_s']:>6.2f} {med['child_cpu_s']:>10.2f}"
    )


def medians(runs: list[Figures]) -> Figures:
    """Return the median of each figure of ``runs``."""
    return {f: statistics.median(r[f] for r in runs) for f in FIGURES}


def ratio(pairs: list[tuple[Figures, Figures]]) -> dict[str, float]:
    """Return the median of the tracked/untracked updates/s ratios of ``pairs`` and the median extra seconds."""
    ratios = [on["updates_per_s"] / off["updates_per_s"] for off, on in pairs]
    extra = statistics.median(on["call_s"] - off["call_s"] for off, on in pairs)
    return {"ratio": statistics.median(ratios), "extra_s": extra, "pairs": len(pairs)}


def print_ratio(label: str, pairs: list[tuple[Figures, Figures]]) -> dict[str, float]:
    """Print :func:`ratio` of ``pairs``; return it."""
    found = ratio(pairs)
    print(f"  {label:<40} {found['ratio']:.2f}x  ({found['extra_s']:+.2f} s a call, {len(pairs)} pairs)")
    return found


def main() -> None:
    """Run the repeats and print the medians and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--session-pairs", type=int, default=4, help="(untracked, tracked) pairs in one process")
    parser.add_argument("--no-fresh", action="store_true", help="only the session runner")
    parser.add_argument("--baseline", type=Path, help="another flasync checkout to run the same way, interleaved")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "whole_run.json", help="results")
    args = parser.parse_args()
    described = machine()
    print(f"{described['cpu']}, {described['cpus']} CPUs, load {described['load_average_1m']}, {described['commit']}")
    trees = {"this": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    fresh: dict[tuple[str, str], list[Figures]] = {(t, m): [] for t in trees for m in RUNNERS}
    sessions: dict[tuple[str, str], list[tuple[Figures, Figures]]] = {
        (t, m): [] for t in trees for m in ("session-first", "session-later")
    }
    with tempfile.TemporaryDirectory(prefix="flasync-whole-run-") as tmp:
        cache = Path(tmp, "cache")
        for name, tree in trees.items():  # each tree's store exists before the timed runs
            calls(tree, ["on"], f"sqlite:///{tmp}/{name}/mlflow.db", cache)
        for _ in range(args.repeats):
            for name, tree in trees.items():
                uri = f"sqlite:///{tmp}/{name}/mlflow.db"
                if not args.no_fresh:
                    for mode in RUNNERS:
                        fresh[name, mode].extend(calls(tree, [mode], uri, cache))
                if args.session_pairs:
                    for runner, pairs in session(tree, args.session_pairs, uri, cache).items():
                        sessions[name, runner].extend(pairs)

    print(f"flasync.run(config), tutorial FedAvg 100 clients x 20 rounds; {args.repeats} repeats")
    print("medians:")
    header = f"{'tree, runner':<40} {'call s':>7} {'updates/s':>10} {'wall_s':>7} {'outside':>8} {'CPU s':>6}"
    print(f"{header} {'child CPU':>10}")
    for name in trees:
        if not args.no_fresh:
            for mode in RUNNERS:
                print_medians(f"{name}, fresh: {LABELS[mode]}", fresh[name, mode])
        if args.session_pairs:
            every = sessions[name, "session-first"] + sessions[name, "session-later"]
            print_medians(f"{name}, {LABELS['session-off']}", [off for off, _ in every])
            for runner in ("session-first", "session-later"):
                if sessions[name, runner]:
                    print_medians(f"{name}, {LABELS[runner]}", [on for _, on in sessions[name, runner]])
    print("tracked updates/s against untracked, per repeat (median; the goal is >= 0.85x):")
    stored: dict[str, dict[str, object]] = {}
    headline: list[Figure] = []
    for name, tree in trees.items():
        ratios, calls_made = {}, {}
        if not args.no_fresh:
            off = fresh[name, "off"]
            calls_made |= {f"fresh {mode}": fresh[name, mode] for mode in RUNNERS}
            for mode in RUNNERS[1:]:
                label = f"{name}, fresh: {LABELS[mode]}"
                ratios[f"fresh {mode}"] = print_ratio(label, list(zip(off, fresh[name, mode], strict=True)))
        for runner in ("session-first", "session-later"):
            if sessions[name, runner]:
                ratios[runner] = print_ratio(f"{name}, {LABELS[runner]}", sessions[name, runner])
                calls_made[runner] = [list(pair) for pair in sessions[name, runner]]
        medians_made = {key: medians(runs) for key, runs in calls_made.items() if key.startswith("fresh")}
        stored[name] = {"path": str(tree), "medians": medians_made, "ratios": ratios, "calls": calls_made}
        for key, found in ratios.items():  # paired per repeat: the untracked call of the same repeat is the baseline
            headline.append(Figure(f"{name}, {key}: tracked updates/s over untracked", found["ratio"], "x"))
            headline.append(Figure(f"{name}, {key}: extra seconds a tracked call", found["extra_s"], "s"))
    store(
        "whole_run",
        described,
        settings={"repeats": args.repeats, "session_pairs": args.session_pairs, "fresh": not args.no_fresh},
        headline=headline,
        figures={"load_average_1m_at_end": round(os.getloadavg()[0], 2), "trees": stored},
        out=args.out,
    )


if __name__ == "__main__":
    main()
