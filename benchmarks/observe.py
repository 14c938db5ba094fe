"""What observing each update costs the event loop: a run's events replayed through a bus, profiler and alert monitor.

An engine run (``benchmarks/cohort.py``'s ``engine_run``: vectorized cohorts of up to 1,000 clients, FedAvg rounds or
FedBuff, ``--clients`` clients, every client once) is made once with an instrument that records each event as it is
published (batches kept as batches). The script then, ``--repeats`` times, publishes the recorded events on a fresh
bus carrying the run's instrumentation (a profiler and an alert monitor with the default diagnostics, as a run builds
them), and builds every event the run built again from its fields, each timed on the thread's CPU clock. Printed: the
least CPU per accepted update of each, for this tree and, with ``--baseline CHECKOUT``, for an older checkout (its own
process, the same run, interleaved), and their ratio.

    python benchmarks/observe.py [--clients 100 1000] [--repeats 30] [--baseline CHECKOUT]

The figures go to ``benchmarks/results/observe.json`` (``--out``; see ``benchmarks/record.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SERVERS = {"fedavg": "sync", "fedbuff": "async"}


def _record(server: str, clients: int) -> list[Any]:
    """Return the events one engine run publishes, in order (batches as published)."""
    sys.path.insert(0, str(HERE))
    import cohort
    import torch

    from flasync.core.bus import EventBus
    from flasync.core.instruments import Instrument

    recorded: list[Any] = []

    class Recorder(Instrument):
        takes_batches = True  # so that publishers batch as they would without it

        def event_published(self, event: object) -> None:
            recorded.append(event)

    made = EventBus.__init__

    def with_recorder(bus: EventBus, **kwargs: Any) -> None:
        made(bus, **kwargs)
        bus.add_instrument(Recorder())

    torch.set_num_threads(1)
    EventBus.__init__ = with_recorder  # type: ignore[method-assign]
    try:
        cohort.engine_run(clients, "vectorized", 1000, torch.device("cpu"), server=server)
    finally:
        EventBus.__init__ = made  # type: ignore[method-assign]
    return recorded


def _worker(server: str, clients: int, repeats: int) -> dict[str, float]:
    """Record a run, replay it ``repeats`` times; return the least CPU microseconds per accepted update."""
    from flasync.config import DiagnosticsConfig
    from flasync.core.bus import EventBus
    from flasync.core.events import BATCH_EVENTS, UpdateReceived
    from flasync.observe.profiling import Instrumentation, Profiler
    from flasync.testing import NullLog
    from flasync.training.diagnostics import AlertMonitor

    events = _record(server, clients)
    members = [m for e in events for m in (e.members if isinstance(e, BATCH_EVENTS) else (e,))]
    accepted = sum(isinstance(m, UpdateReceived) for m in members)
    fields = [(type(m), {f.name: getattr(m, f.name) for f in dataclasses.fields(m)}) for m in members]

    def observe() -> float:
        bus = EventBus()
        monitor = AlertMonitor(DiagnosticsConfig())
        Instrumentation(bus, profiler=Profiler(SERVERS[server]), monitor=monitor, log=NullLog(), now=lambda: 0.0)
        began = time.thread_time()
        for event in events:
            bus.publish_nowait(event)
        return time.thread_time() - began

    def build() -> float:
        began = time.thread_time()
        for cls, values in fields:
            cls(**values)
        return time.thread_time() - began

    observed = min(observe() for _ in range(repeats))
    built = min(build() for _ in range(repeats))
    return {"observe_us": observed / accepted * 1e6, "build_us": built / accepted * 1e6, "accepted": accepted}


def _measure(tree: Path, server: str, clients: int, repeats: int) -> dict[str, float]:
    """Run the worker on ``tree``'s flasync in a fresh process and return its figures."""
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", server, str(clients), str(repeats)]
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def main() -> None:
    """Measure this tree (and the baseline, interleaved), print the table and store the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--baseline", type=Path, help="an older checkout, measured in the same run")
    parser.add_argument("--out", type=Path, help="where to store the result (default: benchmarks/results/)")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        server, clients, repeats = args.worker
        print(json.dumps(_worker(server, int(clients), int(repeats))))
        return
    sys.path.insert(0, str(HERE))
    from record import Figure, machine, store

    described = machine()
    this = HERE.parent
    figures: dict[str, Any] = {}
    headline: list[Figure] = []
    print(f"{'run':>20} {'what':>10} {'this tree':>10} {'baseline':>10} {'ratio':>7}  (CPU us per accepted update)")
    for clients in args.clients:
        for server in SERVERS:
            measured = {"this": _measure(this, server, clients, args.repeats)}
            if args.baseline is not None:
                measured["baseline"] = _measure(args.baseline, server, clients, args.repeats)
            figures[f"{server} {clients}"] = measured
            for what in ("observe_us", "build_us"):
                value = measured["this"][what]
                base = measured["baseline"][what] if "baseline" in measured else None
                ratio = value / base if base else None
                print(
                    f"{server + ' ' + str(clients):>20} {what[:-3]:>10} {value:10.2f} "
                    f"{'' if base is None else f'{base:10.2f}':>10} {'' if ratio is None else f'{ratio:6.2f}x':>7}"
                )
                headline.append(
                    Figure(
                        f"{'observing' if what == 'observe_us' else 'building the events'}, {server}, "
                        f"{clients:,} clients",
                        value,
                        "us/update",
                        None if base is None else "baseline checkout",
                        ratio,
                    )
                )
    settings = {"clients": args.clients, "repeats": args.repeats, "baseline": str(args.baseline or "")}
    store("observe", described, settings=settings, headline=headline, figures=figures, out=args.out)


if __name__ == "__main__":
    main()
