"""Client updates per second: vectorized cohorts against a plain one-client-at-a-time PyTorch loop, same run.

The tutorial workload: synthetic data (32 features, 10 classes), MLP 32-64-10, 200 samples per client, batch 32,
1 local epoch, SGD lr 0.01. Every runner trains each of ``--clients`` clients once from the same global weights and
sums the deltas (sample-weighted), as one FedAvg round does:

* ``plain loop``: a bare ``for`` loop over clients with ``torch.optim.SGD``, indexing in-memory tensors (no
  DataLoader) - what a per-client FL simulator does at best;
* ``flasync train()``: flasync's per-client path (:func:`flasync.training.local.train` on a flat model), one at a time;
* ``vectorized``: :class:`flasync.training.cohort.CohortTrainer`, cohorts of ``--max-cohort`` clients, deltas folded
with
  ``UpdateBuffer.add_stacked``;
* with ``--engine``, the whole engine (``flasync.run``: sync FedAvg rounds of ``min(clients, --max-cohort)``, virtual
  clock, tracking off, clients of ``--speed``) with ``executor.kind = "thread"`` and ``"vectorized"``, and FedBuff
  with as many tasks in flight (``K`` a tenth of them) on vectorized cohorts, each client trained once
  (``--rounds R``: R times, so that the run's start and end, two evaluations among them, weigh less), and the
  vectorized engine's rate against each bare vectorized runner's; with ``--phases`` also where the vectorized
  engine's time goes, FedAvg and FedBuff: the dispatch before the first cohort trains, the cohorts' training, the
  worker's finishing of their updates while no cohort trains, and the rest (the event loop's intake of the updates,
  the end), and the event loop thread's CPU time in the server run per accepted update (``time.thread_time``: the
  loop's own Python per update, which sets the engine's pace once training is fast), each the median over
  ``--repeats`` extra runs. With ``--baseline CHECKOUT`` (a checkout of flasync, e.g. ``git worktree add
  /tmp/base-loop main``) every phases run of this tree and of the baseline runs in its own process (after a warm-up
  run there), interleaved, and the loop CPU per update is printed against the baseline's. The engine trains a
  round's cohorts on one thread per core (``executor.workers`` unset), so ``--bare-threads 2`` also times the bare
  trainer with 2 intra-op threads.

    python benchmarks/cohort.py [--clients 100 1000 10000] [--repeats 3] [--max-cohort 1000] [--device cpu|cuda]
                                [--threads 1] [--bare-threads 2] [--no-per-client]
                                [--engine [--phases [--baseline CHECKOUT]] [--speed constant|lognormal]
                                 [--rounds 1]]

With ``--device cuda`` the plain loop runs on the CPU (the CPU baseline) and again on the GPU (one client at a time
on the same GPU), and flasync's runners on the GPU. Each repeat runs every runner once, interleaved; printed are
the median rate of each runner, its ratio to the plain loop's median, and the median over repeats of the ratio
within a repeat ("paired"), which cancels drifts in the load of a shared machine. Every rate (and the engine's
phases) goes to ``benchmarks/results/cohort.json`` (``--out``; see ``benchmarks/record.py``), headed by each
runner's paired ratio to the plain loop on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import flasync
from flasync.aggregation import UpdateBuffer
from flasync.core import seeding
from flasync.data import make_synthetic, partition_iid
from flasync.server import Server
from flasync.training.cohort import CohortMember, CohortTrainer
from flasync.training.executors.threads import CohortBatcher
from flasync.training.local import FlatModel, LocalTraining, flat_parameters, train
from flasync.training.models import MLP

if __package__:  # imported as benchmarks.cohort
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

FEATURES, CLASSES, HIDDEN, SAMPLES, BATCH, LR = 32, 10, (64,), 200, 32, 0.01
CFG = LocalTraining(epochs=1, batch_size=BATCH, lr=LR)


class Workload:
    """Data, partition and initial weights of ``num_clients`` tutorial clients on ``device``."""

    def __init__(self, num_clients: int, device: torch.device) -> None:
        """Draw the data and the partition."""
        data = make_synthetic(
            num_samples=SAMPLES * num_clients,
            num_features=FEATURES,
            num_classes=CLASSES,
            rng=seeding.numpy_stream(0, seeding.DATA),
        )
        partition = partition_iid(len(data), num_clients, rng=seeding.numpy_stream(0, seeding.PARTITION))
        self.device = device
        self.x, self.y = data.x.to(device), data.y.to(device)
        index = torch.from_numpy(partition.indices.copy()).to(device)
        offsets = partition.offsets.tolist()
        self.parts = [index[offsets[k] : offsets[k + 1]] for k in range(num_clients)]
        torch.manual_seed(0)
        self.base = flat_parameters(MLP(FEATURES, HIDDEN, CLASSES)).to(device)

    def generator(self, client: int) -> torch.Generator:
        """Return the client's batch-order stream."""
        return seeding.torch_stream(0, seeding.TASK, client, 0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_loop(work: Workload, device: torch.device) -> float:
    """Train every client one at a time with torch.optim.SGD on ``device``; return updates per second."""
    x, y = work.x.to(device), work.y.to(device)
    parts = [p.to(device) for p in work.parts]
    torch.manual_seed(0)
    model = MLP(FEATURES, HIDDEN, CLASSES).to(device)
    params = list(model.parameters())
    offset, global_weights = 0, []
    for p in params:
        global_weights.append(work.base[offset : offset + p.numel()].view_as(p).to(device).clone())
        offset += p.numel()
    accumulator = [torch.zeros_like(p) for p in params]
    optimizer = torch.optim.SGD(params, lr=LR)
    _sync(device)
    start = time.perf_counter()
    for client, index in enumerate(parts):
        cx, cy = x[index], y[index]
        with torch.no_grad():
            for p, g in zip(params, global_weights, strict=True):
                p.copy_(g)
        perm = torch.randperm(len(index), generator=work.generator(client)).to(device)
        for begin in range(0, len(index), BATCH):
            batch = perm[begin : begin + BATCH]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(cx[batch]), cy[batch])
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
        with torch.no_grad():
            for acc, p, g in zip(accumulator, params, global_weights, strict=True):
                acc.add_(g - p, alpha=len(index))
    _sync(device)
    return len(parts) / (time.perf_counter() - start)


