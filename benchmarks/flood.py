"""The status endpoint's latency while one address floods a served run with requests it refuses.

A real ``python -m flasync serve`` (FedBuff on digits, remote clients enabled, none of them training, tracking to a
temporary SQLite store) is started on a free port of 127.0.0.1. Then, phase by phase:

* *baseline*: only the probers;
* *unauthenticated*: ``--concurrency`` httpx clients in one separate process, all from 127.0.0.1, send requests
  without a token or with a wrong one (``GET /v1/task``, ``GET /v1/hello``) as fast as they are answered;
* *refused*: the same clients send requests with a valid token that the server refuses: an update (a 16 KiB body)
  for a forged task id, a malformed model version, a model version that is not served.

Each flood lasts ``--seconds`` and is followed by a pause in which the flooding address's budget refills (the
seconds until a valid token from 127.0.0.1 is served again are printed). Throughout, two probers in this process,
bound to 127.0.0.2 (Linux routes all of 127.0.0.0/8 to the loopback interface), poll ``GET /v1/status`` every
``--probe-ms``: one over a kept-alive connection, one opening a new connection per request. Printed per phase:
requests sent by the flood and answered by status code, timed out and failed; the probes' p50/p99/max in ms and
their ratio to the baseline's; and the server process's CPU (user + system seconds per wall second, psutil).
The figures, with a description of the machine, go to ``benchmarks/results/flood.json`` (through
``benchmarks/record.py``), headed by each flood phase's p99 status latency against the baseline phase's.

On a 2-core machine the server, the flooding processes and the probers share the cores: a probe's latency includes
the wait for a core, which the baseline measures too. ``--flood-nice 10`` lowers the flooding processes' priority, so
that they take the cores the server and the probers leave, as a flood from another machine would.

    python benchmarks/flood.py [--seconds 10] [--concurrency 64] [--processes 1] [--flood-nice 0] [--profile PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

if __package__:  # imported as benchmarks.flood (by the tests)
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

_HERE = Path(__file__).resolve().parent
_PROBER = "127.0.0.2"
_TIMEOUT_S = 10.0
_UPLOAD = b"\0" * 16384
PHASES = ("unauthenticated", "refused")
_PROFILED = """
import atexit, cProfile, runpy, sys
profile = cProfile.Profile()
atexit.register(lambda: (profile.disable(), profile.dump_stats({path!r})))
sys.argv[0] = "flasync"
profile.enable()
runpy.run_module("flasync", run_name="__main__")
"""


# ------------------------------------------------------------------------------------------------ the server
def _config(folder: Path, clients: int) -> Path:
    """Write the served run's config (and its tokens file); return the config's path."""
    tokens = folder / "tokens.txt"
    tokens.write_text("".join(f"{i} {secrets.token_urlsafe(24)}\n" for i in range(clients)))
    config = {
        "seed": 0,
        "clock": "wall",
        "partition": {"kind": "iid"},
        "model": {"kind": "mlp", "hidden": [32]},
        "population": {"num_clients": clients},
        "client": {"epochs": 1, "batch_size": 16, "lr": 0.1},
        "server": {"kind": "fedbuff", "buffer_size": 2, "concurrency": clients},
        "stop": {"max_versions": 1000, "max_wall_s": 3600.0},
        "eval": {"every_versions": 1000},
        "resilience": {"task_timeout_s": 3600.0},
        "tracking": {"uri": f"sqlite:///{folder / 'mlflow.db'}", "log_model": False, "experiment": "flood"},
        "remote": {"enabled": True, "tokens_file": str(tokens), "poll_s": 5.0},
    }
    path = folder / "flood.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_server(folder: Path, config: Path, port: int, profile: Path | None) -> subprocess.Popen[bytes]:
    """Start ``python -m flasync serve`` (under cProfile when ``profile`` is given)."""
    # The command line ends with os._exit once its atexit handlers ran: the profile is written by one of them.
    runner = ["-c", _PROFILED.format(path=str(profile))] if profile is not None else ["-m", "flasync"]
    command = [sys.executable, *runner, "serve", str(config), "--port", str(port)]
    command += ["--no-system-metrics", "--log-level", "warning"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with (folder / "serve.out").open("wb") as out, (folder / "serve.err").open("wb") as err:
        return subprocess.Popen(command, stdout=out, stderr=err, env=env, cwd=folder)


async def wait_until_served(url: str, server: subprocess.Popen[bytes], deadline_s: float) -> float:
    """Poll the status endpoint until the run is running; return the seconds it took."""
    began = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=2.0) as http:
        while time.perf_counter() - began < deadline_s:
            if server.poll() is not None:
                raise SystemExit(f"the server exited with {server.returncode} before it answered")
            with contextlib.suppress(httpx.TransportError):
                if (await http.get("/v1/status")).json().get("state") == "running":
                    return round(time.perf_counter() - began, 3)
            await asyncio.sleep(0.1)
    raise SystemExit(f"the server did not answer within {deadline_s} s")


def stop_server(server: subprocess.Popen[bytes]) -> int:
    """Ask the server to stop (SIGINT, as Ctrl-C); kill it if it has not exited within 60 s."""
    server.send_signal(signal.SIGINT)
    try:
        return server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        return server.wait()


# ----------------------------------------------------------------------------------------------- the probes
async def _probe(url: str, fresh: bool, every_s: float, stop: asyncio.Event) -> list[float]:
    """GET the status endpoint every ``every_s`` from :data:`_PROBER` until ``stop``; return each latency (s).

    A probe that fails or times out counts as :data:`_TIMEOUT_S`.
    """
    limits = httpx.Limits(max_keepalive_connections=0) if fresh else httpx.Limits()
    transport = httpx.AsyncHTTPTransport(local_address=_PROBER, limits=limits)
    latencies: list[float] = []
    async with httpx.AsyncClient(transport=transport, base_url=url, timeout=_TIMEOUT_S) as http:
        while not stop.is_set():
            began = time.perf_counter()
            try:
                response = await http.get("/v1/status")
                ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append(time.perf_counter() - began if ok else _TIMEOUT_S)
            await asyncio.sleep(every_s)
    return latencies


def quantiles_ms(latencies: list[float]) -> dict[str, float]:
    """Return the count, p50, p99 and maximum of latencies in seconds, in ms."""
    ordered = sorted(latencies)
    if not ordered:
        return {"n": 0}

    def at(q: float) -> float:
        return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {"n": len(ordered), "p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": round(1000 * ordered[-1], 3)}


# ------------------------------------------------------------------------------------------------ the flood
def _flood_request(phase: str, token: str, index: int) -> tuple[str, str, dict[str, str], bytes | None]:
    """Return the ``index``-th request of a phase: method, path, headers, body."""
    if phase == "unauthenticated":
        if index % 2:
            return "GET", "/v1/hello", {"authorization": "Bearer " + "x" * 32}, None
        return "GET", "/v1/task?wait_s=0", {}, None
    auth = {"authorization": f"Bearer {token}"}
    kind = index % 3
    if kind == 0:  # an update for a task that is not the client's
        headers = {**auth, "content-type": "application/octet-stream", "x-flasync-report": '{"num_samples": 1}'}
        return "POST", f"/v1/tasks/{900000 + index}/update", headers, _UPLOAD
    if kind == 1:
        return "GET", "/v1/models/not-a-version", auth, None
    return "GET", f"/v1/models/{10**9 + index}", auth, None


async def _flood(url: str, phase: str, token: str, concurrency: int, seconds: float) -> dict[str, Any]:
    """Send the phase's requests from ``concurrency`` clients for ``seconds``; return the counts."""
    codes: Counter[str] = Counter()
    sent = [0]
    deadline = time.perf_counter() + seconds

    async def one(worker: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=_TIMEOUT_S) as http:
            index = worker
            while time.perf_counter() < deadline:
                method, path, headers, body = _flood_request(phase, token, index)
                index += concurrency
                sent[0] += 1
                try:
                    response = await http.request(method, path, headers=headers, content=body)
                except httpx.TimeoutException:
                    codes["timed_out"] += 1
                    continue
                except httpx.TransportError as exc:
                    codes[f"error:{type(exc).__name__}"] += 1
                    continue
                codes[str(response.status_code)] += 1
                if response.status_code == 429 and "retry-after" not in response.headers:
                    codes["429_without_retry_after"] += 1

    began = time.perf_counter()
    await asyncio.gather(*(one(worker) for worker in range(concurrency)))
    return {"sent": sent[0], "seconds": time.perf_counter() - began, "answers": dict(sorted(codes.items()))}


