"""Update compression: accuracy, bytes and time-to-accuracy of each codec against dense updates, in the same run.

FedBuff on digits (Dirichlet 0.5, 100 clients) from ``examples/compression_dense.toml``: dense float32 uploads,
top-k 1% with error feedback, top-k 1% without it (for contrast), and int8 with stochastic rounding. Also the
encode + decode throughput of each codec on a 1M-element vector next to a plain memory copy of the same size.

    python benchmarks/compression.py [--versions 300] [--extra 3] [--seeds 0 1 2]

The tables go to ``benchmarks/results/compression.json`` (``--out``; see ``benchmarks/record.py``), headed by each
codec's accuracy and upload bytes after the dense run's versions against dense's, and its throughput against a copy.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import flasync
from flasync import tracking
from flasync.codecs import Float16, Int8, Pipeline, Stage, TopK
from flasync.config import load_config
from flasync.core.events import Evaluated, UpdateReceived
from flasync.testing import EventRecorder

if __package__:  # imported as benchmarks.compression
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CODECS: dict[str, list[dict[str, Any]]] = {
    "dense": [],
    "top-k 1% + EF": [{"kind": "topk", "ratio": 0.01, "error_feedback": True}],
    "top-k 1%, no EF": [{"kind": "topk", "ratio": 0.01, "error_feedback": False}],
    "int8": [{"kind": "int8", "chunk": 256, "stochastic": True}],
}


@dataclass(frozen=True, slots=True)
class Point:
    """One evaluation of a run: version, accuracy, upload bytes sent so far, simulated seconds."""

    version: int
    accuracy: float
    upload_bytes: int
    simulated_s: float


def run_codec(stages: list[dict[str, Any]], *, seed: int, versions: int) -> list[Point]:
    """Run one federation; return its evaluations with the upload bytes spent up to each."""
    config = load_config(
        EXAMPLES / "compression_dense.toml",
        [f"seed={seed}", f"stop.max_versions={versions}", "tracking.enabled=false", "tracking.log_level=warning"],
    )
    config = config.model_validate({**config.model_dump(), "codec": {**config.codec.model_dump(), "upload": stages}})
    federation = flasync.Federation(config)
    recorder = EventRecorder(federation.bus)
    asyncio.run(federation.run())
    points, sent = [], 0
    for event in recorder.events:
        if isinstance(event, UpdateReceived):
            sent += event.upload_bytes
        elif isinstance(event, Evaluated):
            points.append(Point(int(event.version), event.accuracy, sent, event.simulated_s))
    return points


def at_version(points: list[Point], version: int) -> Point:
    """Return the evaluation of ``version``."""
    return next(p for p in points if p.version == version)


def first_reaching(points: list[Point], accuracy: float) -> Point | None:
    """Return the first evaluation at or above ``accuracy``."""
    return next((p for p in points if p.accuracy >= accuracy), None)


def throughput(stages: list[Stage], n: int = 1_000_000, repeats: int = 5) -> float:
    """Return encode+decode MB/s (of float32 input) of a pipeline, best of ``repeats``."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    pipeline = Pipeline(stages)
    generator = torch.Generator().manual_seed(1)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        encoded = pipeline.encode(x, generator=generator)
        pipeline.decode(encoded.payload, expected_elements=n)
        best = min(best, time.perf_counter() - start)
    return 4 * n / best / 1e6


def copy_throughput(n: int = 1_000_000, repeats: int = 5) -> float:
    """Return MB/s of ``clone()`` of a 1M-element float32 vector, best of ``repeats``."""
    x = torch.randn(n)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.clone()
        best = min(best, time.perf_counter() - start)
    return 4 * n / best / 1e6