def flasync_per_client(work: Workload) -> float:
    """Train every client one at a time with flasync's train(); return updates per second."""
    model = FlatModel(MLP(FEATURES, HIDDEN, CLASSES).to(work.device))
    buffer = UpdateBuffer(work.base.numel(), device=work.device)
    _sync(work.device)
    start = time.perf_counter()
    for client, index in enumerate(work.parts):
        result = train(model, work.base, work.x[index], work.y[index], CFG, work.generator(client))
        buffer.add(result.delta, example_weight=float(result.num_samples), staleness_weight=1.0)
    _sync(work.device)
    return len(work.parts) / (time.perf_counter() - start)


def vectorized(work: Workload, max_cohort: int) -> float:
    """Train every client in cohorts of ``max_cohort``; return updates per second."""
    trainer = CohortTrainer(MLP(FEATURES, HIDDEN, CLASSES).to(work.device))
    buffer = UpdateBuffer(work.base.numel(), device=work.device)
    _sync(work.device)
    start = time.perf_counter()
    for first in range(0, len(work.parts), max_cohort):
        clients = range(first, min(first + max_cohort, len(work.parts)))
        members = [CohortMember(indices=work.parts[c], generator=work.generator(c)) for c in clients]
        outcome = trainer.train(work.base, work.x, work.y, members, CFG)
        deltas = torch.stack([r.delta for r in outcome.results])
        samples = torch.tensor([float(r.num_samples) for r in outcome.results], device=work.device)
        buffer.add_stacked(deltas, example_weights=samples, staleness_weights=torch.ones_like(samples))
    _sync(work.device)
    return len(work.parts) / (time.perf_counter() - start)