def _worker(url: str, phase: str, token: str, concurrency: int, seconds: float) -> None:
    """The flooding process: wait for a line on stdin, flood, print the counts as JSON."""
    print("ready", flush=True)
    sys.stdin.readline()
    print(json.dumps(asyncio.run(_flood(url, phase, token, concurrency, seconds))), flush=True)


async def _served_again_s(url: str, token: str, deadline_s: float) -> float | None:
    """Return the seconds until a valid token from 127.0.0.1 is answered 200 again (None: not within the deadline)."""
    began = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=_TIMEOUT_S) as http:
        while time.perf_counter() - began < deadline_s:
            response = await http.get("/v1/hello", headers={"authorization": f"Bearer {token}"})
            if response.status_code == 200:
                return round(time.perf_counter() - began, 3)
            await asyncio.sleep(0.1)
    return None


# ---------------------------------------------------------------------------------------------- the phases
async def _phase(url: str, phase: str, token: str, args: argparse.Namespace, server: psutil.Process) -> dict[str, Any]:
    """Run one phase (the flood in a separate process, none for the baseline) under the probers."""
    flooders = []
    if phase != "baseline":
        command = [sys.executable, __file__, "--worker", url, phase, token, str(args.concurrency), str(args.seconds)]
        for _ in range(args.processes):
            flooder = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                preexec_fn=lambda: os.nice(args.flood_nice),
            )
            assert flooder.stdout is not None
            await flooder.stdout.readline()  # "ready": httpx imported
            flooders.append(flooder)
    stop = asyncio.Event()
    probes = [asyncio.create_task(_probe(url, fresh, args.probe_ms / 1000, stop)) for fresh in (False, True)]
    cpu_before, began = server.cpu_times(), time.perf_counter()
    for flooder in flooders:
        assert flooder.stdin is not None
        flooder.stdin.write(b"go\n")
        await flooder.stdin.drain()
    counts = [json.loads((await flooder.communicate())[0]) for flooder in flooders]
    if not flooders:
        await asyncio.sleep(args.seconds)
    cpu_after, wall_s = server.cpu_times(), time.perf_counter() - began
    stop.set()
    kept_alive, fresh = await asyncio.gather(*probes)
    cpu_s = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
    figures: dict[str, Any] = {
        "wall_s": round(wall_s, 3),
        "server_cpu": round(cpu_s / wall_s, 3),
        "status_kept_alive": quantiles_ms(kept_alive),
        "status_new_connection": quantiles_ms(fresh),
    }
    if counts:
        answers: Counter[str] = Counter()
        for count in counts:
            answers.update(count["answers"])
        figures["flood"] = {
            "processes": len(counts),
            "sent": sum(count["sent"] for count in counts),
            "seconds": max(count["seconds"] for count in counts),
            "answers": dict(sorted(answers.items())),
        }
        figures["served_again_s"] = await _served_again_s(url, token, 30.0)
    return figures


