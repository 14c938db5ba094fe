"""Client-side evaluation: what it costs, and what it shows on non-IID digits next to the central accuracy.

    python benchmarks/client_eval.py                 # about a minute on 2 cores
    python benchmarks/client_eval.py --repeats 5 --versions 150

One configuration, FedBuff on digits split among 40 clients by label with Dirichlet(0.1) (most clients hold two or
three digits), each client holding out 20% of its samples for its own evaluation:

* **overhead**: the same run with client-side evaluation on 10% of tasks (``eval.clients.fraction = 0.1``) and with
  none (``held_out = 0.2`` alone: the same split, so both train on exactly the same samples), alternated
  ``--repeats`` times in this process, tracking off. Printed: the median wall seconds of each, their ratio (on a
  shared machine the wall ratio moves with the load; the profile's own figures do not), the clients' evaluation
  seconds (``client_eval_s`` of the profile) over their training seconds (``compute_s``), and whether both ended
  with the same weights (they must: evaluating changes no training);
* **spread**: the same run with every task evaluating (``fraction = 1``, a version closing at 5 reports) and the
  central evaluation every 10 versions: at each version both evaluated, the central accuracy beside the clients'
  mean, p10, p50, p90 and worst decile. On non-IID data the central accuracy hides how unevenly the model serves
  its clients; the clients' spread shows it.

The figures and the machine's description go to ``benchmarks/results/client_eval.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import flasync  # noqa: E402
from flasync.config import load_config  # noqa: E402
from flasync.core.events import ClientsEvaluated, Evaluated  # noqa: E402
from flasync.testing import EventRecorder  # noqa: E402

if __package__:
    from benchmarks.flood import machine
else:
    from flood import machine

_BASE = [
    "seed=0",
    "data.kind=digits",
    "partition.kind=dirichlet",
    "partition.alpha=0.1",
    "population.num_clients=40",
    "executor.kind=thread",
    "tracking.enabled=false",
    "tracking.log_level=warning",
    "eval.clients.held_out=0.2",
]


def _run(overrides: list[str]) -> tuple[flasync.RunSummary, dict[str, Any], EventRecorder]:
    federation = flasync.Federation(load_config(None, overrides))
    recorder = EventRecorder(federation.bus)
    summary = asyncio.run(federation.run())
    return summary, federation.profile or {}, recorder


def overhead(versions: int, repeats: int) -> dict[str, Any]:
    """Time the run with client-side evaluation on 10% of tasks against the same run without, alternated."""
    base = [*_BASE, f"stop.max_versions={versions}"]
    arms = {"none": base, "fraction_0.1": [*base, "eval.clients.fraction=0.1", "eval.clients.min_reports=1"]}
    _run(base)  # warm-up: imports, allocator, digits cache
    walls: dict[str, list[float]] = {name: [] for name in arms}
    client_eval_s: dict[str, list[float]] = {name: [] for name in arms}
    compute_s: dict[str, list[float]] = {name: [] for name in arms}
    hashes: dict[str, set[str]] = {name: set() for name in arms}
    reports = 0
    for _ in range(repeats):
        for name, overrides in arms.items():
            start = time.perf_counter()
            summary, profile, recorder = _run(overrides)
            walls[name].append(time.perf_counter() - start)
            totals = profile.get("time", {}).get("totals", {})
            client_eval_s[name].append(float(totals.get("client_eval_s", 0.0)))
            compute_s[name].append(float(totals.get("compute_s", 0.0)))
            hashes[name].add(summary.weights_sha256)
            if name != "none":
                reports = sum(closed.reports for closed in recorder.of(ClientsEvaluated))
    median = {name: statistics.median(values) for name, values in walls.items()}
    return {
        "versions": versions,
        "repeats": repeats,
        "wall_s": walls,
        "median_wall_s": median,
        "ratio": median["fraction_0.1"] / median["none"],
        "client_eval_s": client_eval_s,
        "compute_s": compute_s,
        "eval_share_of_compute": statistics.median(client_eval_s["fraction_0.1"])
        / statistics.median(compute_s["fraction_0.1"]),
        "reports_counted": reports,
        "same_weights": len(hashes["none"] | hashes["fraction_0.1"]) == 1,
    }


def spread(versions: int) -> dict[str, Any]:
    """Run with every task evaluating; return, per version evaluated both ways, the central and clients' figures."""
    overrides = [
        *_BASE,
        f"stop.max_versions={versions}",
        "eval.every_versions=10",
        "eval.clients.fraction=1.0",
        "eval.clients.min_reports=5",
    ]
    summary, _, recorder = _run(overrides)
    central = {int(e.version): e.accuracy for e in recorder.of(Evaluated)}
    rows = []
    for closed in recorder.of(ClientsEvaluated):
        version = int(closed.version)
        if version in central:
            rows.append(
                {
                    "version": version,
                    "central": central[version],
                    "reports": closed.reports,
                    **closed.figures["accuracy"],
                }
            )
    rows.sort(key=lambda row: row["version"])
    return {"versions": versions, "final_accuracy": summary.accuracy, "rows": rows}


def main() -> None:
    """Measure both parts, print them, and write the JSON result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=100, help="model versions of each run")
    parser.add_argument("--repeats", type=int, default=3, help="alternated pairs of overhead runs")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "client_eval.json")
    args = parser.parse_args()
    cost = overhead(args.versions, args.repeats)
    print(f"{args.versions} versions, {args.repeats} pairs; median wall s:")
    print(f"  no client evaluation     {cost['median_wall_s']['none']:.2f}")
    print(
        f"  10% of tasks evaluate    {cost['median_wall_s']['fraction_0.1']:.2f}  ({cost['reports_counted']} reports)"
    )
    print(f"  ratio                    {cost['ratio']:.3f}")
    print(f"  clients' evaluation s    {statistics.median(cost['client_eval_s']['fraction_0.1']):.3f}")
    print(f"  clients' training s      {statistics.median(cost['compute_s']['fraction_0.1']):.3f}")
    print(f"  evaluation / training    {cost['eval_share_of_compute']:.4f}")
    print(f"  same final weights       {cost['same_weights']}")
    seen = spread(args.versions)
    print("version  central  clients: mean    p10    p50    p90  worst10  reports")
    for row in seen["rows"]:
        print(
            f"{row['version']:>7}  {row['central']:7.3f}  {row['mean']:13.3f} {row['p10']:6.3f} {row['p50']:6.3f} "
            f"{row['p90']:6.3f} {row['worst10']:8.3f} {row['reports']:8d}"
        )
    result = {
        "benchmark": "client_eval",
        "command": " ".join(["python", "benchmarks/client_eval.py", *sys.argv[1:]]),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "config": _BASE,
        "overhead": cost,
        "spread": seen,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
