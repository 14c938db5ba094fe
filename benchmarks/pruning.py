"""Model pruning: accuracy, bytes on the wire and client training memory against the target density, on digits.

FedAvg on digits (Dirichlet 0.5, 100 clients, 10 a round) with an MLP 64 -> 256 -> 256 -> 10, pruned by magnitude
every ``--every`` versions in two steps down to each target density (``model.prune``), against the same run
unpruned (the baseline, density 1) with the same seed. Each run reports its final accuracy, the mean upload and
download bytes per client task over the whole run and over its last ``--every`` versions (after the last pruning),
and the clients' peak training memory (``client/peak_mem_bytes``). The figures, with a description of the machine,
go to ``benchmarks/results/pruning.json``.

    python benchmarks/pruning.py [--versions 80] [--every 20] [--densities 0.5 0.2 0.1 0.05]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import flasync
from flasync import tracking
from flasync.config import RunConfig, load_config
from flasync.core.events import ModelPublished, UpdateReceived
from flasync.testing import EventRecorder, MemoryTracker

if __package__:
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

_HERE = Path(__file__).resolve().parent
EXAMPLE = _HERE.parent / "examples" / "pruning.toml"
STEPS = 2


def config_of(density: float | None, *, versions: int, every: int, seed: int) -> RunConfig:
    """Return the example's config at ``density`` (None: no pruning)."""
    config = load_config(
        EXAMPLE,
        [
            f"seed={seed}",
            f"stop.max_versions={versions}",
            "tracking.enabled=false",
            "tracking.log_level=debug",
            "tracking.metrics=all",
        ],
    )
    data = config.model_dump()
    data["model"]["prune"] = (
        None if density is None else {"target_density": density, "every_versions": every, "steps": STEPS}
    )
    return RunConfig.model_validate(data)


def run(config: RunConfig, *, tail_from: int) -> dict[str, Any]:
    """Run one federation; return its accuracy, bytes (whole run and from version ``tail_from`` on) and memory."""
    tracker = MemoryTracker()
    federation = flasync.Federation(config, tracker=tracker)
    recorder = EventRecorder(federation.bus)
    start = time.perf_counter()
    summary = asyncio.run(federation.run())
    wall_s = time.perf_counter() - start
    late_up = [e.upload_bytes for e in recorder.of(UpdateReceived) if e.base_version >= tail_from]
    late_down = [e.download_bytes for e in recorder.of(ModelPublished) if e.version >= tail_from]
    memory = [v for _, v in tracker.history("client/peak_mem_bytes")]
    return {
        "accuracy": summary.accuracy,
        "upload_bytes_per_update": summary.upload_bytes / max(summary.updates_accepted, 1),
        "download_bytes_per_task": summary.download_bytes / max(summary.tasks_dispatched, 1),
        "upload_bytes_per_update_pruned": statistics.mean(late_up) if late_up else float("nan"),
        "download_bytes_per_model_pruned": statistics.mean(late_down) if late_down else float("nan"),
        "client_peak_mem_bytes": max(memory) if memory else 0,
        "weights_sha256": summary.weights_sha256,
        "wall_s": round(wall_s, 2),
    }


def main() -> None:
    """Run the baseline and each density; print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=80)
    parser.add_argument("--every", type=int, default=20, help="versions between two pruning events")
    parser.add_argument("--densities", type=float, nargs="+", default=[0.5, 0.2, 0.1, 0.05])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=_HERE / "results" / "pruning.json")
    args = parser.parse_args()
    tracking.configure_logging(level="warning")
    tail_from = STEPS * args.every  # the last step reaches the target
    described = machine()
    results: dict[str, dict[str, Any]] = {}
    for density in [None, *args.densities]:
        config = config_of(density, versions=args.versions, every=args.every, seed=args.seed)
        results["1.0" if density is None else f"{density:g}"] = run(config, tail_from=tail_from)
    base = results["1.0"]
    print(
        f"FedAvg on digits, Dirichlet(0.5), 100 clients, 10 a round, {args.versions} rounds, MLP 64-256-256-10; "
        f"pruned every {args.every} versions in {STEPS} steps to the density (bytes after version {tail_from})"
    )
    print(
        f"{'density':>8} {'accuracy':>9} {'vs dense':>9} {'up B/update':>12} {'down B/model':>13} "
        f"{'fewer up':>9} {'fewer down':>11} {'client peak MB':>15}"
    )
    for name, figures in results.items():
        figures["accuracy_minus_dense"] = figures["accuracy"] - base["accuracy"]
        figures["fewer_upload_bytes"] = (
            base["upload_bytes_per_update_pruned"] / figures["upload_bytes_per_update_pruned"]
        )
        figures["fewer_download_bytes"] = (
            base["download_bytes_per_model_pruned"] / figures["download_bytes_per_model_pruned"]
        )
        print(
            f"{name:>8} {figures['accuracy']:>9.4f} {100 * figures['accuracy_minus_dense']:>+7.2f}pt "
            f"{figures['upload_bytes_per_update_pruned']:>12.0f} {figures['download_bytes_per_model_pruned']:>13.0f} "
            f"{figures['fewer_upload_bytes']:>8.2f}x {figures['fewer_download_bytes']:>10.2f}x "
            f"{figures['client_peak_mem_bytes'] / 1e6:>15.3f}"
        )
    settings = {
        "versions": args.versions,
        "every_versions": args.every,
        "steps": STEPS,
        "densities": args.densities,
        "seed": args.seed,
        "bytes_from_version": tail_from,
    }
    store("pruning", described, settings=settings, headline=_headline(results), figures={"runs": results}, out=args.out)


def _headline(results: dict[str, dict[str, Any]]) -> list[Figure]:
    """Per target density: upload bytes per update after the last pruning step and final accuracy, against dense."""
    base = results["1.0"]
    figures = []
    for name, run in results.items():
        if name == "1.0":
            continue
        figures.append(
            Figure(
                f"upload bytes per update, density {name}",
                run["upload_bytes_per_update_pruned"],
                "bytes",
                "unpruned",
                run["upload_bytes_per_update_pruned"] / base["upload_bytes_per_update_pruned"],
            )
        )
        figures.append(
            Figure(
                f"accuracy, density {name}",
                run["accuracy"],
                "accuracy",
                "unpruned",
                run["accuracy"] / base["accuracy"],
            )
        )
    return figures


if __name__ == "__main__":
    main()