async def _run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    config = _config(folder, clients=4)
    token = (folder / "tokens.txt").read_text().split()[1]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(folder, config, port, args.profile)
    try:
        ready_s = await wait_until_served(url, server, 120.0)
        print(f"server pid {server.pid} running after {ready_s:.1f} s on {url}", flush=True)
        # A device online from the start (a task in flight): the server waits for messages, as in a run with clients.
        await _served_again_s(url, token, 30.0)
        phases = {}
        for phase in ("baseline", *PHASES):
            phases[phase] = await _phase(url, phase, token, args, psutil.Process(server.pid))
            _print_phase(phase, phases[phase], phases["baseline"])
    finally:
        code = stop_server(server)
    printed = [line.strip() for line in (folder / "serve.out").read_text().splitlines() if "requests refused" in line]
    return {
        "phases": phases,
        "server_exit": code,
        "server_remote_line": printed[-1] if printed else None,
        "refusal_metrics": _refusal_metrics(folder / "mlflow.db"),
    }


def _refusal_metrics(store: Path) -> dict[str, dict[str, float]]:
    """Return each ``remote/refused/*`` metric of the run's store: its rows and its last value (the count)."""
    with contextlib.closing(sqlite3.connect(store)) as db:
        rows = db.execute(
            "SELECT key, COUNT(*), MAX(value) FROM metrics WHERE key LIKE 'remote/refused/%' GROUP BY key"
        ).fetchall()
    return {key: {"rows": count, "count": value} for key, count, value in rows}


