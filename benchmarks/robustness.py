"""Accuracy under attack: no defence against each defence, at 0, 10 and 30% Byzantine clients, FedAvg and FedBuff.

Attackers are a fixed share of the population (``faults.byzantine``) that send ``-20x`` their update (sign flip) or
``+20x`` (scaling) with every task. Defences:

* ``median`` / ``trimmed_mean`` - coordinate-wise rules of a FedAvg round (Yin et al., ICML 2018);
* ``norm_cap`` - refuse updates over a fixed norm (``resilience.max_update_norm = 6``; clean updates here are ~0.5);
* ``norm_bound`` - refuse updates over 3x the median of recently accepted norms (``resilience.norm_bound_factor``):
  a bound on a reference the refused updates cannot move, which follows the run without a hand-set constant.

    python benchmarks/robustness.py                 # digits, 100 clients, 60 versions: about 3 minutes on 2 cores
    python benchmarks/robustness.py --versions 30   # quicker

Prints one table per attack: final test accuracy of every (server, defence) at each attacker share. The accuracies
go to ``benchmarks/results/robustness.json`` (``--out``; see ``benchmarks/record.py``), headed by each defence's
accuracy at the largest attacker share against no defence at that share, in the same run.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import flasync

if __package__:  # imported as benchmarks.robustness
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

DEFENCES: dict[str, dict[str, Any]] = {
    "none": {},
    "median": {"server": {"aggregation": "median"}},
    "trimmed_mean": {"server": {"aggregation": "trimmed_mean", "trim_fraction": 0.3}},
    "norm_cap": {"resilience": {"max_update_norm": 6.0}},
    "norm_bound": {"resilience": {"norm_bound_factor": 3.0}},
}
SERVERS: dict[str, dict[str, Any]] = {
    "fedavg": {"kind": "fedavg", "clients_per_round": 20},
    "fedbuff": {"kind": "fedbuff", "buffer_size": 10, "concurrency": 20},
}


def _config(server: str, defence: str, share: float, attack: str, versions: int, seed: int) -> dict[str, Any]:
    extra = DEFENCES[defence]
    return {
        "seed": seed,
        "server": {**SERVERS[server], **extra.get("server", {})},
        "resilience": extra.get("resilience", {}),
        "faults": {"byzantine": share, "attack": attack, "attack_factor": 20.0},
        "stop": {"max_versions": versions},
        "eval": {"every_versions": versions},
        "tracking": {"enabled": False, "log_level": "error"},
        "diagnostics": {"profile": False, "level": "off"},
    }


def headline(accuracy: dict[str, dict[str, dict[str, float]]], share: str) -> list[Figure]:
    """Return each defence's accuracy at attacker share ``share`` against no defence's there (same attack, server)."""
    rows = []
    for attack, servers in accuracy.items():
        for server, defences in servers.items():
            plain = defences["none"][share]
            for defence, by_share in defences.items():
                if defence != "none":
                    value = by_share[share]
                    rows.append(
                        Figure(
                            f"{attack}, {server}, {defence}, {float(share):.0%} attackers: accuracy",
                            value,
                            "accuracy",
                            baseline="no defence",
                            ratio=value / plain if plain else None,
                        )
                    )
    return rows


def main() -> None:
    """Run every combination once, print the tables and store the result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.1, 0.3])
    parser.add_argument("--attacks", nargs="+", default=["sign_flip", "scale"])
    parser.add_argument(
        "--out", type=Path, default=None, help="result file (default benchmarks/results/robustness.json)"
    )
    args = parser.parse_args()
    described = machine()
    started = time.perf_counter()
    accuracy: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for attack in args.attacks:
        print(f"\n{attack} (x20), accuracy after {args.versions} versions, seed {args.seed}")
        print("| server | defence | " + " | ".join(f"{share:.0%} attackers" for share in args.shares) + " |")
        print("|---|---|" + "---|" * len(args.shares))
        for server in SERVERS:
            for defence in DEFENCES:
                if server == "fedbuff" and defence in ("median", "trimmed_mean"):
                    continue  # coordinate-wise rules need a round's updates together
                cells = accuracy.setdefault(attack, {}).setdefault(server, {}).setdefault(defence, {})
                for share in args.shares:
                    summary = flasync.run(_config(server, defence, share, attack, args.versions, args.seed))
                    cells[str(share)] = summary.accuracy
                row = " | ".join(f"{value:.3f}" for value in cells.values())
                print(f"| {server} | {defence} | {row} |", flush=True)
    seconds = time.perf_counter() - started
    print(f"\n({seconds:.0f} s)")
    store(
        "robustness",
        described,
        settings={"versions": args.versions, "seed": args.seed, "shares": args.shares, "attacks": args.attacks},
        headline=headline(accuracy, str(max(args.shares))),
        figures={"accuracy": accuracy, "seconds": seconds},
        out=args.out,
    )


if __name__ == "__main__":
    main()
