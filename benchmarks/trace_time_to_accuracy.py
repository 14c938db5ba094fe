"""Time to accuracy of FedBuff against FedAvg when a device trace decides who is online and how fast each client is.

Both servers train the same population (digits, 100 clients, Dirichlet(0.5)) on the virtual clock until the held-out
accuracy reaches the target. Two worlds, measured in the same run:

* ``always-on`` (the baseline): every client online, speeds from the lognormal model (sigma 1);
* ``trace``: a synthetic device trace (``flasync data trace``'s generator: lognormal speeds of spread 1, each client
  online about 30% of a ten-minute cycle in a few sessions) - clients are sampled only while online, and a task whose
  client goes offline before its upload fails.

    python benchmarks/trace_time_to_accuracy.py              # 5 seeds: about 30 s on 2 cores
    python benchmarks/trace_time_to_accuracy.py --seeds 0 1  # quicker

Prints the simulated seconds to the target (median over seeds) of each server in each world, FedBuff's speed-up over
FedAvg in each world, and how much the trace slows each server against its always-on baseline; writes them with the
machine's description to ``benchmarks/results/trace_time_to_accuracy.json``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import flasync
from flasync.clients.simulated.trace import synthetic_trace, write_trace

if __package__:
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

_HERE = Path(__file__).resolve().parent
RESULT = _HERE / "results" / "trace_time_to_accuracy.json"

SERVERS: dict[str, dict[str, Any]] = {
    "fedavg": {"kind": "fedavg", "clients_per_round": 10},
    "fedbuff": {"kind": "fedbuff", "buffer_size": 10, "concurrency": 20},
}


def _config(server: str, trace: Path, seed: int, target: float, limit_s: float) -> dict[str, Any]:
    population: dict[str, Any] = {
        "num_clients": 100,
        "speed": {"kind": "lognormal", "seconds_per_step": 1.0, "jitter": 0.1},  # the trace gives each client's factor
        "trace": str(trace),
    }
    return {
        "seed": seed,
        "partition": {"kind": "dirichlet", "alpha": 0.5},
        "population": population,
        "server": SERVERS[server],
        "eval": {"every_versions": 1},
        "stop": {"max_versions": 2000, "target_accuracy": target, "max_simulated_s": limit_s},
        "tracking": {"enabled": False, "log_level": "error"},
        "diagnostics": {"profile": False, "level": "off"},
    }


def main() -> None:
    """Run both servers in both worlds for every seed; print and store the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--limit-s", type=float, default=20_000.0, help="simulated seconds before giving up")
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    described = machine()
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        trace, always = Path(folder, "devices.csv"), Path(folder, "always-on.csv")
        devices = synthetic_trace(100, horizon_s=600.0, online_fraction=0.3, sigma=1.0, seed=7)
        write_trace(devices, trace)
        # The same devices' speeds, every one always online (an empty online column).
        always.write_text(
            "client,speed,online\n" + "".join(f"{k},{v!r},\n" for k, v in enumerate(devices.speed.tolist()))
        )
        for world, path in (("always-on", always), ("trace", trace)):
            for server in SERVERS:
                for seed in args.seeds:
                    summary = flasync.run(_config(server, path, seed, args.target, args.limit_s))
                    reached = summary.stop_reason == "target_accuracy"
                    runs.append(
                        {
                            "world": world,
                            "server": server,
                            "seed": seed,
                            "reached": reached,
                            "simulated_s": summary.simulated_s,
                            "versions": summary.versions,
                            "updates_accepted": summary.updates_accepted,
                            "updates_failed": summary.updates_failed,
                            "accuracy": summary.accuracy,
                        }
                    )
                    print(
                        f"{world:>9} {server:>7} seed {seed}: {'reached' if reached else 'missed'} "
                        f"{args.target:.2f} at {summary.simulated_s:8.0f} s simulated, {summary.versions} versions, "
                        f"{summary.updates_failed} failed",
                        flush=True,
                    )
    median = {
        (world, server): statistics.median(
            r["simulated_s"] for r in runs if r["world"] == world and r["server"] == server
        )
        for world in ("always-on", "trace")
        for server in SERVERS
    }
    print(f"\nsimulated seconds to accuracy {args.target:.2f} (median of {len(args.seeds)} seeds)")
    print("| world | FedAvg | FedBuff | FedAvg / FedBuff |")
    print("|---|---|---|---|")
    for world in ("always-on", "trace"):
        avg, buff = median[(world, "fedavg")], median[(world, "fedbuff")]
        print(f"| {world} | {avg:.0f} s | {buff:.0f} s | {avg / buff:.2f}x |")
    slowdown = {server: median[("trace", server)] / median[("always-on", server)] for server in SERVERS}
    print("trace / always-on: " + ", ".join(f"{server} {ratio:.2f}x" for server, ratio in slowdown.items()))
    store(
        "trace_time_to_accuracy",
        described,
        settings={"target_accuracy": args.target, "seeds": args.seeds, "limit_s": args.limit_s, "clients": 100},
        headline=_headline(median, args.target),
        figures={
            "median_simulated_s": {
                world.replace("-", "_"): {server: median[(world, server)] for server in SERVERS}
                for world in ("always-on", "trace")
            },
            "fedavg_over_fedbuff": {
                world.replace("-", "_"): median[(world, "fedavg")] / median[(world, "fedbuff")]
                for world in ("always-on", "trace")
            },
            "trace_over_always_on": slowdown,
            "runs": runs,
            "wall_s": round(time.perf_counter() - started, 1),
        },
        out=args.out,
    )


def _headline(median: dict[tuple[str, str], float], target: float) -> list[Figure]:
    """FedBuff against FedAvg in each world, and what the trace costs each server against always-on."""
    figures = [
        Figure(
            f"FedBuff, simulated s to {target:.2f}, {world}",
            median[(world, "fedbuff")],
            "s",
            f"FedAvg, {world}",
            median[(world, "fedbuff")] / median[(world, "fedavg")],
        )
        for world in ("always-on", "trace")
    ]
    figures += [
        Figure(
            f"{label}, simulated s to {target:.2f} under the trace",
            median[("trace", server)],
            "s",
            f"{label}, always-on",
            median[("trace", server)] / median[("always-on", server)],
        )
        for server, label in (("fedavg", "FedAvg"), ("fedbuff", "FedBuff"))
    ]
    return figures


if __name__ == "__main__":
    main()
