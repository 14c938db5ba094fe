"""Hierarchical aggregation: flat FedBuff vs 10 edges vs 10x10 edges over 1000 clients, in the same run.

Every topology takes about 50 client updates per cloud version (flat: K = 50; 10 edges: K_e = 10 and the cloud
folds 5 partials; 10x10 edges: K_e = 5 at both tiers and the cloud folds 2 partials), with 100 clients in flight,
digits with Dirichlet(0.5) from ``examples/hierarchical.toml``. Each run stops at 0.90 test accuracy (evaluated
every version) or ``--versions``. Printed per topology, with ratios against flat:

* cloud ingress bytes per cloud version (what the server receives),
* cloud aggregation seconds per version (decoding and folding what arrives, plus the server step),
* simulated and wall seconds to 0.90 accuracy.

    python benchmarks/hierarchy.py [--seeds 0 1 2] [--versions 400]

The medians, their ratios and every run go to ``benchmarks/results/hierarchy.json`` (``--out``; see
``benchmarks/record.py``).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import flasync
from flasync.config import load_config

if __package__:  # imported as benchmarks.hierarchy
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hierarchical.toml"

TOPOLOGIES: dict[str, tuple[dict[str, Any], int]] = {
    "flat": ({"kind": "flat"}, 50),
    "10 edges": ({"kind": "tree", "fanout": [10], "buffer_size": 10, "max_wait_s": 5.0}, 5),
    "10x10 edges": ({"kind": "tree", "fanout": [10, 10], "buffer_size": 5, "max_wait_s": 5.0}, 2),
}


@dataclass(frozen=True, slots=True)
class Result:
    """What one run cost and reached."""

    versions: int
    accuracy: float
    reached: bool
    ingress_per_version: float
    aggregate_s_per_version: float
    simulated_s: float
    wall_s: float


def run_one(topology: dict[str, Any], cloud_k: int, *, seed: int, versions: int, target: float) -> Result:
    """Run one topology to the target accuracy (or the version limit)."""
    config = load_config(
        EXAMPLE,
        [
            f"seed={seed}",
            f"server.buffer_size={cloud_k}",
            f"stop.max_versions={versions}",
            f"stop.target_accuracy={target}",
            "eval.every_versions=1",
            "tracking.enabled=false",
            "tracking.log_level=warning",
        ],
    )
    config = config.model_validate({**config.model_dump(), "topology": topology})
    summary = flasync.run(config)
    v = max(summary.versions, 1)
    return Result(
        versions=summary.versions,
        accuracy=summary.accuracy,
        reached=summary.stop_reason == "target_accuracy",
        ingress_per_version=summary.cloud_ingress_bytes / v,
        aggregate_s_per_version=summary.cloud_aggregate_s / v,
        simulated_s=summary.simulated_s,
        wall_s=summary.wall_s,
    )


def main() -> None:
    """Run every topology for every seed (interleaved) and print medians and ratios against flat."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--versions", type=int, default=400)
    parser.add_argument("--target", type=float, default=0.90)
    parser.add_argument(
        "--out", type=Path, default=None, help="result file (default benchmarks/results/hierarchy.json)"
    )
    args = parser.parse_args()
    described = machine()
    results: dict[str, list[Result]] = {name: [] for name in TOPOLOGIES}
    for seed in args.seeds:
        for name, (topology, cloud_k) in TOPOLOGIES.items():
            result = run_one(topology, cloud_k, seed=seed, versions=args.versions, target=args.target)
            results[name].append(result)
            print(
                f"  seed {seed} {name:<12} versions {result.versions:4d}  acc {result.accuracy:.3f}"
                f"{'' if result.reached else ' (target not reached)'}  sim {result.simulated_s:6.1f} s"
                f"  wall {result.wall_s:5.1f} s",
                flush=True,
            )

    def med(name: str, field: str) -> float:
        return statistics.median(getattr(r, field) for r in results[name])

    print(f"\nmedians over seeds {args.seeds}; ratio = topology / flat")
    header = (
        f"{'topology':<12} {'ingress B/ver':>14} {'ratio':>6} {'agg ms/ver':>11} {'ratio':>6} "
        f"{'sim s to ' + str(args.target):>14} {'ratio':>6} {'wall s':>7} {'ratio':>6} {'reached':>8}"
    )
    print(header)
    print("-" * len(header))
    for name in TOPOLOGIES:
        reached = sum(r.reached for r in results[name])
        print(
            f"{name:<12} {med(name, 'ingress_per_version'):14.0f} "
            f"{med(name, 'ingress_per_version') / med('flat', 'ingress_per_version'):6.3f} "
            f"{1e3 * med(name, 'aggregate_s_per_version'):11.2f} "
            f"{med(name, 'aggregate_s_per_version') / med('flat', 'aggregate_s_per_version'):6.3f} "
            f"{med(name, 'simulated_s'):14.1f} {med(name, 'simulated_s') / med('flat', 'simulated_s'):6.2f} "
            f"{med(name, 'wall_s'):7.1f} {med(name, 'wall_s') / med('flat', 'wall_s'):6.2f} "
            f"{reached:>5}/{len(results[name])}"
        )
    medians = {
        name: {
            field: med(name, field)
            for field in ("ingress_per_version", "aggregate_s_per_version", "simulated_s", "wall_s")
        }
        for name in TOPOLOGIES
    }
    store(
        "hierarchy",
        described,
        settings={"seeds": args.seeds, "versions": args.versions, "target": args.target},
        headline=_headline(medians, args.target),
        figures={"medians": medians, "runs": {name: [asdict(r) for r in rs] for name, rs in results.items()}},
        out=args.out,
    )


def _headline(medians: dict[str, dict[str, float]], target: float) -> list[Figure]:
    """Return each tree's median cloud ingress per version and simulated seconds to the target, against flat's."""
    flat = medians["flat"]
    rows = []
    for name, figures in medians.items():
        if name == "flat":
            continue
        for field, what, unit in (
            ("ingress_per_version", "cloud ingress per version", "bytes"),
            ("simulated_s", f"simulated seconds to {target}", "s"),
        ):
            ratio = figures[field] / flat[field] if flat[field] else None
            rows.append(Figure(f"{name}: {what}", figures[field], unit, baseline="flat", ratio=ratio))
    return rows


if __name__ == "__main__":
    main()
