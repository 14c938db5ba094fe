"""What a user waits for: the default run from the shell, with and without tracking, phase by phase.

Runs ``python -m flasync run`` (the default experiment) four ways, ``--repeats`` times each, alternating: tracked
into a new SQLite store with no schema kept yet (a new user's very first run: its schema is replayed from the one
flasync ships, or built by MLflow's migrations for an MLflow it ships none for), tracked into
a new store in another folder (its schema a copy of the one the first run kept, see
:func:`flasync.tracking.store.prepare_sqlite_store`), tracked again into that store, and with ``--no-tracking``. Each
repeat has a cache folder of its own (``XDG_CACHE_HOME``), so the first kind never finds a kept schema. The tracked
kinds run in that order (each needs what the one before kept); the untracked run takes another place in each repeat,
and with ``--baseline`` the two trees take turns going first, so that what one run leaves behind (its processes
ending, the page cache) and a drift of the machine within a repeat fall on every kind and tree alike.
A tracked command leaves a writer server (:mod:`flasync.tracking._server`: its MLflow writer process forks one, MLflow
imported; older trees start one as the command ends) that the next command's writer is forked from: each repeat's
sockets go to a folder of its own (``XDG_RUNTIME_DIR``), so its first kind never finds a server, and after each
command the script waits until the server listens and has reaped the command's writer (a user's pause between two
commands), then counts that writer's CPU with the command's and the server's own apart (``server start cpu``: what
the server spent on its own, nothing waiting for it). ``--without-server`` also runs this tree with
``FLASYNC_WRITER_SERVER=0``, interleaved.
Every stderr line is time-stamped as it arrives, which gives: the first line, the start of each phase (``run.phase``:
loading the data, starting the MLflow run, logging the artifacts), training (``run.started`` to the last
``server.eval``), the first client update (``run.started`` plus the summary's ``first update``), the moment the
MLflow run exists (``run.opened``: training does not wait for it) and the exit; and the CPU seconds of the command's
processes (``cpu``: the run's, MLflow's writer process's and its helper's, each reaped by the time the command ends),
which a loaded machine stretches far less than it stretches the wall clock.
Prints the medians and what tracking adds in each stretch.

    python benchmarks/startup.py               # 3 repeats: about two minutes on 2 cores
    python benchmarks/startup.py --repeats 5
    python benchmarks/startup.py --no-system-metrics   # tracked runs without MLflow's system monitor
    python benchmarks/startup.py --baseline ../flasync-old   # also an older checkout, interleaved, same runs
    python benchmarks/startup.py --without-server      # also this tree without the writer server, interleaved

The medians, what tracking adds and every run's marks go to ``benchmarks/results/startup.json`` (``--out``; see
``benchmarks/record.py``), headed by each tracked kind's whole run against the untracked one's (and, with
``--baseline`` or ``--without-server``, this tree's against the other's).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import resource
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

from flasync.tracking._server import listens  # noqa: E402  (a socket probe: the same in every tree)

MARKS = {
    "first line": None,
    "torch": "phase='loading flasync and torch'",
    "data": "phase='loading the data",
    "mlflow start": "phase='starting the MLflow run'",
    "training": "run.started",
    "run opened": "run.opened",
    "last eval": "server.eval  version=150/150",
    "artifacts": "phase='logging the artifacts'",
}


def one(
    folder: Path,
    tracked: bool,
    system_metrics: bool = True,
    cache: Path | None = None,
    tree: Path = ROOT,
    runtime: Path | None = None,
    extra_env: dict[str, str] | None = None,
) -> dict[str, float]:
    """Run once in ``folder`` with ``tree``'s flasync (``cache``: the ``XDG_CACHE_HOME`` it sees, ``runtime`` its
    ``XDG_RUNTIME_DIR``, where its writer server's socket goes; ``extra_env`` more variables); return seconds from
    the command's start to each mark and to its exit, the CPU seconds of its processes (``cpu``: with its MLflow
    writer's where a writer server forked it) and, where the command started a writer server, that server's CPU
    seconds until it listens (``server start cpu``: spent after the command, while nothing waits for it)."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(extra_env or {})}
    env.pop("MLFLOW_TRACKING_URI", None)
    if cache is not None:
        env["XDG_CACHE_HOME"] = str(cache)
    if runtime is not None:
        env["XDG_RUNTIME_DIR"] = str(runtime)
    servers_before = _servers(runtime)
    args = [sys.executable, "-m", "flasync", "run"]
    if not system_metrics:
        args.append("--no-system-metrics")
    if not tracked:
        args.append("--no-tracking")
    start = time.monotonic()
    used = _children_cpu_s()
    process = subprocess.Popen(args, cwd=folder, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stderr is not None and process.stdout is not None
    seen: dict[str, float] = {}
    tail: list[str] = []
    for line in process.stderr:
        tail = [*tail[-30:], line]
        now = time.monotonic() - start
        for mark, needle in MARKS.items():
            if mark not in seen and (needle is None or needle in line):
                seen[mark] = now
    summary = process.stdout.read()  # a few lines: the pipe never fills while stderr is read
    if process.wait() != 0:
        raise SystemExit(f"the run failed (exit {process.returncode}) in {folder}:\n{''.join(tail)}")
    seen["exit"] = time.monotonic() - start
    seen["cpu"] = _children_cpu_s() - used
    if runtime is not None:
        # A writer forked by a server is the server's child: its CPU reaches the server's count once reaped.
        _settle(
            runtime, tracked and env.get("FLASYNC_WRITER_SERVER") != "0" and (tree / "tracking/_server.py").exists()
        )
        servers_after = _servers(runtime)
        seen["cpu"] += sum(
            servers_after[pid][1] - cpu[1] for pid, cpu in servers_before.items() if pid in servers_after
        )
        started = [own for pid, (own, _) in servers_after.items() if pid not in servers_before]
        if started:  # the command left a server (its CPU: the imports of one started on its own, a forked one's own)
            seen["server start cpu"] = sum(started)
    # The summary's "first update X s" counts from the federation's start, which run.started announces.
    first = re.search(r"first update ([0-9.]+) s", summary)
    if first is not None and "training" in seen:
        seen["first update"] = seen["training"] + float(first.group(1))
    return seen


def _servers(runtime: Path | None) -> dict[int, tuple[float, float]]:
    """Return the writer servers whose socket is in ``runtime`` (one repeat's), by pid: their own CPU seconds and
    those of the writers they forked and reaped. A server started on its own names the socket in its command line;
    one a writer forked has the writer's, and is known by the socket it listens on."""
    found: dict[int, tuple[float, float]] = {}
    if runtime is None:
        return found
    for process in psutil.process_iter(["cmdline"]):
        command = process.info["cmdline"] or []
        if "flasync.tracking._child" not in command:
            continue
        with contextlib.suppress(psutil.Error):
            if "--server" in command:
                ours = any(str(runtime) in part for part in command)
            else:
                ours = any(str(c.laddr).startswith(f"{runtime}/") for c in process.net_connections(kind="unix"))
            if ours:
                cpu = process.cpu_times()
                found[process.pid] = (cpu.user + cpu.system, cpu.children_user + cpu.children_system)
    return found


def _settle(runtime: Path, expect_server: bool, timeout_s: float = 60.0) -> None:
    """Wait until the writer servers of ``runtime`` have reaped their writers and, with ``expect_server``, one
    listens there (a command that tracked a run starts one as it ends): what a user's next command finds after a
    pause, measured apart from the command before."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = False
        for pid in _servers(runtime):
            with contextlib.suppress(psutil.Error):
                busy = busy or bool(psutil.Process(pid).children())
        if not busy and (not expect_server or any(listens(path) for path in runtime.glob("*.sock"))):
            return
        time.sleep(0.05)


def _stop_servers(runtime: Path) -> None:
    """End the writer servers of ``runtime`` (one repeat's: the next starts with none)."""
    for pid in _servers(runtime):
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            process.terminate()
            process.wait(30)


def _children_cpu_s() -> float:
    """Return the CPU seconds (user and system) of this process's reaped children and their reaped descendants."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


WITHOUT_SERVER = "this, no writer server"
"""With ``--without-server``: this tree again, its tracked runs' writers each a process of its own."""
KINDS = ("first store", "new store", "existing store", "--no-tracking")
FOLDERS = {"first store": "first", "new store": "second", "existing store": "second", "--no-tracking": "second"}
Runs = dict[str, list[dict[str, float]]]
NAN = float("nan")


def order(names: list[str], repeat: int) -> list[str]:
    """Return ``names`` rotated by ``repeat``: each tree goes first in turn, so that a drift of the machine within a
    repeat (what the runs before leave running or cached) falls on each alike."""
    shift = repeat % len(names)
    return names[shift:] + names[:shift]


def kinds_in_turn(repeat: int) -> list[str]:
    """Return the kinds of run in the order repeat ``repeat`` runs them: the tracked ones in :data:`KINDS`' order
    (each needs what the one before kept), the untracked one moved to another place each repeat (after all of them
    in the first), so that what a run leaves behind for the next one falls on every kind in turn."""
    tracked = [kind for kind in KINDS if kind != "--no-tracking"]
    place = (len(tracked) - repeat) % (len(tracked) + 1)
    return [*tracked[:place], "--no-tracking", *tracked[place:]]


def medians(runs: Runs) -> dict[str, dict[str, float]]:
    """Return the median seconds to each mark, per kind of run."""
    marks = [*MARKS, "first update", "exit", "cpu", "server start cpu"]
    found: dict[str, dict[str, float]] = {}
    for kind in KINDS:
        found[kind] = {}
        for mark in marks:
            values = [r[mark] for r in runs[kind] if mark in r]
            if values:
                found[kind][mark] = statistics.median(values)
    return found


def adds(med: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Return what tracking adds to each stretch of the run (medians against the untracked run's), per tracked kind."""
    u = med["--no-tracking"]
    nan = float("nan")
    out = {}
    for kind in KINDS[:3]:
        k = med[kind]
        out[kind] = {
            "before_training_s": k["training"] - u["training"],
            "mlflow_start_to_training_s": k["training"] - k.get("mlflow start", nan),
            "run_opened_after_training_s": k.get("run opened", nan) - k["training"],
            "training_s": (k["last eval"] - k["training"]) - (u["last eval"] - u["training"]),
            "after_training_s": (k["exit"] - k["last eval"]) - (u["exit"] - u["last eval"]),
            "in_all_s": k["exit"] - u["exit"],
            "cpu_s": k.get("cpu", nan) - u.get("cpu", nan),
            "server_start_cpu_s": k.get("server start cpu", nan),
        }
    return out


def print_tree(name: str, med: dict[str, dict[str, float]], added: dict[str, dict[str, float]], repeats: int) -> None:
    """Print one tree's table of medians and what tracking adds."""
    print(f"\n{name}: seconds from the command's start (median of {repeats}; the default run)")
    print(f"| mark | {' | '.join(KINDS)} |")
    print(f"|---|{'---|' * len(KINDS)}")
    marks = list(MARKS)
    marks.insert(marks.index("run opened"), "first update")
    for mark in (*marks, "exit", "cpu", "server start cpu"):
        print(f"| {mark} | {' | '.join(f'{med[kind].get(mark, NAN):.2f}' for kind in KINDS)} |")
    for kind, a in added.items():
        print(f"what tracking adds ({kind}):")
        print(
            f"  before training   {a['before_training_s']:+.2f} s (from starting the MLflow run to training: "
            f"{a['mlflow_start_to_training_s']:.2f} s)"
        )
        opened = a["run_opened_after_training_s"]
        print(f"                    (the MLflow run exists {opened:+.2f} s after training started)")
        print(f"  training          {a['training_s']:+.2f} s")
        print(f"  after training    {a['after_training_s']:+.2f} s (artifacts, plots, model, closing the run)")
        print(f"  in all            {a['in_all_s']:+.2f} s")
        print(f"  CPU               {a['cpu_s']:+.2f} s (all the command's processes, its MLflow writer's too)")
        if not math.isnan(a["server_start_cpu_s"]):  # the command left a server
            started = a["server_start_cpu_s"]
            print(f"  server on its own {started:.2f} s CPU (the writer server the command left)")


def main() -> None:
    """Run the repeats, print the medians and store them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--no-system-metrics", action="store_true", help="tracked runs without MLflow's system monitor (default: on)"
    )
    parser.add_argument("--baseline", type=Path, help="another flasync checkout to run the same way, interleaved")
    parser.add_argument(
        "--without-server",
        action="store_true",
        help="also this tree with FLASYNC_WRITER_SERVER=0 (every writer a process of its own), interleaved",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "startup.json", help="results")
    args = parser.parse_args()
    trees = {"this": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    if args.without_server:
        trees[WITHOUT_SERVER] = ROOT
    envs = {name: {"FLASYNC_WRITER_SERVER": "0"} if name == WITHOUT_SERVER else {} for name in trees}
    described = machine()
    print(f"{described['cpu']}, {described['cpus']} CPUs, load {described['load_average_1m']}, {described['commit']}")
    runs: dict[str, Runs] = {name: {kind: [] for kind in KINDS} for name in trees}
    for repeat in range(args.repeats):
        for name in order(list(trees), repeat):
            tree = trees[name]
            # Each tree and repeat has a folder and a cache of its own: its first kind never finds a kept schema or
            # model export, the kinds after it find what the first kept.
            # A folder of its own for the writer server's socket, too: the first kind never finds one, and the
            # server the first tracked command starts is ended with the repeat.
            with tempfile.TemporaryDirectory(prefix="flasync-startup-") as tmp:
                runtime = Path(tmp, "run")
                runtime.mkdir(mode=0o700)
                try:
                    for kind in kinds_in_turn(repeat):
                        where = Path(tmp, FOLDERS[kind])
                        tracked = kind != "--no-tracking"
                        figures = one(
                            where, tracked, not args.no_system_metrics, Path(tmp, "cache"), tree, runtime, envs[name]
                        )
                        runs[name][kind].append(figures)
                finally:
                    _stop_servers(runtime)
    trees_figures: dict[str, object] = {}
    headline: list[Figure] = []
    for name, tree in trees.items():
        med = medians(runs[name])
        added = adds(med)
        print_tree(f"{name} ({tree})", med, added, args.repeats)
        trees_figures[name] = {"path": str(tree), "runs": runs[name], "medians": med, "adds": added}
        untracked = med["--no-tracking"].get("exit", NAN)
        for kind in KINDS[:-1]:
            exit_s = med[kind].get("exit", NAN)
            headline.append(
                Figure(f"{name}: the default run, {kind}", exit_s, "s", "--no-tracking", exit_s / untracked)
            )
    for other in ("baseline", WITHOUT_SERVER):
        if other not in trees:
            continue
        against = "the baseline" if other == "baseline" else "no writer server"
        for figure in ("exit", "cpu"):
            for kind in KINDS:
                this, base = (medians(runs[name])[kind].get(figure, NAN) for name in ("this", other))
                label = f"this tree against {against}, {kind}" + (", CPU" if figure == "cpu" else "")
                headline.append(Figure(label, this, "s", other, this / base))
    store(
        "startup",
        described,
        settings={
            "repeats": args.repeats,
            "system_metrics": not args.no_system_metrics,
            "without_server": args.without_server,
        },
        headline=headline,
        figures={"load_average_1m_at_end": round(os.getloadavg()[0], 2), "trees": trees_figures},
        out=args.out,
    )


if __name__ == "__main__":
    main()
