"""Threads against Ray actors: updates per second and peak memory, on a light and a heavier workload.

Workloads (FedAvg, virtual clock, no tracking):

* ``mlp`` - the tutorial workload: synthetic data, MLP 32-64-10, 200 samples per client, batch 32, 1 local epoch,
  100 clients, 10 per round;
* ``cnn`` - the small CNN on digits, 10 clients of about 144 samples, all 10 in each round, 5 local epochs of batch
  16 (45 steps a task): each call trains for long enough to amortise Ray's per-call cost.

Executors: the threads executor (1 worker, the default, and 2), and Ray with 1 and 2 actors (1 CPU and 1 torch thread
each). Ray is started once by the script (``ray.init``), so the figures are of training; its start-up is printed
apart, and so is how long a run's executor takes to start its actors (``--start-actors``, 2 by default): side by
side, as flasync starts them, against one after another (each waited for before the next is asked for), in the same
run, interleaved, ``--start-repeats`` times each. Peak memory: the driver's peak RSS (of the process so far), and
the summed RSS of every Ray process (GCS, raylet, workers, actors) sampled every 0.2 s during the run.

    python benchmarks/ray_scaling.py                  # about 2 minutes on 2 cores
    python benchmarks/ray_scaling.py --rounds 5 --workloads mlp
    python benchmarks/ray_scaling.py --workloads --start-repeats 3   # only the actors' start

Two nodes on one machine (what a cluster needs; Ray 2.59+ wants the same token on every node)::

    export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$(python -c "import secrets; print(secrets.token_hex(16))")
    ray start --head --node-ip-address=127.0.0.1 --port=6391 --num-cpus=1 --include-dashboard=false
    ray start --address=127.0.0.1:6391 --node-ip-address=127.0.0.1 --num-cpus=1
    python benchmarks/ray_scaling.py --address 127.0.0.1:6391 --workloads cnn --rounds 5
    ray stop

With ``--address`` the script joins that cluster instead of starting Ray, and prints on which nodes the tasks ran.

The figures go to ``benchmarks/results/ray_scaling.json`` (``--out``; see ``benchmarks/record.py``), headed by each
executor's rate against one thread worker's on the same workload.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import psutil

import flasync

if __package__:  # imported as benchmarks.ray_scaling
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

WORKLOADS: dict[str, dict[str, Any]] = {
    "mlp": {
        "data": {"kind": "synthetic", "samples_per_client": 200, "num_features": 32, "num_classes": 10},
        "partition": {"kind": "iid"},
        "model": {"kind": "mlp", "hidden": [64]},
        "client": {"epochs": 1, "batch_size": 32, "lr": 0.01},
    },
    "cnn": {
        "data": {"kind": "digits"},
        "partition": {"kind": "iid"},
        "population": {"num_clients": 10},
        "model": {"kind": "cnn"},
        "client": {"epochs": 5, "batch_size": 16, "lr": 0.05},
    },
}


def _config(workload: str, executor: dict[str, Any], rounds: int, log_level: str) -> dict[str, Any]:
    return {
        **WORKLOADS[workload],
        "server": {"kind": "fedavg", "clients_per_round": 10},
        "executor": executor,
        "stop": {"max_versions": rounds},
        "eval": {"every_versions": rounds},
        "tracking": {"enabled": False, "log_level": log_level},
        "diagnostics": {"profile": False, "level": "off"},
    }


class _RayMemory:
    """Peak of the summed RSS of the machine's Ray processes, sampled in a thread."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            total = 0
            for proc in psutil.process_iter(["name", "cmdline", "memory_info"]):
                text = " ".join([proc.info["name"] or "", *(proc.info["cmdline"] or [])])
                if ("ray::" in text or "raylet" in text or "gcs_server" in text) and proc.info["memory_info"]:
                    total += proc.info["memory_info"].rss
            self.peak = max(self.peak, total)

    def __enter__(self) -> _RayMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _actor_start(actors: int, repeats: int, headline: list[Figure]) -> dict[str, Any]:
    """Time the start of an executor of ``actors`` Ray actors (made, each answering, then shut down), as flasync
    starts them (side by side) and one after another, ``repeats`` times each, interleaved; print and return the
    medians."""
    from flasync.config import RayConfig
    from flasync.training.executors.ray import RayTrainingExecutor
    from flasync.training.models import MLP

    def one_after_another(executor: RayTrainingExecutor, count: int) -> list[Any]:
        return [side_by_side(executor, 1)[0] for _ in range(count)]

    side_by_side = RayTrainingExecutor._start_slots
    settings = RayConfig(actors=actors)
    times: dict[str, list[float]] = {"side by side": [], "one after another": []}
    for _ in range(repeats):
        for way, start in (("one after another", one_after_another), ("side by side", side_by_side)):
            RayTrainingExecutor._start_slots = start  # type: ignore[method-assign]
            try:
                began = time.perf_counter()
                executor = RayTrainingExecutor(lambda: MLP(32, (64,), 10), settings)
                times[way].append(time.perf_counter() - began)
                executor.shutdown()
            finally:
                RayTrainingExecutor._start_slots = side_by_side  # type: ignore[method-assign]
    medians = {way: statistics.median(seconds) for way, seconds in times.items()}
    ratio = medians["side by side"] / medians["one after another"]
    print(f"\nAn executor of {actors} actors started in (median of {repeats}; each: made, answering):")
    for way, seconds in times.items():
        print(f"  {way:<18} {medians[way]:.2f} s   ({', '.join(f'{t:.2f}' for t in seconds)})")
    print(f"  side by side / one after another: {ratio:.2f}x")
    headline.append(Figure(f"start of {actors} actors", medians["side by side"], "s", "one after another", ratio))
    keys = {way: way.replace(" ", "_") for way in times}
    return {
        "actors": actors,
        "seconds": {keys[way]: seconds for way, seconds in times.items()},
        "median_s": {keys[way]: seconds for way, seconds in medians.items()},
        "ratio": ratio,
    }