def main() -> None:
    """Print accuracy and bytes at equal versions, bytes and time to a common target, and codec throughput."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=300, help="versions of the dense run (and of table 1)")
    parser.add_argument("--extra", type=float, default=3.0, help="compressed runs may go this many times longer")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=None, help="result file (default: benchmarks/results/)")
    args = parser.parse_args()
    tracking.configure_logging(level="warning")
    described = machine()
    headline: list[Figure] = []
    figures: dict[str, Any] = {"equal_versions": {}, "to_target": {}, "throughput_mb_s": {}}
    runs: dict[str, list[list[Point]]] = {name: [] for name in CODECS}
    for seed in args.seeds:
        for name, stages in CODECS.items():
            versions = args.versions if name == "dense" else int(args.versions * args.extra)
            runs[name].append(run_codec(stages, seed=seed, versions=versions))
    mean = statistics.mean
    dense_final = [at_version(points, args.versions) for points in runs["dense"]]
    dense_acc = mean(p.accuracy for p in dense_final)
    dense_bytes = mean(p.upload_bytes for p in dense_final)
    print(f"FedBuff, digits, Dirichlet(0.5), 100 clients, uplink 2 Mbit/s median; mean over seeds {args.seeds}")
    print(f"\n1. after {args.versions} versions (the same number of client updates)")
    print(f"{'codec':<18} {'accuracy':>9} {'vs dense':>10} {'upload MB':>10} {'fewer bytes':>12} {'simulated s':>12}")
    for name, all_points in runs.items():
        final = [at_version(points, args.versions) for points in all_points]
        accuracy, sent = mean(p.accuracy for p in final), mean(p.upload_bytes for p in final)
        print(
            f"{name:<18} {accuracy:>9.4f} {100 * (accuracy - dense_acc):>+8.2f}pt {sent / 1e6:>10.2f} "
            f"{dense_bytes / sent:>11.1f}x {mean(p.simulated_s for p in final):>12.1f}"
        )
        simulated = mean(p.simulated_s for p in final)
        figures["equal_versions"][name] = {"accuracy": accuracy, "upload_bytes": sent, "simulated_s": simulated}
        if name != "dense":
            headline.append(Figure(f"{name}: accuracy", accuracy, "accuracy", "dense", accuracy / dense_acc))
            headline.append(Figure(f"{name}: upload bytes", sent, "bytes", "dense", sent / dense_bytes))
    for label, margin in (("2a", 0.01), ("2b", 0.005)):
        print(
            f"\n{label}. to reach dense's final accuracy minus {100 * margin:.1f} point (per seed), up to "
            f"{args.extra:g}x the versions"
        )
        print(f"{'codec':<18} {'reached':>8} {'versions':>9} {'upload MB':>10} {'fewer bytes':>12} {'simulated s':>12}")
        dense_hits = [first_reaching(p, d.accuracy - margin) for p, d in zip(runs["dense"], dense_final, strict=True)]
        dense_to_target = mean(h.upload_bytes for h in dense_hits if h is not None)
        for name, all_points in runs.items():
            hits = [first_reaching(p, d.accuracy - margin) for p, d in zip(all_points, dense_final, strict=True)]
            got = [h for h in hits if h is not None]
            if not got:
                print(f"{name:<18} {'0/' + str(len(hits)):>8}")
                continue
            sent = mean(h.upload_bytes for h in got)
            figures["to_target"].setdefault(label, {})[name] = {
                "reached": len(got),
                "of": len(hits),
                "versions": mean(h.version for h in got),
                "upload_bytes": sent,
                "simulated_s": mean(h.simulated_s for h in got),
            }
            print(
                f"{name:<18} {f'{len(got)}/{len(hits)}':>8} {mean(h.version for h in got):>9.0f} {sent / 1e6:>10.2f} "
                f"{dense_to_target / sent:>11.1f}x {mean(h.simulated_s for h in got):>12.1f}"
            )
    copy = copy_throughput()
    print(f"\n3. encode+decode of 1M float32 values (4 MB), best of 5; plain clone(): {copy:.0f} MB/s")
    for name, stages in {
        "dense": [],
        "fp16": [Float16()],
        "int8 chunk 256": [Int8(chunk=256)],
        "top-k 1%": [TopK(ratio=0.01)],
        "top-k 1% + int8": [TopK(ratio=0.01), Int8()],
    }.items():
        rate = throughput(stages)
        print(f"  {name:<18} {rate:>8.0f} MB/s  ({rate / copy:.2f}x of copy)")
        figures["throughput_mb_s"][name] = rate
        headline.append(Figure(f"{name}: encode+decode of 1M values", rate, "MB/s", "plain clone()", rate / copy))
    figures["throughput_mb_s"]["plain clone()"] = copy
    settings = {"versions": args.versions, "extra": args.extra, "seeds": args.seeds}
    store("compression", described, settings=settings, headline=headline, figures=figures, out=args.out)


if __name__ == "__main__":
    main()