def _print_phase(phase: str, figures: dict[str, Any], baseline: dict[str, Any]) -> None:
    print(f"\n{phase}: {figures['wall_s']:.1f} s, server CPU {figures['server_cpu']:.2f} s/s")
    flood = figures.get("flood")
    if flood is not None:
        rate = flood["sent"] / flood["seconds"]
        answers = ", ".join(f"{code} {count}" for code, count in flood["answers"].items())
        print(f"  flood: {flood['sent']} requests ({rate:.0f}/s) from 127.0.0.1; answered: {answers}")
        print(f"  a valid token from 127.0.0.1 served again after {figures['served_again_s']} s")
    for series in ("status_kept_alive", "status_new_connection"):
        q, base = figures[series], baseline[series]
        ratio = q["p99_ms"] / base["p99_ms"] if base.get("p99_ms") else float("nan")
        print(
            f"  {series:<22} n {q['n']:>5}  p50 {q['p50_ms']:7.2f} ms  p99 {q['p99_ms']:7.2f} ms  "
            f"max {q['max_ms']:8.2f} ms  (p99 / baseline p99: {ratio:.2f})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds of each phase")
    parser.add_argument("--concurrency", type=int, default=64, help="concurrent flooding clients")
    parser.add_argument("--processes", type=int, default=1, help="flooding processes (each --concurrency clients)")
    parser.add_argument(
        "--flood-nice", type=int, default=0, help="niceness of the flooding processes (10: as if they ran elsewhere)"
    )
    parser.add_argument("--probe-ms", type=float, default=5.0, help="pause between two probes of one prober")
    parser.add_argument("--profile", type=Path, help="run the server under cProfile, writing this file")
    parser.add_argument("--out", type=Path, default=_HERE / "results" / "flood.json", help="results JSON")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        url, phase, token, concurrency, seconds = args.worker
        _worker(url, phase, token, int(concurrency), float(seconds))
        return
    if args.profile is not None:
        args.profile = args.profile.resolve()
    described = machine()
    print(f"{described['cpu']}, {described['cpus']} CPUs, load {described['load_average_1m']}, {described['commit']}")
    print(
        f"phases of {args.seconds} s; flood: {args.processes} process(es) of {args.concurrency} clients, nice "
        f"{args.flood_nice}; status probed every {args.probe_ms} ms from {_PROBER}"
    )
    with tempfile.TemporaryDirectory(prefix="flood-") as folder:
        figures = asyncio.run(_run(args, Path(folder)))
    print(f"\nserver exit {figures['server_exit']}; its summary: {figures['server_remote_line']}")
    print("refusals in the run's store (rows, last value):")
    for key, metric in figures["refusal_metrics"].items():
        print(f"  {key:<32} {metric['rows']:>3} rows, {metric['count']:.0f}")
    store(
        "flood",
        described,
        settings={
            "seconds": args.seconds,
            "concurrency": args.concurrency,
            "processes": args.processes,
            "flood_nice": args.flood_nice,
            "probe_ms": args.probe_ms,
        },
        headline=_headline(figures["phases"]),
        figures=figures,
        out=args.out,
    )


def _headline(phases: dict[str, dict[str, Any]]) -> list[Figure]:
    """Return each flood phase's p99 status latency (kept-alive and new connections) against the baseline phase's."""
    rows: list[Figure] = []
    for phase, figures in phases.items():
        if phase == "baseline":
            continue
        for series in ("status_kept_alive", "status_new_connection"):
            value, base = figures[series].get("p99_ms"), phases["baseline"][series].get("p99_ms")
            if value is not None:
                ratio = value / base if base else None
                rows.append(Figure(f"{phase} flood: {series} p99", value, "ms", "no flood", ratio))
    return rows


if __name__ == "__main__":
    main()
