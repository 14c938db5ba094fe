"""Remote clients over loopback HTTP against the in-process simulation of the same config, in the same run.

The workload: digits, MLP 64-32-10, FedBuff (K = clients / 2, every client busy), 2 local epochs of batch 16, the
wall clock, tracking off, evaluation only at the end. For each number of clients (5, 20, 50 by default):

* *simulated*: ``await Federation(config).run()``, clients as coroutines in the server's process;
* *remote*: the same config with ``remote.enabled``, served by ``flasync.runtime.serve.serve`` under uvicorn on
127.0.0.1
  (a real TCP socket, HTTP/1.1) in this process, and the clients as ``flasync.clients.remote.client.Client`` coroutines
  in one
  *separate* process (this script with ``--clients-of``; it imports torch before the run starts), sharing one httpx
  connection pool (a connection per client), each training on its partition of digits.

Printed per row: updates per second (accepted updates / the federation's wall seconds), the median and 95th
percentile of the per-update latency (wall seconds from the server's ``TaskAssigned`` to its ``UpdateReceived`` of
the same task: download, training, encoding and upload) over each client's tasks after its first, the ratios
remote / simulated, and the median latency of the remote clients' first tasks (on which each loads its data).
Then the bytes on the wire: every HTTP body the clients sent and received (model downloads, uploads, the JSON of
hello, task offers and answers; headers not counted), against the payloads in them (the encoded models the clients
downloaded and the updates they uploaded), and the run's own accounting (``download_bytes + upload_bytes``: a model
download per task, where a remote client reuses a version's model it already holds).

    python benchmarks/remote.py [--clients 5 20 50] [--versions 30] [--repeats 1]

Every row goes to ``benchmarks/results/remote.json`` (``--out``; see ``benchmarks/record.py``), headed by the remote
run's rate and median latency against the simulated run's of the same clients.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

if __package__:  # imported as benchmarks.remote
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

from flasync.clients.remote.client import Client
from flasync.core.events import TaskAssigned, UpdateReceived
from flasync.observe.summary import RunSummary
from flasync.runtime.federation import Federation
from flasync.runtime.serve import serve


def config(clients: int, versions: int, tokens: Path | None) -> dict[str, Any]:
    """Return the benchmark's config (remote when ``tokens`` is given)."""
    data: dict[str, Any] = {
        "seed": 0,
        "clock": "wall",
        "partition": {"kind": "iid"},
        "model": {"kind": "mlp", "hidden": [32]},
        "population": {"num_clients": clients},
        "client": {"epochs": 2, "batch_size": 16, "lr": 0.1},
        "server": {"kind": "fedbuff", "buffer_size": max(2, clients // 2), "concurrency": clients},
        "stop": {"max_versions": versions},
        "eval": {"every_versions": versions},
        "resilience": {"task_timeout_s": 60.0},
        "tracking": {"enabled": False, "log_level": "warning"},
    }
    if tokens is not None:
        data["remote"] = {"enabled": True, "tokens_file": str(tokens), "poll_s": 5.0, "max_waiting": 4 * clients}
    return data


async def latencies(federation: Federation) -> tuple[list[float], list[float]]:
    """Collect the wall seconds from each task's assignment to the receipt of its update, until the bus closes.

    Returns:
        The latencies of each client's first task (a remote client loads its data then) and of the others.
    """
    assigned: dict[int, tuple[float, int]] = {}
    first: list[float] = []
    later: list[float] = []
    seen: set[int] = set()
    tasks = federation.bus.subscribe(TaskAssigned, policy="block")
    updates = federation.bus.subscribe(UpdateReceived, policy="block")

    async def on_tasks() -> None:
        async for event in tasks:
            assigned[event.task_id] = (time.perf_counter(), int(event.client_id))

    async def on_updates() -> None:
        async for event in updates:
            start = assigned.pop(event.task_id, None)
            if start is not None:
                (later if start[1] in seen else first).append(time.perf_counter() - start[0])
                seen.add(start[1])

    await asyncio.gather(on_tasks(), on_updates())
    return first, later


async def simulated(clients: int, versions: int) -> tuple[RunSummary, tuple[list[float], list[float]]]:
    """Run the in-process simulation; return its summary and latencies."""
    federation = Federation(config(clients, versions, None))
    watch = asyncio.create_task(latencies(federation))
    summary = await federation.run()
    return summary, await watch


async def remote(
    clients: int, versions: int, folder: Path
) -> tuple[RunSummary, tuple[list[float], list[float]], dict[str, int]]:
    """Serve the run on loopback to a process of ``clients`` remote clients; return summary, latencies, body bytes."""
    tokens = folder / f"tokens-{clients}.txt"
    tokens.write_text("".join(f"{i} {secrets.token_urlsafe(24)}\n" for i in range(clients)))
    federation = Federation(config(clients, versions, tokens))
    watch = asyncio.create_task(latencies(federation))
    out = folder / f"bytes-{clients}.json"
    # The client process imports torch before the run starts (seconds that are not the protocol's), then waits.
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--clients-of",
        str(tokens),
        str(out),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert process.stdin is not None and process.stdout is not None
    await process.stdout.readline()  # "ready"

    def go(port: int) -> None:
        assert process.stdin is not None
        process.stdin.write(f"http://127.0.0.1:{port}\n".encode())

    summary = await serve(federation, port=0, on_ready=go, linger_s=1.0)
    await process.wait()
    return summary, await watch, json.loads(out.read_text())


async def client_process(lines: list[list[str]], out: Path) -> None:
    """Run one remote client per ``(client_id, token)`` line once the server's URL comes on stdin; count bodies."""
    counted = {"request_bodies": 0, "response_bodies": 0}

    async def on_request(request: httpx.Request) -> None:
        counted["request_bodies"] += len(request.content)

    async def on_response(response: httpx.Response) -> None:
        await response.aread()
        counted["response_bodies"] += len(response.content)

    print("ready", flush=True)
    url = (await asyncio.to_thread(sys.stdin.readline)).strip()
    hooks: Any = {"request": [on_request], "response": [on_response]}
    limits = httpx.Limits(max_connections=len(lines) * 2)
    async with httpx.AsyncClient(timeout=120.0, event_hooks=hooks, limits=limits) as http:
        runs = [Client(url, token, http=http, poll_s=5.0, backoff_s=0.05).run() for _, token in lines]
        stats = await asyncio.gather(*runs)
    counted["payload_download"] = sum(s.download_bytes for s in stats)
    counted["payload_upload"] = sum(s.upload_bytes for s in stats)
    await asyncio.to_thread(out.write_text, json.dumps(counted))


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else (values[0] if values else 0.0)


async def main(args: argparse.Namespace) -> None:
    """Run every client count and print the tables."""
    torch_threads = os.environ.get("OMP_NUM_THREADS", "default")
    print(f"flasync remote benchmark: {args.versions} versions, loopback HTTP, OMP_NUM_THREADS={torch_threads}")
    described = machine()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for clients in args.clients:
            for _ in range(args.repeats):
                sim, sim_lat = await simulated(clients, args.versions)
                rem, rem_lat, wire = await remote(clients, args.versions, Path(tmp))
                rows.append((clients, sim, sim_lat, rem, rem_lat, wire))
    header = (
        f"{'clients':>7} {'sim upd/s':>10} {'remote upd/s':>12} {'ratio':>6} | {'sim p50 ms':>10} {'remote p50 ms':>13}"
        f" {'ratio':>6} | {'sim p95 ms':>10} {'remote p95 ms':>13} {'ratio':>6} | {'remote 1st task ms':>18}"
    )
    print(
        "latency: each client's tasks after its first; the first task's median apart (a remote client loads its data)"
    )
    print(header)
    for clients, sim, (_, sim_lat), rem, (rem_first, rem_lat), _ in rows:
        s50, r50 = 1000 * statistics.median(sim_lat), 1000 * statistics.median(rem_lat)
        s95, r95 = 1000 * _pct(sim_lat, 95), 1000 * _pct(rem_lat, 95)
        rate = rem.updates_per_s / sim.updates_per_s
        print(
            f"{clients:>7} {sim.updates_per_s:>10.1f} {rem.updates_per_s:>12.1f} {rate:>6.2f}"
            f" | {s50:>10.1f} {r50:>13.1f} {r50 / s50:>6.2f} | {s95:>10.1f} {r95:>13.1f} {r95 / s95:>6.2f}"
            f" | {1000 * statistics.median(rem_first):>18.0f}"
        )
    print()
    print("bytes: HTTP bodies against the payloads in them (encoded models and updates) and the run's accounting")
    print(
        f"{'clients':>7} {'HTTP bodies':>12} {'payloads':>11} {'ratio':>6} | {'down bodies':>11} {'models':>10}"
        f" | {'up bodies':>10} {'updates':>10} | {'run accounts':>12}"
    )
    for clients, _, _, rem, _, wire in rows:
        bodies = wire["request_bodies"] + wire["response_bodies"]
        payload = wire["payload_download"] + wire["payload_upload"]
        accounted = rem.download_bytes + rem.upload_bytes
        print(
            f"{clients:>7} {bodies:>12,} {payload:>11,} {bodies / payload:>6.3f} |"
            f" {wire['response_bodies']:>11,} {wire['payload_download']:>10,} |"
            f" {wire['request_bodies']:>10,} {wire['payload_upload']:>10,} | {accounted:>12,}"
        )
    _store(args, rows, described)


def _store(args: argparse.Namespace, rows: list[Any], described: dict[str, Any]) -> None:
    """Store every row: rates, latencies and bytes; the headline compares remote with simulated per client count."""
    headline: list[Figure] = []
    figures: list[dict[str, Any]] = []
    for clients, sim, (_, sim_lat), rem, (rem_first, rem_lat), wire in rows:
        rate = rem.updates_per_s / sim.updates_per_s
        p50 = statistics.median(rem_lat) / statistics.median(sim_lat)
        headline.append(
            Figure(f"{clients} clients, remote: updates/s", rem.updates_per_s, "updates/s", "simulated", rate)
        )
        headline.append(
            Figure(f"{clients} clients, remote: p50 latency", statistics.median(rem_lat), "s", "simulated", p50)
        )
        figures.append(
            {
                "clients": clients,
                "simulated_updates_per_s": sim.updates_per_s,
                "remote_updates_per_s": rem.updates_per_s,
                "simulated_latency_s": sim_lat,
                "remote_latency_s": rem_lat,
                "remote_first_task_s": rem_first,
                "wire": wire,
                "accounted_bytes": rem.download_bytes + rem.upload_bytes,
            }
        )
    settings = {"clients": args.clients, "versions": args.versions, "repeats": args.repeats}
    store("remote", described, settings=settings, headline=headline, figures={"rows": figures}, out=args.out)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--clients-of":
        tokens = [line.split() for line in Path(sys.argv[2]).read_text().splitlines() if line.strip()]
        asyncio.run(client_process(tokens, Path(sys.argv[3])))
        raise SystemExit(0)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[5, 20, 50])
    parser.add_argument("--versions", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="result file (default: benchmarks/results/)")
    asyncio.run(main(parser.parse_args()))