def with_threads(threads: int, runner: Callable[[], float]) -> float:
    """Run ``runner`` with ``threads`` intra-op torch threads in this thread; return its rate."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return runner()
    finally:
        torch.set_num_threads(before)


SERVERS = ("fedavg", "fedbuff")
"""The engine's aggregators: sync FedAvg rounds, and FedBuff with a round's clients in flight (K = a tenth of them)."""


def rate(summary: flasync.RunSummary) -> float:
    """A run's accepted updates per wall second."""
    return summary.updates_accepted / summary.wall_s


def engine_run(
    num_clients: int,
    kind: str,
    max_cohort: int,
    device: torch.device,
    speed: str = "constant",
    rounds: int = 1,
    server: str = "fedavg",
) -> flasync.RunSummary:
    """Run the engine over every client ``rounds`` times with executor ``kind``, client speed model ``speed``
    (``constant``: every client finishes at one simulated time; ``lognormal``: each at its own) and ``server``:
    ``min(num_clients, max_cohort)`` clients a round, as FedAvg rounds or as FedBuff's tasks in flight (buffer ``K``
    a tenth of them, so ten versions a round); return its summary."""
    per_round = min(num_clients, max_cohort)
    rounds_total = max(1, num_clients // per_round) * rounds
    if server == "fedavg":
        aggregator: dict[str, Any] = {"kind": "fedavg", "clients_per_round": per_round}
        versions = rounds_total
    else:
        buffer = max(1, per_round // 10)
        aggregator = {"kind": "fedbuff", "buffer_size": buffer, "concurrency": per_round}
        versions = rounds_total * per_round // buffer
    config = {
        "seed": 0,
        "data": {"kind": "synthetic", "samples_per_client": SAMPLES, "num_features": FEATURES, "test_samples": 500},
        "partition": {"kind": "iid"},
        "model": {"kind": "mlp", "hidden": list(HIDDEN)},
        "population": {"num_clients": num_clients, "speed": {"kind": speed}, "sampling": "lru"},
        "client": {"epochs": 1, "batch_size": BATCH, "lr": LR},
        "server": aggregator,
        "executor": {"kind": kind, "max_cohort": max_cohort, "device": device.type},
        "eval": {"every_versions": 10_000},
        "stop": {"max_versions": versions},
        "tracking": {"enabled": False, "log_level": "warning", "log_model": False},
    }
    return flasync.run(config)


Interval = tuple[float, float]


@contextlib.contextmanager
def phase_marks() -> Iterator[dict[str, list[Interval]]]:
    """Record the engine's phases while the block runs, as ``(start, end)`` perf_counter intervals: the server's run
    (``serve``), each cohort's training (``train``: ``CohortTrainer.train``) and each cohort's finishing (``finish``:
    the rest of the batcher's job, which finishes and encodes the members' updates and delivers them). Cohorts may
    train side by side, on a thread each. ``serve_cpu`` holds the event loop thread's CPU clock at the server run's
    start and end."""
    marks: dict[str, list[Interval]] = {"serve": [], "train": [], "finish": [], "serve_cpu": []}
    local = threading.local()
    train, run, serve = CohortTrainer.train, CohortBatcher._run, Server.run

    def timed_train(self: CohortTrainer, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return train(self, *args, **kwargs)
        finally:
            local.trained = time.perf_counter()
            marks["train"].append((began, local.trained))

    def timed_run(self: CohortBatcher, held: Any) -> None:
        local.trained = None
        try:
            run(self, held)
        finally:
            if local.trained is not None:
                marks["finish"].append((local.trained, time.perf_counter()))

    async def timed_serve(self: Server) -> Any:
        began, cpu = time.perf_counter(), time.thread_time()  # the event loop's thread
        try:
            return await serve(self)
        finally:
            marks["serve"].append((began, time.perf_counter()))
            marks["serve_cpu"].append((cpu, time.thread_time()))

    CohortTrainer.train = timed_train  # type: ignore[method-assign]
    CohortBatcher._run = timed_run  # type: ignore[method-assign]
    Server.run = timed_serve  # type: ignore[method-assign]
    try:
        yield marks
    finally:
        CohortTrainer.train, CohortBatcher._run, Server.run = train, run, serve  # type: ignore[method-assign]


def covered(intervals: list[Interval]) -> list[Interval]:
    """Return the union of ``intervals`` as disjoint intervals, in order."""
    union: list[Interval] = []
    for began, ended in sorted(intervals):
        if union and began <= union[-1][1]:
            union[-1] = (union[-1][0], max(union[-1][1], ended))
        else:
            union.append((began, ended))
    return union


def length(intervals: list[Interval]) -> float:
    """Return the time ``intervals`` cover (each instant once)."""
    return sum(ended - began for began, ended in covered(intervals))


LOOP_CPU = "loop CPU per accepted update (us)"
"""The figure the loop's work is judged by: the event loop thread's CPU time in the server run over its updates."""


def phase_figures(
    num_clients: int, max_cohort: int, device: torch.device, speed: str, rounds: int, server: str
) -> dict[str, float]:
    """Run one vectorized engine run; return where its wall time went (ms) and its loop CPU per update (us)."""
    with phase_marks() as marks:
        summary = engine_run(num_clients, "vectorized", max_cohort, device, speed, rounds, server)
    ((start, end),) = marks["serve"]
    ((cpu_start, cpu_end),) = marks["serve_cpu"]
    first = min(began for began, _ in marks["train"])
    training = length(marks["train"])
    finishing = length(marks["train"] + marks["finish"]) - training
    seconds = {
        "server run": end - start,
        "dispatch (start to first cohort)": first - start,
        "training (some cohort trains)": training,
        "finishing (encode, deliver; none trains)": finishing,
        "rest (intake, end)": (end - start) - (first - start) - training - finishing,
        "after the last delivery": end - max(ended for _, ended in marks["finish"]),
        # The loop's own work (dispatch, jobs, intake, events): little of it overlaps a FedAvg round's training.
        "event-loop thread CPU in the server run": cpu_end - cpu_start,
    }
    figures = {key: 1000 * value for key, value in seconds.items()}
    figures[LOOP_CPU] = (cpu_end - cpu_start) / summary.updates_accepted * 1e6
    return figures


def phases_in(
    tree: Path, num_clients: int, max_cohort: int, device: torch.device, speed: str, rounds: int, server: str
) -> dict[str, float]:
    """Run :func:`phase_figures` in a fresh process that imports flasync from the checkout ``tree`` (after one
    warm-up run of the same federation there); return its figures."""
    command = [sys.executable, str(Path(__file__).resolve()), "--phases-worker", server]
    command += ["--clients", str(num_clients), "--max-cohort", str(max_cohort), "--device", device.type]
    command += ["--speed", speed, "--rounds", str(rounds)]
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def engine_phases(
    num_clients: int,
    max_cohort: int,
    device: torch.device,
    repeats: int,
    speed: str,
    rounds: int = 1,
    baseline: Path | None = None,
) -> dict[str, Any]:
    """Print where the vectorized engine's time goes and its loop CPU per update, FedAvg and FedBuff (medians over
    ``repeats`` runs); with a ``baseline`` checkout, each run of this tree and of the baseline in its own process,
    interleaved, and the ratio of their loop CPU per update. Return every run's figures by aggregator, tree and
    name."""
    found: dict[str, Any] = {}
    trees = {"this tree": Path(__file__).resolve().parent.parent}
    if baseline is not None:
        trees["baseline"] = baseline
    for server in SERVERS:
        rows: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
        for _ in range(repeats):
            for name, tree in trees.items():
                if baseline is None:
                    figures = phase_figures(num_clients, max_cohort, device, speed, rounds, server)
                else:
                    figures = phases_in(tree, num_clients, max_cohort, device, speed, rounds, server)
                for key, value in figures.items():
                    rows[name].setdefault(key, []).append(value)
        print(f"{num_clients:>8} engine phases, vectorized {server}, medians of {repeats} runs (ms; us per update):")
        print(f"{'':>8}   {'':<44} " + " ".join(f"{name:>10}" for name in trees))
        for key in rows["this tree"]:
            values = " ".join(f"{statistics.median(rows[name][key]):10.1f}" for name in trees)
            print(f"{'':>8}   {key:<44} {values}")
        if baseline is not None:
            ours, theirs = rows["this tree"][LOOP_CPU], rows["baseline"][LOOP_CPU]
            pairs = [o / t for o, t in zip(ours, theirs, strict=True)]
            paired, spread = statistics.median(pairs), f"{min(pairs):.2f}x to {max(pairs):.2f}x"
            # The spread of the pairs says how far a shared machine's noise reaches (a short run's is wide).
            print(f"{'':>8}   {'loop CPU per update, this tree / baseline':<44} {paired:9.2f}x (paired; {spread})")
        found[server] = rows
    return found


def phases_worker(args: argparse.Namespace) -> None:
    """Print one :func:`phase_figures` run's figures as a JSON line, after a warm-up run of the same federation."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    (num_clients,) = args.clients
    vectorized(Workload(min(num_clients, 8), device), 8)
    engine_run(num_clients, "vectorized", args.max_cohort, device, args.speed, args.rounds, args.phases_worker)
    figures = phase_figures(num_clients, args.max_cohort, device, args.speed, args.rounds, args.phases_worker)
    print(json.dumps(figures))


def main() -> None:
    """Print updates/s and ratios against the plain loop."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000, 10_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-cohort", type=int, default=1000)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--no-per-client", action="store_true", help="skip flasync's one-at-a-time runner")
    parser.add_argument("--engine", action="store_true", help="also time whole FedAvg runs, thread vs vectorized")
    parser.add_argument(
        "--phases", action="store_true", help="with --engine: where a vectorized engine run's time goes"
    )
    parser.add_argument(
        "--bare-threads",
        type=int,
        nargs="+",
        default=[],
        help="also run the bare vectorized trainer with these intra-op thread counts (the engine may train on one "
        "thread per core)",
    )
    parser.add_argument(
        "--speed",
        default="constant",
        choices=["constant", "lognormal"],
        help="with --engine: the clients' speeds (constant: a round's clients all finish at one simulated time)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --engine: train every client this many times (a run's start and end are paid once)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op torch threads (1, as flasync's workers: robust when shared)"
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="with --engine --phases: a checkout of flasync (e.g. a git worktree of main) whose engine is measured "
        "too, each run in its own process, interleaved with this tree's",
    )
    parser.add_argument("--phases-worker", choices=SERVERS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help="result file (default: benchmarks/results/)")
    args = parser.parse_args()
    if args.phases_worker is not None:
        phases_worker(args)
        return
    described = machine()
    headline: list[Figure] = []
    figures: dict[str, Any] = {}
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        name = torch.cuda.get_device_name(device)
    else:
        name = "CPU"
    print(f"torch {torch.__version__}, {name}, {torch.get_num_threads()} intra-op threads, {args.repeats} repeats")
    print(f"{'clients':>8} {'runner':<38} {'updates/s':>11} {'vs plain':>9} {'paired':>9}")
    for num_clients in args.clients:
        work = Workload(num_clients, device)
        runners: dict[str, Callable[[], float]] = {
            "plain loop (cpu)": lambda w=work: plain_loop(w, torch.device("cpu"))
        }
        if device.type == "cuda":
            runners["plain loop (cuda)"] = lambda w=work: plain_loop(w, device)
        if not args.no_per_client:
            runners[f"flasync train() ({device.type})"] = lambda w=work: flasync_per_client(w)
        bare = f"vectorized ({device.type}, K<={args.max_cohort})"
        runners[bare] = lambda w=work: vectorized(w, args.max_cohort)
        for threads in args.bare_threads:
            if threads != args.threads:
                runners[f"{bare}, {threads} threads"] = lambda w=work, t=threads: with_threads(
                    t, lambda: vectorized(w, args.max_cohort)
                )
        if args.engine:
            for kind in ("thread", "vectorized"):
                runners[f"engine, {kind}"] = lambda n=num_clients, k=kind: rate(
                    engine_run(n, k, args.max_cohort, device, args.speed, args.rounds)
                )
            runners["engine, vectorized fedbuff"] = lambda n=num_clients: rate(
                engine_run(n, "vectorized", args.max_cohort, device, args.speed, args.rounds, "fedbuff")
            )
        vectorized(Workload(min(num_clients, 8), device), 8)  # warm up torch.func and kernels
        rates: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(args.repeats):
            for runner_name, runner in runners.items():
                rates[runner_name].append(runner())
        baseline = rates["plain loop (cpu)"]
        for runner_name, values in rates.items():
            paired = statistics.median(v / b for v, b in zip(values, baseline, strict=True))
            median = statistics.median(values)
            ratio = median / statistics.median(baseline)
            print(f"{num_clients:>8} {runner_name:<38} {median:11.0f} {ratio:8.2f}x {paired:8.2f}x")
            if runner_name != "plain loop (cpu)":
                name = f"{num_clients} clients, {runner_name}"
                headline.append(Figure(name, median, "updates/s", "plain loop (cpu), paired", paired))
        figures[str(num_clients)] = {"updates_per_s": rates}
        if args.engine:
            engine_rates = rates["engine, vectorized"]
            title = "the vectorized engine against the bare cohorts:"
            print(f"{num_clients:>8} {title:<54} {'ratio':>9} {'paired':>9}")
            for runner_name, values in rates.items():
                if runner_name.startswith(bare):
                    paired = statistics.median(e / v for e, v in zip(engine_rates, values, strict=True))
                    ratio = statistics.median(engine_rates) / statistics.median(values)
                    against = "  engine / bare " + runner_name
                    print(f"{num_clients:>8} {against:<54} {ratio:8.2f}x {paired:8.2f}x")
        if args.engine and args.phases:
            phases = engine_phases(
                num_clients, args.max_cohort, device, args.repeats, args.speed, args.rounds, args.baseline
            )
            figures[str(num_clients)]["engine_phases"] = phases
            for server, rows in phases.items():
                cpu = statistics.median(rows["this tree"][LOOP_CPU])
                name = f"{num_clients} clients, vectorized {server}: {LOOP_CPU}"
                if args.baseline is None:
                    headline.append(Figure(name, cpu, "us"))
                else:
                    base = statistics.median(rows["baseline"][LOOP_CPU])
                    headline.append(Figure(name, cpu, "us", f"baseline checkout ({base:.1f} us)", cpu / base))
        if device.type == "cuda":
            gpu_plain, vec = rates["plain loop (cuda)"], rates[list(runners)[-1]]
            paired = statistics.median(v / b for v, b in zip(vec, gpu_plain, strict=True))
            print(f"{num_clients:>8} {'vectorized vs plain (cuda)':<38} {'':>11} {'':>9} {paired:8.2f}x")
    settings = {key: value for key, value in vars(args).items() if key not in ("out", "phases_worker")}
    if args.baseline is not None:
        head = ["git", "-C", str(args.baseline), "rev-parse", "--short", "HEAD"]
        commit = subprocess.run(head, capture_output=True, text=True, check=False).stdout.strip()
        settings["baseline"] = f"{args.baseline} ({commit or 'not a git checkout'})"
    else:
        settings["baseline"] = None
    store("cohort", described, settings=settings, headline=headline, figures=figures, out=args.out)


if __name__ == "__main__":
    main()
