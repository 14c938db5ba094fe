"""Accuracy under attack: no defence against each defence, at 0, 10 and 30% Byzantine clients, FedAvg and FedBuff.

Attackers are a fixed share of the population (``faults.byzantine``) that send ``-20x`` their update (sign flip) or
``+20x`` (scaling) with every task. Defences:

* ``median`` / ``trimmed_mean`` - coordinate-wise rules of a FedAvg round (Yin et al., ICML 2018);
* ``norm_cap`` - refuse updates over a fixed norm (``resilience.max_update_norm = 6``; clean updates here are ~0.5);
* ``norm_bound`` - refuse updates over 3x the median of recently accepted norms (``resilience.norm_bound_factor``):
  a bound on a reference the refused updates cannot move, which follows the run without a hand-set constant.

    python benchmarks/robustness.py                 # digits, 100 clients, 60 versions: about 3 minutes on 2 cores
    python benchmarks/robustness.py --versions 30   # quicker

Prints one table per attack: final test accuracy of every (server, defence) at each attacker share.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import flasync

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


def main() -> None:
    """Run every combination once and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.1, 0.3])
    parser.add_argument("--attacks", nargs="+", default=["sign_flip", "scale"])
    args = parser.parse_args()
    started = time.perf_counter()
    for attack in args.attacks:
        print(f"\n{attack} (x20), accuracy after {args.versions} versions, seed {args.seed}")
        print("| server | defence | " + " | ".join(f"{share:.0%} attackers" for share in args.shares) + " |")
        print("|---|---|" + "---|" * len(args.shares))
        for server in SERVERS:
            for defence in DEFENCES:
                if server == "fedbuff" and defence in ("median", "trimmed_mean"):
                    continue  # coordinate-wise rules need a round's updates together
                cells = []
                for share in args.shares:
                    summary = flasync.run(_config(server, defence, share, attack, args.versions, args.seed))
                    cells.append(f"{summary.accuracy:.3f}")
                print(f"| {server} | {defence} | " + " | ".join(cells) + " |", flush=True)
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
