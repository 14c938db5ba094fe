"""A shell loop of tracked runs: ``python -m flasync run --set seed=K`` for K = 0..N-1, each started the moment the one
before exits, as ``for seed in 0 1 2 3; do python -m flasync run --set seed=$seed; done`` starts them.

The ways, interleaved, their order turning from one repeat to the next: untracked (``--no-tracking``, the baseline);
tracked with the writer server (:mod:`flasync.tracking._server`: the first command's MLflow writer forks it, and the
writers after it are its forks); tracked with ``FLASYNC_WRITER_SERVER=0`` (every writer a process of its own,
importing MLflow); with ``--baseline``, another checkout tracked. Every loop writes to one existing store (made before
the first repeat, with the model export cache warm), and each tracked loop gets a runtime folder of its own
(``XDG_RUNTIME_DIR``), so its first command finds no server, as a user's first loop of the day. Prints each command's
median wall time by its place in the loop, the loop's whole time, and its CPU: every process's, the server's and the
writers it forked included (counted once the loop is over and the server reaped them).

    python benchmarks/shell_loop.py                       # 3 repeats of 4 commands: about six minutes on 2 cores
    python benchmarks/shell_loop.py --commands 6 --repeats 5
    python benchmarks/shell_loop.py --baseline ../flasync-old

The medians and every loop's figures go to ``benchmarks/results/shell_loop.json`` (``--out``; see
``benchmarks/record.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import Figure, machine, store  # noqa: E402
from startup import _children_cpu_s, _servers, _settle, _stop_servers, order  # noqa: E402

UNTRACKED = "untracked"
SERVER = "tracked"
WITHOUT_SERVER = "tracked, no writer server"
BASELINE = "baseline, tracked"


@dataclasses.dataclass(frozen=True, slots=True)
class Loop:
    """One loop's figures (or their medians).

    Attributes:
        walls: Each command's wall seconds, in the loop's order.
        wall: The whole loop's.
        cpu: The CPU seconds of every process the loop ran (a writer server's and its forks' included).
        server_mb: The writer servers' resident memory once the loop is over, in MiB (0: none runs), and the part
            of it no other process shares (``server_unique_mb``).
    """

    walls: list[float]
    wall: float
    cpu: float
    server_mb: float = 0.0
    server_unique_mb: float = 0.0

    @classmethod
    def median(cls, loops: list[Loop]) -> Loop:
        """Return the medians of ``loops`` (each command's by its place, the whole loop's, the CPU)."""
        walls = [statistics.median(one.walls[i] for one in loops) for i in range(len(loops[0].walls))]
        return cls(
            walls,
            statistics.median(one.wall for one in loops),
            statistics.median(one.cpu for one in loops),
            statistics.median(one.server_mb for one in loops),
            statistics.median(one.server_unique_mb for one in loops),
        )


def loop(tree: Path, folder: Path, cache: Path, runtime: Path, commands: int, tracked: bool, server: bool) -> Loop:
    """Run ``commands`` default runs back to back in ``folder`` with ``tree``'s flasync and return their figures."""
    env = {**os.environ, "PYTHONPATH": str(tree), "XDG_CACHE_HOME": str(cache), "XDG_RUNTIME_DIR": str(runtime)}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("FLASYNC_WRITER_SERVER", None)  # the command line's own default
    if not server:
        env["FLASYNC_WRITER_SERVER"] = "0"
    used = _children_cpu_s()
    walls: list[float] = []
    for seed in range(commands):
        command = [sys.executable, "-m", "flasync", "run", "--set", f"seed={seed}"]
        if not tracked:
            command.append("--no-tracking")
        start = time.monotonic()
        subprocess.run(command, cwd=folder, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        walls.append(time.monotonic() - start)
    cpu = _children_cpu_s() - used
    if tracked and server:
        _settle(runtime, expect_server=True)
        servers = _servers(runtime)
        cpu += sum(own + forked for own, forked in servers.values())
        memory = [psutil.Process(pid).memory_full_info() for pid in servers]
        mib = 1024 * 1024
        return Loop(walls, sum(walls), cpu, sum(m.rss for m in memory) / mib, sum(m.uss for m in memory) / mib)
    return Loop(walls, sum(walls), cpu)


def main() -> None:
    """Run the loops, print the medians and store them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commands", type=int, default=4, help="runs in each loop (default 4)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another flasync checkout, tracked the same way, interleaved")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "shell_loop.json")
    args = parser.parse_args()
    ways = {UNTRACKED: (ROOT, False, False), SERVER: (ROOT, True, True), WITHOUT_SERVER: (ROOT, True, False)}
    if args.baseline is not None:
        ways[BASELINE] = (args.baseline.resolve(), True, True)
    described = machine()
    print(f"{described['cpu']}, {described['cpus']} CPUs, load {described['load_average_1m']}, {described['commit']}")
    loops: dict[str, list[Loop]] = {name: [] for name in ways}
    with tempfile.TemporaryDirectory(prefix="flasync-loop-") as tmp:
        folder, cache = Path(tmp, "work"), Path(tmp, "cache")
        folder.mkdir()
        # The store and the model export cache, made once: every loop finds them, as a user's second loop does.
        warm = Path(tmp, "warm")
        warm.mkdir(mode=0o700)
        loop(ROOT, folder, cache, warm, 1, tracked=True, server=False)
        for repeat in range(args.repeats):
            for name in order(list(ways), repeat):
                tree, tracked, server = ways[name]
                runtime = Path(tempfile.mkdtemp(prefix="r", dir=tmp))  # short: a socket's path is at most 107 bytes
                runtime.chmod(0o700)
                try:
                    loops[name].append(loop(tree, folder, cache, runtime, args.commands, tracked, server))
                finally:
                    _stop_servers(runtime)
                print(f"repeat {repeat + 1}, {name}: {loops[name][-1].wall:.2f} s", flush=True)
    medians = {name: Loop.median(done) for name, done in loops.items()}
    print(f"\nmedians of {args.repeats}, {args.commands} commands a loop (s):")
    print(f"| way | {' | '.join(f'run {i + 1}' for i in range(args.commands))} | loop | CPU | server MiB |")
    print(f"|---|{'---|' * (args.commands + 3)}")
    for name, med in medians.items():
        held = f"{med.server_mb:.0f} ({med.server_unique_mb:.0f} its own)" if med.server_mb else "-"
        walls = " | ".join(f"{w:.2f}" for w in med.walls)
        print(f"| {name} | {walls} | {med.wall:.2f} | {med.cpu:.2f} | {held} |")
    untracked = medians[UNTRACKED].wall
    headline = [Figure(f"{args.commands} runs in a shell loop, {UNTRACKED}", untracked, "s")]
    for name, med in medians.items():
        if name != UNTRACKED:
            print(f"{name}: tracking adds {(med.wall - untracked) / args.commands:+.2f} s a run")
            headline.append(
                Figure(f"{args.commands} runs in a shell loop, {name}", med.wall, "s", UNTRACKED, med.wall / untracked)
            )
    for other in (WITHOUT_SERVER, BASELINE):
        if other in medians:
            this, base = medians[SERVER], medians[other]
            headline.append(Figure(f"the loop, tracked, against {other}", this.wall, "s", other, this.wall / base.wall))
            headline.append(
                Figure(f"the loop's CPU, tracked, against {other}", this.cpu, "s", other, this.cpu / base.cpu)
            )
    store(
        "shell_loop",
        described,
        settings={"commands": args.commands, "repeats": args.repeats, "baseline": args.baseline is not None},
        headline=headline,
        figures={
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),
            "medians": {name: dataclasses.asdict(med) for name, med in medians.items()},
            "loops": {name: [dataclasses.asdict(one) for one in done] for name, done in loops.items()},
        },
        out=args.out,
    )


if __name__ == "__main__":
    main()
