"""Record, or compare against, the final weights and counters of a matrix of configurations.

A refactoring that must not change results (the server split did not) runs this before and after::

    python benchmarks/golden.py record golden.json     # on the old code
    python benchmarks/golden.py compare golden.json    # on the new code: prints ALL SAME or each difference

Each case is a small run (40 clients, 12 versions, no tracking) of one feature: every aggregator, faults and
resilience, availability windows, samplers, codecs, vectorized cohorts, trees (async, raw relays, deadlines, HierFAVG)
and lazy clients, plus the default run. A case records ``weights_sha256`` and the run's counters. Results depend on
the torch build and the CPU's kernels (see the README's *Virtual time and determinism*): compare on one machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import flasync


def _case(**sections: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "population": {"num_clients": 40},
        "stop": {"max_versions": 12},
        "eval": {"every_versions": 4},
        "tracking": {"enabled": False},
        "diagnostics": {"profile": False},
    }
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    return config


FEDAVG = {"kind": "fedavg", "clients_per_round": 8}
FAULTS = {"crash": 0.2, "hang": 0.1, "dropout": 0.1}
CONSTANT = {"num_clients": 40, "speed": {"kind": "constant"}}
BUFFERED = {"kind": "fedbuff", "buffer_size": 4, "concurrency": 10}
CASES: dict[str, dict[str, Any]] = {
    "fedbuff": _case(),
    "fedbuff_samples_hinge": _case(
        server={
            "kind": "fedbuff",
            "example_weight": "samples",
            "staleness": {"kind": "hinge", "a": 2, "b": 3},
            "max_staleness": 6,
        }
    ),
    "fedasync": _case(server={"kind": "fedasync", "concurrency": 6}),
    "fedavg": _case(server=FEDAVG),
    "fedavg_adam": _case(server={**FEDAVG, "optimizer": {"kind": "adam", "lr": 0.01}}),
    "fedavg_resilience": _case(
        server=FEDAVG,
        faults=FAULTS,
        resilience={
            "task_timeout_s": 30.0,
            "round_quorum": 0.7,
            "round_deadline_s": 40.0,
            "over_selection": 0.3,
            "clip_update_norm": 1.0,
            "max_update_norm": 50.0,
        },
    ),
    # `resilience.aggregation` is read as `server.aggregation`: the old spelling runs on old and new code alike.
    "fedavg_median": _case(server=FEDAVG, resilience={"aggregation": "median"}),
    "fedavg_trimmed": _case(server=FEDAVG, resilience={"aggregation": "trimmed_mean", "trim_fraction": 0.2}),
    "fedbuff_faults": _case(
        faults=FAULTS, resilience={"task_timeout_s": 30.0, "zscore_threshold": 3.0, "zscore_min_history": 5}
    ),
    "fedbuff_availability": _case(faults={"availability": {"period_s": 100.0, "online_fraction": 0.5}}),
    "fedavg_availability": _case(server=FEDAVG, faults={"availability": {"period_s": 100.0, "online_fraction": 0.5}}),
    "fedbuff_lru": _case(population={"num_clients": 40, "sampling": "lru"}),
    "fedbuff_weighted": _case(population={"num_clients": 40, "sampling": "weighted"}),
    "fedbuff_topk": _case(
        codec={"upload": [{"kind": "topk", "ratio": 0.1, "error_feedback": True}], "download": [{"kind": "fp16"}]}
    ),
    "fedbuff_int8": _case(codec={"upload": [{"kind": "int8"}]}),
    "fedbuff_vectorized": _case(executor={"kind": "vectorized"}),
    "fedavg_vectorized": _case(server=FEDAVG, executor={"kind": "vectorized"}),
    "tree_fedbuff": _case(topology={"kind": "tree", "fanout": [4], "buffer_size": 3}),
    "tree_fedbuff_relays": _case(topology={"kind": "tree", "fanout": [4], "buffer_size": 1}),
    "tree_fedbuff_depth2_deadlines": _case(
        topology={"kind": "tree", "fanout": [2, 2], "buffer_size": 3, "max_wait_s": 5.0, "codec": [{"kind": "fp16"}]}
    ),
    "tree_fedasync": _case(
        server={"kind": "fedasync", "concurrency": 6}, topology={"kind": "tree", "fanout": [4], "buffer_size": 2}
    ),
    "tree_hierfavg": _case(server=FEDAVG, topology={"kind": "tree", "fanout": [4], "kappa2": 2}),
    "tree_hierfavg_depth2": _case(server=FEDAVG, topology={"kind": "tree", "fanout": [2, 2], "kappa2": 1}),
    "lazy": _case(data={"kind": "synthetic", "lazy": True, "samples_per_client": 30}, population={"num_clients": 1000}),
    "scaffold": _case(server=FEDAVG, scaffold={"enabled": True, "max_in_memory": 8}),
    "scaffold_vectorized": _case(server=FEDAVG, scaffold={"enabled": True}, executor={"kind": "vectorized"}),
    "fedprox": _case(server=FEDAVG, client={"proximal_mu": 0.1}),
    "dp_fedavg": _case(server=FEDAVG, privacy={"enabled": True, "clip_norm": 1.0, "noise_multiplier": 1.0}),
    "fedbuff_topk_spill": _case(
        codec={"upload": [{"kind": "topk", "ratio": 0.1, "error_feedback": True}], "max_residuals_in_memory": 4}
    ),
    # Every client trains and uploads in the same simulated time: uploads arrive together, slots refill between them.
    "fedbuff_constant": _case(population=CONSTANT, server=BUFFERED),
    "fedbuff_constant_lru": _case(population={**CONSTANT, "sampling": "lru"}, server=BUFFERED),
    "fedbuff_constant_weighted": _case(population={**CONSTANT, "sampling": "weighted"}, server=BUFFERED),
    "fedbuff_constant_refusals": _case(
        population=CONSTANT,
        server={**BUFFERED, "max_staleness": 1},
        resilience={"zscore_threshold": 1.0, "zscore_min_history": 3, "clip_update_norm": 1.0},
    ),
    "fedbuff_constant_faults": _case(
        population={**CONSTANT, "sampling": "lru"}, server=BUFFERED, faults=FAULTS, resilience={"task_timeout_s": 30.0}
    ),
    "fedbuff_constant_vectorized": _case(
        population={**CONSTANT, "sampling": "lru"}, server=BUFFERED, executor={"kind": "vectorized"}
    ),
    "default": {"tracking": {"enabled": False}},
}


def _outcome(config: dict[str, Any]) -> list[Any]:
    s = flasync.run(config)
    counters = [s.updates_accepted, s.updates_dropped, s.updates_failed, s.tasks_timed_out, s.tasks_abandoned]
    counters += [s.versions, round(s.simulated_s, 6), s.upload_bytes, s.download_bytes]
    return [s.weights_sha256, *counters, s.cloud_ingress_bytes, s.cloud_egress_bytes]


def main() -> int:
    """Record or compare; exit 1 when a comparison finds a difference."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["record", "compare"])
    parser.add_argument("path", type=Path, help="the JSON file of recorded outcomes")
    parser.add_argument("cases", nargs="*", help=f"cases to run (default: all {len(CASES)})")
    args = parser.parse_args()
    names = args.cases or list(CASES)
    outcomes: dict[str, list[Any]] = {}
    for name in names:
        started = time.perf_counter()
        outcomes[name] = _outcome(CASES[name])
        print(f"{name:32s} {outcomes[name][0][:12]}  {time.perf_counter() - started:5.1f} s", flush=True)
    if args.mode == "record":
        args.path.write_text(json.dumps(outcomes, indent=1))
        return 0
    recorded = json.loads(args.path.read_text())
    differ = [name for name in outcomes if recorded.get(name) != outcomes[name]]
    for name in differ:
        print(f"DIFFERS {name}: recorded {recorded.get(name)}, now {outcomes[name]}")
    print("ALL SAME" if not differ else f"{len(differ)} of {len(outcomes)} DIFFER")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