def main() -> None:
    """Run every (workload, executor) once and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="FedAvg rounds of 10 clients per run")
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--start-actors", type=int, default=2, help="actors of the executor whose start is timed")
    parser.add_argument("--start-repeats", type=int, default=2, help="timed starts of each way (0: none)")
    parser.add_argument("--address", help="join this Ray cluster (default: start a local Ray with 2 CPUs)")
    parser.add_argument("--out", type=Path, default=None, help="result file (default: benchmarks/results/)")
    args = parser.parse_args()
    described = machine()
    headline: list[Figure] = []
    figures: dict[str, Any] = {}

    import ray

    started = time.perf_counter()
    if args.address is None:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    else:
        ray.init(address=args.address, log_to_driver=False, configure_logging=False)
    ray_start_s = time.perf_counter() - started
    print(f"\nRay {'started' if args.address is None else 'joined'} in {ray_start_s:.1f} s")
    nodes = [n for n in ray.nodes() if n["Alive"]]
    print(f"nodes: {len(nodes)} ({', '.join(n['NodeID'][:12] for n in nodes)})")

    if args.start_repeats:
        figures["actor_start"] = _actor_start(args.start_actors, args.start_repeats, headline)

    executors: dict[str, dict[str, Any]] = {
        "threads, 1 worker": {"kind": "thread"},
        "threads, 2 workers": {"kind": "thread", "workers": 2},
    }
    for actors in (1, 2):
        executors[f"ray, {actors} actor{'s' * (actors > 1)}"] = {"kind": "ray", "ray": {"actors": actors}}
    print(f"\nFedAvg, 10 clients per round, {args.rounds} rounds, virtual clock, no tracking")
    print("| workload | executor | updates/s | vs threads | driver peak RSS | Ray processes' peak RSS | sha256 |")
    print("|---|---|---|---|---|---|---|")
    for workload in args.workloads:
        baseline = 0.0
        for name, executor in executors.items():
            with _RayMemory() as memory:
                # On a cluster the executor's closing line (info) says on which nodes the tasks ran.
                level = "info" if args.address and executor["kind"] == "ray" else "warning"
                summary = flasync.run(_config(workload, executor, args.rounds, level))
            rate = summary.updates_per_s
            baseline = baseline or rate
            print(
                f"| {workload} | {name} | {rate:.0f} | {rate / baseline:.2f}x | "
                f"{summary.peak_rss_bytes / 2**20:.0f} MiB | {memory.peak / 2**20:.0f} MiB | "
                f"{summary.weights_sha256[:12]} |",
                flush=True,
            )
            figures.setdefault(workload, {})[name] = {
                "updates_per_s": rate,
                "driver_peak_rss_bytes": summary.peak_rss_bytes,
                "ray_peak_rss_bytes": memory.peak,
                "weights_sha256": summary.weights_sha256,
            }
            if name != "threads, 1 worker":
                headline.append(Figure(f"{workload}, {name}", rate, "updates/s", "threads, 1 worker", rate / baseline))
    ray.shutdown()
    figures["ray_start_s"] = ray_start_s
    figures["nodes"] = len(nodes)
    settings = {"rounds": args.rounds, "workloads": args.workloads, "address": args.address}
    store("ray_scaling", described, settings=settings, headline=headline, figures=figures, out=args.out)


if __name__ == "__main__":
    main()
