"""In-place aggregation bandwidth as a fraction of a plain ``copy_`` of the same size, measured in the same run.

    python benchmarks/aggregation.py [--params 1000000 10000000] [--repeats 30] [--cohort 16] [--device cpu|cuda]
                                     [--threads 1]

For each model size it times, interleaved so that load drifts hit every operation alike:

* ``copy_``: ``dst.copy_(src)`` - reads and writes one model (2 x 4 bytes per parameter), the reference;
* ``UpdateBuffer.add``: ``acc.add_(delta, alpha=e*s)`` with the buffer's checks - reads two, writes one (12 B/param);
* ``addcmul_``: ``acc.addcmul_(delta, mask, value=w)``, a masked (e.g. sparse-coordinate) fold - 16 B/param;
* ``UpdateBuffer.add_stacked``: ``--cohort`` deltas folded by one ``addmv_`` - reads K + 1, writes 1 model.

Bandwidth is the bytes an operation must move over its median time; the printed fraction is that over the
``copy_`` bandwidth of the same repeat, then the median over repeats ("paired"). Target: >= 0.5. The figures go
to ``benchmarks/results/aggregation.json`` (see ``benchmarks/record.py``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flasync.aggregation import UpdateBuffer

if __package__:  # imported as benchmarks.aggregation
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store


def _discard(_: object) -> None:
    """Drop an in-place op's return value."""


def _timed(fn: Callable[[], None], sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def main() -> None:
    """Print bandwidths and fractions of copy bandwidth."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--cohort", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="intra-op torch threads (CPU)")
    parser.add_argument("--out", type=Path, help="results JSON (default: benchmarks/results/aggregation.json)")
    args = parser.parse_args()
    described = machine()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"torch {torch.__version__}, device {device}, {torch.get_num_threads()} intra-op threads")
    print(f"{'params':>11} {'operation':<28} {'GB/s':>8} {'vs copy_':>9}")
    rows = [row for n in args.params for row in _measure(n, args.repeats, args.cohort, device, sync)]
    headline = [
        Figure(f"{row['operation']}, {row['params']:,} parameters", row["gb_s"], "GB/s", "copy_", row["vs_copy"])
        for row in rows
        if row["operation"] != "copy_"
    ]
    settings = {"repeats": args.repeats, "cohort": args.cohort, "device": str(device), "threads": args.threads}
    store("aggregation", described, settings=settings, headline=headline, figures={"rows": rows}, out=args.out)


def _measure(n: int, repeats: int, cohort: int, device: torch.device, sync: Callable[[], None]) -> list[dict[str, Any]]:
    """Time every operation on ``n`` parameters, interleaved; print one line each and return them."""
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    buffer = UpdateBuffer(n, device=device)
    acc = torch.zeros_like(src)
    mask = (torch.rand(n, device=device) < 0.5).float()
    stack = torch.randn(cohort, n, device=device)
    e = torch.ones(cohort, device=device)
    s = torch.full((cohort,), 0.5, device=device)
    ops: dict[str, tuple[Callable[[], None], int]] = {
        "copy_": (lambda: _discard(dst.copy_(src)), 8 * n),
        "UpdateBuffer.add (add_)": (
            lambda: buffer.add(src, example_weight=2.0, staleness_weight=0.5),
            12 * n,
        ),
        "addcmul_ (masked)": (lambda: _discard(acc.addcmul_(src, mask, value=0.5)), 16 * n),
        f"add_stacked (K={cohort})": (
            lambda: buffer.add_stacked(stack, example_weights=e, staleness_weights=s),
            4 * n * (cohort + 2),
        ),
    }
    for fn, _ in ops.values():  # warm up
        fn()
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(repeats):
        for name, (fn, _) in ops.items():
            times[name].append(_timed(fn, sync))
        buffer.reset()
    rows: list[dict[str, Any]] = []
    for name, (_, nbytes) in ops.items():
        bandwidth = nbytes / statistics.median(times[name]) / 1e9
        paired = statistics.median((nbytes / t) / (8 * n / c) for t, c in zip(times[name], times["copy_"], strict=True))
        print(f"{n:>11,} {name:<28} {bandwidth:8.2f} {paired:8.2f}x")
        rows.append({"params": n, "operation": name, "gb_s": round(bandwidth, 3), "vs_copy": round(paired, 3)})
    return rows


if __name__ == "__main__":
    main()
