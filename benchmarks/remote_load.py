"""A served run's own capacity: many simulated devices replaying one precomputed update against ``flasync serve``.

A real ``python -m flasync serve`` (FedBuff, K = 10, on digits with the default model, every device busy:
``server.concurrency`` = devices; the wall clock; tracking to a temporary SQLite store; a large ``stop.max_versions``
and a ``stop.max_wall_s`` bounding the run) is started on a free port of 127.0.0.1, one token per device. The devices
are coroutines in ``--processes`` load processes (this script with ``--worker``), each with its own keep-alive
connection (``--client wire``: :mod:`wire`, a lean HTTP/1.1 client, so that the load processes leave the cores to the
server; ``--client httpx``: an ``httpx.AsyncClient`` per device, as flasync's client); none trains. A load process
encodes one valid update of the served model's size ahead, with the server's upload codec, as a real client would
send it, and every device re-sends those bytes for each task it is offered, with what must match the task (its id in
the path, its incarnation in ``X-Flasync-Incarnation``). So the server is what is measured: the HTTP exchanges,
decoding, intake, aggregation and tracking of each update.

For each number of devices (``--devices``, 100 and 1,000 by default), on a fresh server:

* *connect*: every device says hello and asks for a task (``GET /v1/task``, long-polling) until it is offered one;
  the seconds from its hello to its offer are the time a device connecting to a running server waits for its first
  task. The server's RSS with no device and with all of them connected (each holding a task) gives its memory per
  connected device.
* *load*: for ``--seconds``, each device takes its task with the model of its version inline (``--offer inline``:
  ``GET /v1/task?model=inline&have=V``, nothing when it holds that version; a server without it answers the offer
  alone and the device downloads the model, ``GET /v1/models/V``, as with ``--offer separate``), waits as if it
  trained (``--train-s``, the mean, each task's time drawn from the device's own seeded stream within
  ``--train-spread`` of it, its first task what remains of one under way, so the devices are out of phase from
  the start: :class:`Pace`; 0: not at all, the server saturated: each request then waits behind every other
  device's), uploads the update and asks for its next task: in the upload's answer (``--offer next``, the default:
  ``POST /v1/tasks/{id}/update?next=inline&have=V``, one request an update when the server carries the next task; a
  server without it answers as before and the device long-polls), else ``GET /v1/task``. Printed: updates accepted
  per second (those accepted within the load's seconds; uploads under way then are finished and counted in the
  accounting), the load the devices offer (devices / mean training time), requests sent per accepted update,
  upload answers that carried the next task, p50/p99 of each endpoint (offer: the long-poll until the next task,
  with its model when inline, the connecting devices' first ones included; model download; upload), the server's
  CPU (user + system, psutil) per accepted update, its event loop thread's CPU over the wall time (near 1: the
  loop is saturated and requests queue), the load processes' CPU, and the accounting of every update sent:
  accepted (202) + refused (any other answer) + timed out or failed = sent, beside the server's own counters (its
  summary's remote line: updates received, requests refused by reason).

``--baseline DIR`` measures the server of another flasync checkout too (a git worktree of an earlier commit; the
load processes stay this script's), before this one at each step, ``--repeat`` times: the headline is each figure's
mean over the repeats with its ratio to the baseline's. On a 2-core machine the load processes share the cores with
the server, so updates per second is a lower bound of the server's capacity; its CPU seconds per update is the figure
that depends least on them (1 / that: the updates a second one core could take, the server's event loop being one
thread). ``--profile PATH`` runs the server under cProfile counting its event loop thread's CPU seconds during the
load only, and prints them per update by area (HTTP, Starlette, the endpoints, the transport, decoding, intake,
aggregation, logging and tracking, asyncio) and its top functions. The figures, with a description of the machine,
go to ``benchmarks/results/remote_load.json`` (``benchmarks/record.py``).

    python benchmarks/remote_load.py [--devices 100 1000] [--seconds 20] [--processes 2]
        [--train-s S [--train-spread F] [--seed N]] [--baseline DIR --repeat N] [--profile PATH] [--out JSON]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import pstats
import random
import re
import secrets
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import torch
import uvloop
import yaml

if __package__:  # imported as benchmarks.remote_load (by the tests)
    from benchmarks.flood import free_port, quantiles_ms, start_server, stop_server, wait_until_served
    from benchmarks.record import Figure, describe, machine, store
    from benchmarks.wire import Answer, Connection, WireError
else:
    from flood import free_port, quantiles_ms, start_server, stop_server, wait_until_served
    from record import Figure, describe, machine, store
    from wire import Answer, Connection, WireError

from flasync.codecs.build import pipeline
from flasync.config import validate

_HERE = Path(__file__).resolve().parent
_TIMEOUT_S = 30.0
_POLL_S = 10.0
ENDPOINTS = ("offer", "model", "upload")
WARMUP_S = 3.0  # the load's first seconds, left out of the steady state's upload latency
OFFER_HEADER = "x-flasync-offer"  # flasync.runtime.serve.OFFER_HEADER
Http = httpx.AsyncClient | Connection
_REPORT = json.dumps({"num_samples": 10, "train_loss": 0.5, "train_s": 0.01, "encode_s": 0.0, "download_s": 0.0})


# -------------------------------------------------------------------------------------------- the tally
@dataclass
class Tally:
    """What the devices of one load process sent and got back, per endpoint.

    Attributes:
        sent: Requests sent per endpoint.
        answers: Answers per endpoint and status code (``"202"``, ``"503"``, ...).
        timed_out: Requests that timed out (httpx's timeout) per endpoint.
        failed: Requests that failed otherwise (a connection error) per endpoint.
        latencies: Seconds from sending to the whole answer, per endpoint (answered requests only).
        first_offer_s: Per device, seconds from its hello to its first offer.
        carried: Upload answers that carried the next task (``--offer next``).
        cpu_s: CPU seconds (user + system) the load process spent during the load.
        in_window: Uploads accepted within the load's ``seconds`` (those finished after it are in ``answers``).
        upload_sent_s: For each upload latency (in order), when it was sent: seconds since the load started.
    """

    sent: Counter[str] = field(default_factory=Counter)
    answers: dict[str, Counter[str]] = field(default_factory=lambda: {e: Counter() for e in ENDPOINTS})
    timed_out: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    latencies: dict[str, list[float]] = field(default_factory=lambda: {e: [] for e in ENDPOINTS})
    first_offer_s: list[float] = field(default_factory=list)
    carried: int = 0
    cpu_s: float = 0.0
    in_window: int = 0
    upload_sent_s: list[float] = field(default_factory=list)

    def updates(self) -> dict[str, int]:
        """Return the accounting of updates: sent, accepted (202), refused (other answers), timed out, failed."""
        answers = self.answers["upload"]
        accepted = answers["202"]
        return {
            "sent": self.sent["upload"],
            "accepted": accepted,
            "refused": sum(answers.values()) - accepted,
            "timed_out": self.timed_out["upload"],
            "failed": self.failed["upload"],
        }

    def to_json(self) -> dict[str, Any]:
        """Return the tally as a JSON object (latencies rounded to microseconds)."""
        return {
            "sent": dict(self.sent),
            "answers": {e: dict(c) for e, c in self.answers.items()},
            "timed_out": dict(self.timed_out),
            "failed": dict(self.failed),
            "latencies": {e: [round(s, 6) for s in v] for e, v in self.latencies.items()},
            "first_offer_s": [round(s, 6) for s in self.first_offer_s],
            "carried": self.carried,
            "cpu_s": round(self.cpu_s, 3),
            "in_window": self.in_window,
            "upload_sent_s": [round(s, 4) for s in self.upload_sent_s],
        }

    def add(self, data: dict[str, Any]) -> None:
        """Add another process's :meth:`to_json`."""
        self.sent.update(data["sent"])
        self.timed_out.update(data["timed_out"])
        self.failed.update(data["failed"])
        for endpoint in ENDPOINTS:
            self.answers[endpoint].update(data["answers"].get(endpoint, {}))
            self.latencies[endpoint] += data["latencies"].get(endpoint, [])
        self.first_offer_s += data["first_offer_s"]
        self.carried += data.get("carried", 0)
        self.cpu_s += data.get("cpu_s", 0.0)
        self.in_window += data.get("in_window", 0)
        self.upload_sent_s += data.get("upload_sent_s", [])


# ------------------------------------------------------------------------------------------- the devices
def precomputed_update(setup: dict[str, Any]) -> bytes:
    """Encode one update of the served model's size with the server's upload codec, as a client would send it.

    Args:
        setup: The server's answer to ``GET /v1/hello`` (its config and the model's parameter count).
    """
    config = validate(setup["config"])
    delta = 1e-6 * torch.randn(int(setup["num_params"]), generator=torch.Generator().manual_seed(0))
    encoded = pipeline(config.codec.upload).encode(delta, generator=torch.Generator().manual_seed(1))
    return encoded.payload


class Pace:
    """How long one device 'trains' on each task: a seeded draw per task, uniform in ``train_s * (1 - spread)`` ..
    ``train_s * (1 + spread)``.

    Each device has its own stream (seeded by the run's ``seed`` and the device's index), so the devices' training
    times differ from task to task and from one device to another, as devices of different speeds do, and the same
    seed replays the same times. The mean is ``train_s``: ``devices / train_s`` updates per second is the load the
    devices offer once their requests take no time. The devices all connect within the first second, but their
    first task is not a whole one: it lasts what remains of a task under way at a random moment (:meth:`first_s`),
    so the load starts in its steady state, the uploads spread evenly over time, rather than with every device
    uploading in one wave a task's time after connecting.

    Args:
        train_s: Mean seconds of training per task (> 0).
        spread: Half the width of the range, as a fraction of ``train_s`` (0 <= spread <= 1).
        seed: The run's seed.
        index: The device's index among all the devices of the run (over every load process).
    """

    def __init__(self, train_s: float, spread: float, seed: int, index: int) -> None:
        """Seed the device's stream."""
        if train_s <= 0 or not 0 <= spread <= 1:
            raise ValueError(f"a pace needs train_s > 0 and 0 <= spread <= 1, not {train_s}, {spread}")
        self.train_s, self.spread = train_s, spread
        self._rng = random.Random(f"{seed}:{index}")

    def next_s(self) -> float:
        """Return the seconds the device trains on its next task."""
        return self.train_s * (1.0 + self.spread * (2.0 * self._rng.random() - 1.0))

    def first_s(self) -> float:
        """Return the seconds left of a task under way at a random moment of the steady state (the residual time
        of a renewal process: density ``P(task > x) / train_s``, by its inverse distribution function)."""
        low, high, mean = self.train_s * (1 - self.spread), self.train_s * (1 + self.spread), self.train_s
        u = self._rng.random()
        if u * mean < low:  # below the shortest task every moment is equally likely
            return u * mean
        width = high - low
        return high - math.sqrt(max(0.0, width * width - 2.0 * width * (u * mean - low)))


class Device:
    """One simulated device: hello, then offer, model download (once per version) and upload, over and over.

    Args:
        http: The device's own client (one connection: a shared pool of many is scanned on every request).
        token: The device's bearer token.
        update: The encoded update it sends for every task.
        tally: Where its requests are counted.
        offer: How it asks for tasks (see :func:`drive`).
        pace: How long it trains on each task (None: not at all, it answers at once).
    """

    def __init__(
        self,
        http: Http,
        token: str,
        update: bytes,
        tally: Tally,
        offer: str = "next",
        pace: Pace | None = None,
    ) -> None:
        """Keep the settings (nothing is sent yet)."""
        self._http = http
        self._pace = pace
        self._trained = False  # its first task is what remains of one under way (Pace.first_s)
        self._until = math.inf  # the load's end: uploads accepted by then count in the updates per second
        self._began = time.perf_counter()  # the load's start (set by work())
        self._headers = {"authorization": f"Bearer {token}", "x-flasync-session": secrets.token_urlsafe(12)}
        self._update = update
        self._tally = tally
        self._inline = offer in ("inline", "next")
        self._next = offer == "next"
        self._version = -1
        self.ended = False

    async def _send(self, endpoint: str, method: str, path: str, **kwargs: Any) -> Answer | httpx.Response | None:
        """Send one request and count it; None when it timed out or failed."""
        headers = {**self._headers, **kwargs.pop("headers", {})}
        if endpoint in ENDPOINTS:
            self._tally.sent[endpoint] += 1
        began = time.perf_counter()
        try:
            response = await self._http.request(method, path, headers=headers, **kwargs)
        except (httpx.TimeoutException, TimeoutError):
            self._tally.timed_out[endpoint] += 1
            return None
        except (httpx.TransportError, WireError):
            self._tally.failed[endpoint] += 1
            return None
        if endpoint in ENDPOINTS:
            self._tally.answers[endpoint][str(response.status_code)] += 1
            self._tally.latencies[endpoint].append(time.perf_counter() - began)
            if endpoint == "upload":
                self._tally.upload_sent_s.append(began - self._began)
        return response

    async def offer(self, until: float) -> dict[str, Any] | None:
        """Ask for a task until one is offered (None: none by ``until`` on the performance counter, or the end).

        With ``inline``, the offer is asked for with the model of its version in the same answer (unless this
        device holds that version); a server that does not inline answers the offer alone, and :meth:`answer`
        downloads the model.
        """
        while time.perf_counter() < until and not self.ended:
            wait_s = max(0.05, min(_POLL_S, until - time.perf_counter()))  # every poll ends by ``until``
            params: dict[str, Any] = {"wait_s": round(wait_s, 3)}
            if self._inline:
                params |= {"model": "inline", "have": self._version}
            response = await self._send("offer", "GET", "/v1/task", params=params)
            if response is None or response.status_code == 204:
                continue
            if response.status_code == 200:
                inlined = response.headers.get(OFFER_HEADER)
                if inlined is None:
                    offer: dict[str, Any] = response.json()
                    return offer
                offer = json.loads(inlined)
                if response.content:
                    self._version = int(offer["base_version"])
                return offer
            self.ended = response.status_code == 410
            await asyncio.sleep(float(response.headers.get("retry-after", 0.2)))
        return None

    async def connect(self, until: float) -> dict[str, Any] | None:
        """Say hello and wait for the first offer; note the seconds between them (None: no offer by ``until``)."""
        began = time.perf_counter()
        hello = await self._send("hello", "GET", "/v1/hello")
        if hello is None or hello.status_code != 200:
            return None
        offer = await self.offer(until)
        if offer is not None:
            self._tally.first_offer_s.append(time.perf_counter() - began)
        return offer

    async def answer(self, offer: dict[str, Any]) -> dict[str, Any] | None:
        """Download the task's model (unless this device holds that version) and upload the update until answered;
        return the next task when the upload's answer carried it (``--offer next``), else None."""
        version = int(offer["base_version"])
        if version != self._version:
            response = await self._send("model", "GET", f"/v1/models/{version}")
            if response is None or response.status_code != 200:
                return None
            self._version = version
        if self._pace is not None:  # as long as the device trains on this task
            await asyncio.sleep(self._pace.next_s() if self._trained else self._pace.first_s())
            self._trained = True
        headers = {
            "content-type": "application/octet-stream",
            "x-flasync-report": _REPORT,
            "x-flasync-incarnation": str(offer.get("incarnation", "")),
        }
        path = f"/v1/tasks/{int(offer['task_id'])}/update"
        params = {"next": "inline", "have": self._version} if self._next else None
        while True:
            response = await self._send("upload", "POST", path, content=self._update, headers=headers, params=params)
            if response is None or response.status_code not in (429, 503):
                break
            await asyncio.sleep(float(response.headers.get("retry-after", 1.0)))
        if response is not None and response.status_code == 202 and time.perf_counter() <= self._until:
            self._tally.in_window += 1
        carried = response.headers.get(OFFER_HEADER) if response is not None else None
        if carried is None or response is None or response.status_code != 202:
            return None
        self._tally.carried += 1
        following: dict[str, Any] = json.loads(carried)
        if response.content:
            self._version = int(following["base_version"])
        return following

    async def work(self, offer: dict[str, Any] | None, until: float) -> None:
        """Answer tasks until ``until`` on the performance counter (an upload under way is finished)."""
        self._until, self._began = until, time.perf_counter()
        while not self.ended and time.perf_counter() < until:
            if offer is None:
                offer = await self.offer(until)
                continue
            offer = await self.answer(offer)


async def drive(
    url: str,
    tokens: list[str],
    seconds: float,
    connect_s: float,
    connected: Callable[[int], Awaitable[None]] | None = None,
    *,
    client: str = "wire",
    offer: str = "next",
    train_s: float = 0.0,
    spread: float = 0.5,
    seed: int = 0,
    first_index: int = 0,
) -> Tally:
    """Connect one device per token, wait for ``connected`` (told how many have a task), then load for ``seconds``.

    Args:
        url: The served run's base URL.
        tokens: One bearer token per device.
        seconds: How long the devices answer tasks once connected (uploads under way are then finished).
        connect_s: How long the devices wait for their first task (those without one go on asking during the load).
        connected: Awaited once every device has its first task (or ``connect_s`` passed); the load starts when it
            returns.
        client: Each device's HTTP client: ``wire`` (:class:`~wire.Connection`, one keep-alive connection and
            little CPU per request) or ``httpx`` (an ``httpx.AsyncClient`` per device, as flasync's client).
        offer: ``inline``: ask for each offer with its model in the same answer (see :meth:`Device.offer`);
            ``next``: that, and ask each upload's answer for the next task with its model (:meth:`Device.answer`);
            ``separate``: the offer alone, then the model.
        train_s: Mean seconds a device spends between its model and its upload, as if it trained (0: none, every
            device answers at once: the server is saturated and each request's latency is the queue of every
            device before it); each task's is drawn by the device's :class:`Pace`.
        spread: The paces' spread (a fraction of ``train_s``).
        seed: The paces' seed.
        first_index: The index of the first token's device among every load process's (each device's pace is
            seeded by its index).

    Returns:
        What the devices sent and got back.
    """
    tally = Tally()
    async with contextlib.AsyncExitStack() as clients:
        pools: list[Http] = []
        for _ in tokens:
            if client == "httpx":
                tls = ssl.create_default_context()  # unused over http://, but each client would build its own
                pools.append(
                    await clients.enter_async_context(httpx.AsyncClient(base_url=url, timeout=_TIMEOUT_S, verify=tls))
                )
            else:
                connection = Connection(url, _TIMEOUT_S)
                clients.push_async_callback(connection.aclose)
                pools.append(connection)
        update = await asyncio.to_thread(precomputed_update, await _setup(pools[0], tokens[0]))
        devices = [
            Device(http, token, update, tally, offer, Pace(train_s, spread, seed, first_index + i) if train_s else None)
            for i, (http, token) in enumerate(zip(pools, tokens, strict=True))
        ]
        until = time.perf_counter() + connect_s
        offers = await asyncio.gather(*(device.connect(until) for device in devices))
        if connected is not None:
            await connected(sum(offer is not None for offer in offers))
        until, cpu_s = time.perf_counter() + seconds, time.process_time()
        await asyncio.gather(*(device.work(offer, until) for device, offer in zip(devices, offers, strict=True)))
        tally.cpu_s = time.process_time() - cpu_s
    return tally


async def _setup(http: Http, token: str) -> dict[str, Any]:
    """Return the server's answer to ``GET /v1/hello``, asking again while the run has not started (503)."""
    while True:
        response = await http.request("GET", "/v1/hello", headers={"authorization": f"Bearer {token}"})
        if response.status_code != 503:
            if response.status_code != 200:
                raise SystemExit(f"GET /v1/hello answered {response.status_code}")
            setup: dict[str, Any] = response.json()
            return setup
        await asyncio.sleep(0.1)


def _worker(url: str, tokens_file: str, seconds: float, connect_s: float, args: argparse.Namespace) -> None:
    """A load process: drive its devices; say ``connected N``, wait for a line on stdin, load, write the tally
    beside ``tokens_file`` (``.tally.json``)."""

    async def connected(count: int) -> None:
        print(f"connected {count}", flush=True)
        await asyncio.to_thread(sys.stdin.readline)

    tokens = Path(tokens_file).read_text().split()
    load = drive(
        url,
        tokens,
        seconds,
        connect_s,
        connected,
        client=args.client,
        offer=args.offer,
        train_s=args.train_s,
        spread=args.train_spread,
        seed=args.seed,
        first_index=args.first_index,
    )
    tally = uvloop.run(load)
    Path(tokens_file).with_suffix(".tally.json").write_text(json.dumps(tally.to_json()))


# ------------------------------------------------------------------------------------------------ the server
_PROFILED_WINDOW = """
import cProfile, os, runpy, signal, sys, time
profile = cProfile.Profile(time.thread_time)
def dump(*_):  # written whole under another name, then renamed: the file is there once complete
    profile.disable()
    profile.dump_stats({path!r} + ".part")
    os.replace({path!r} + ".part", {path!r})
signal.signal(signal.SIGUSR1, lambda *_: profile.enable())
signal.signal(signal.SIGUSR2, dump)
sys.argv[0] = "flasync"
runpy.run_module("flasync", run_name="__main__")
"""


def _start_server(
    folder: Path, config: Path, port: int, profile: Path | None, checkout: Path | None
) -> subprocess.Popen[bytes]:
    """Start ``python -m flasync serve`` from ``checkout`` (None: the flasync this script imports); with
    ``profile``, under cProfile counting the event loop thread's CPU seconds between SIGUSR1 (enable) and SIGUSR2
    (disable and write ``profile``)."""
    if profile is None and checkout is None:
        return start_server(folder, config, port, None)
    runner = ["-c", _PROFILED_WINDOW.format(path=str(profile))] if profile is not None else ["-m", "flasync"]
    command = [sys.executable, *runner, "serve", str(config)]
    command += ["--port", str(port), "--no-system-metrics", "--log-level", "warning"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    if checkout is not None:
        env["PYTHONPATH"] = str(checkout)
    with (folder / "serve.out").open("wb") as out, (folder / "serve.err").open("wb") as err:
        return subprocess.Popen(command, stdout=out, stderr=err, env=env, cwd=folder)


def _config(folder: Path, devices: int, seconds: float) -> tuple[Path, list[str]]:
    """Write the served run's config and tokens file; return the config's path and the tokens."""
    tokens = [secrets.token_urlsafe(24) for _ in range(devices)]
    (folder / "tokens.txt").write_text("".join(f"{i} {token}\n" for i, token in enumerate(tokens)))
    config = {
        "seed": 0,
        "clock": "wall",
        "partition": {"kind": "iid"},
        "population": {"num_clients": devices},
        "server": {"kind": "fedbuff", "concurrency": devices},
        "stop": {"max_versions": 10**9, "max_wall_s": 300.0 + 4 * seconds},
        "eval": {"every_versions": 10**9},
        "resilience": {"task_timeout_s": 600.0},
        "tracking": {"uri": f"sqlite:///{folder / 'mlflow.db'}", "log_model": False, "experiment": "remote_load"},
        "remote": {"enabled": True, "tokens_file": str(folder / "tokens.txt"), "max_waiting": 2 * devices},
    }
    path = folder / "remote_load.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, tokens


def server_counters(serve_out: str) -> dict[str, Any] | None:
    """Read the server's remote line (updates received, requests refused by reason) from its printed summary."""
    lines = [line for line in serve_out.splitlines() if "updates received" in line and "requests refused" in line]
    if not lines:
        return None
    received = re.search(r"(\d+) updates received", lines[-1])
    reasons = lines[-1].split("requests refused:", 1)[1].strip()
    refused = {} if reasons == "none" else {k: int(v) for k, v in (p.rsplit(" ", 1) for p in reasons.split(", "))}
    return {"updates_received": int(received.group(1)) if received else None, "refused": refused}


def _loop_cpu_s(server: psutil.Process) -> float:
    """Return the CPU seconds (user + system) of the server's main thread, where its event loop runs."""
    for thread in server.threads():
        if thread.id == server.pid:
            return float(thread.user_time + thread.system_time)
    return 0.0


async def _load(args: argparse.Namespace, url: str, server: psutil.Process, tokens: list[str]) -> dict[str, Any]:
    """Start the load processes, wait until their devices are connected, measure the load; return the figures."""
    share = -(-len(tokens) // args.processes)
    workers = []
    for i in range(args.processes):
        part = Path(args.folder) / f"tokens-{i}.txt"
        part.write_text("\n".join(tokens[i * share : (i + 1) * share]) + "\n")
        command = [sys.executable, __file__, "--worker", url, str(part), str(args.seconds), str(args.connect_s)]
        command += ["--client", args.client, "--offer", args.offer, "--train-s", str(args.train_s)]
        command += ["--train-spread", str(args.train_spread), "--seed", str(args.seed), "--first-index", str(i * share)]
        pipe = asyncio.subprocess.PIPE
        workers.append(await asyncio.create_subprocess_exec(*command, stdin=pipe, stdout=pipe))
    rss_idle = server.memory_info().rss
    began = time.perf_counter()
    counts = [int((await w.stdout.readline()).split()[1]) for w in workers if w.stdout is not None]
    connect_s = time.perf_counter() - began
    rss_connected = server.memory_info().rss
    if args.profile is not None:
        server.send_signal(signal.SIGUSR1)  # the profile covers the load, not the start nor the connections
    cpu_before, loop_before, began = server.cpu_times(), _loop_cpu_s(server), time.perf_counter()
    for worker in workers:
        assert worker.stdin is not None
        worker.stdin.write(b"go\n")
        await worker.stdin.drain()
    tally = Tally()
    for i, worker in enumerate(workers):
        said = (await worker.communicate())[0].decode(errors="replace").strip()
        if said:
            print(f"  load process {i} said: {said[:500]}", file=sys.stderr)
        tally.add(json.loads((Path(args.folder) / f"tokens-{i}.tally.json").read_text()))
    cpu_after, loop_after, wall_s = server.cpu_times(), _loop_cpu_s(server), time.perf_counter() - began
    if args.profile is not None:
        server.send_signal(signal.SIGUSR2)
    cpu_s = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
    updates = tally.updates()
    accepted = max(updates["accepted"], 1)
    return {
        "devices": len(tokens),
        "connected_with_task": sum(counts),
        "connect_s": round(connect_s, 3),
        "first_offer": quantiles_ms(tally.first_offer_s),
        "wall_s": round(wall_s, 3),
        # the uploads accepted within the load's seconds: not the drain after it, nor the load processes' exit
        "updates_per_s": round(tally.in_window / args.seconds, 1),
        "in_window": tally.in_window,
        "seconds": args.seconds,
        "updates": updates,
        "latency": {e: quantiles_ms(tally.latencies[e]) for e in ENDPOINTS},
        # the uploads sent after the load's first WARMUP_S: the steady state, without the devices' first uploads
        "upload_after_warmup": quantiles_ms(
            [s for s, at in zip(tally.latencies["upload"], tally.upload_sent_s, strict=True) if at >= WARMUP_S]
        ),
        "answers": {e: dict(sorted(tally.answers[e].items())) for e in ENDPOINTS},
        "requests_sent": dict(tally.sent),
        "requests_per_update": round(sum(tally.sent.values()) / accepted, 3),
        "upload_answers_with_next_task": tally.carried,
        "server_cpu_s": round(cpu_s, 3),
        "server_cpu_ms_per_update": round(1000 * cpu_s / accepted, 4),
        # the event loop's thread (the process's first): what every request waits on
        "server_loop_cpu_s": round(loop_after - loop_before, 3),
        "server_loop_busy": round((loop_after - loop_before) / wall_s, 3),
        "load_processes_cpu_s": round(tally.cpu_s, 3),
        "offered_updates_per_s": round(len(tokens) / args.train_s, 1) if args.train_s else None,
        "server_rss_idle_bytes": rss_idle,
        "server_rss_connected_bytes": rss_connected,
        "server_rss_per_device_bytes": round((rss_connected - rss_idle) / len(tokens)),
    }


async def _measure(args: argparse.Namespace, devices: int, checkout: Path | None = None) -> dict[str, Any]:
    """Serve a fresh run (from ``checkout``; None: this flasync), load it with ``devices`` devices, stop it; return
    the figures with its counters."""
    with tempfile.TemporaryDirectory(prefix="remote-load-") as folder:
        args.folder = folder
        config, tokens = _config(Path(folder), devices, args.seconds)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        profile = args.profile.with_suffix(f".{devices}.prof") if args.profile else None
        if profile is not None:
            profile.unlink(missing_ok=True)
        server = _start_server(Path(folder), config, port, profile, checkout)
        try:
            ready_s = await wait_until_served(url, server, 120.0)
            print(f"\n{devices} devices: server pid {server.pid} running after {ready_s:.1f} s on {url}", flush=True)
            figures = await _load(args, url, psutil.Process(server.pid), tokens)
            for _ in range(300):  # the profile is written by the server's SIGUSR2 handler
                if profile is None or profile.exists():
                    break
                await asyncio.sleep(0.1)
        finally:
            figures_exit = stop_server(server)
        figures["server_exit"] = figures_exit
        figures["server"] = server_counters((Path(folder) / "serve.out").read_text())
        if figures["server"] is None:  # no summary: say why the server ended as it did
            print((Path(folder) / "serve.err").read_text()[-2000:], file=sys.stderr)
    if profile is not None:
        figures["profile"] = _profile_top(profile, args.top, figures["updates"]["accepted"])
    return figures


_AREAS = (
    # (where the file lives, the area): the first match names a function's area
    ("/flasync/codecs/", "decode (flasync.codecs)"),
    ("/flasync/aggregation/", "aggregation"),
    ("/flasync/server/", "intake and server loop (flasync.server)"),
    ("/flasync/clients/remote/", "transport (flasync.clients.remote)"),
    ("/flasync/runtime/serve", "endpoints (flasync.runtime.serve)"),
    ("/flasync/runtime/_asgi", "endpoints (flasync.runtime.serve)"),  # their front door
    ("/flasync/tracking/", "logging and tracking"),
    ("/flasync/observe/", "logging and tracking"),
    ("/structlog/", "logging and tracking"),
    ("/logging/", "logging and tracking"),
    ("/flasync/", "flasync, other"),
    ("/h11/", "HTTP parsing and writing (uvicorn, h11, httptools)"),
    ("/httptools/", "HTTP parsing and writing (uvicorn, h11, httptools)"),
    ("/uvicorn/", "HTTP parsing and writing (uvicorn, h11, httptools)"),
    ("/starlette/", "Starlette (requests, routing, responses)"),
    ("/anyio/", "Starlette (requests, routing, responses)"),
    ("/json/", "JSON"),
    ("/asyncio/", "asyncio scheduling"),
    ("/uvloop/", "asyncio scheduling"),
    ("/torch/", "torch and numpy"),
    ("/numpy/", "torch and numpy"),
)


def _area(filename: str) -> str:
    """Name the area of the server a profiled function's file belongs to (see :data:`_AREAS`)."""
    for where, area in _AREAS:
        if where in filename:
            return area
    return "other"


def _profile_top(path: Path, top: int, updates: int) -> dict[str, Any]:
    """Return the profile's CPU seconds per area, per update, and its ``top`` functions by own time.

    The profile counts the event loop thread's CPU seconds (``time.thread_time``) during the load only. A built-in
    function's (C) own time goes to the areas of its callers, in the shares they called it for, so that
    ``json.loads``'s scanner counts as JSON and a socket write as the HTTP layer that asked for it; the loop's own
    C code (uvloop) calling back into Python is not a function cProfile sees, so its time lands in its caller
    (``asyncio.runners``).
    """
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    areas: Counter[str] = Counter()
    for (filename, _, _), (_, _, own_s, _, callers) in stats.items():
        if filename != "~":
            areas[_area(filename)] += own_s
            continue
        shares = {caller: figures[2] for caller, figures in callers.items()}
        if not shares:
            areas["built-in, no caller seen"] += own_s
        for (caller_file, _, _), share_s in shares.items():
            areas["built-in, called by built-in" if caller_file == "~" else _area(caller_file)] += share_s
    rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    functions = [
        {"function": f"{Path(f).name}:{line}({name})", "calls": nc, "own_s": round(tt, 3), "cumulative_s": round(ct, 3)}
        for (f, line, name), (_, nc, tt, ct, _) in rows
    ]
    total = sum(areas.values())
    per_update = max(updates, 1)
    return {
        "cpu_s": round(total, 3),
        "updates": updates,
        "cpu_us_per_update": round(1e6 * total / per_update, 1),
        "areas_cpu_s": {k: round(v, 3) for k, v in areas.most_common()},
        "areas_us_per_update": {k: round(1e6 * v / per_update, 1) for k, v in areas.most_common()},
        "functions": functions,
    }


def _print(figures: dict[str, Any]) -> None:
    updates, server = figures["updates"], figures["server"] or {}
    first = figures["first_offer"]
    print(
        f"  connect: {figures['connected_with_task']} of {figures['devices']} devices with a task after "
        f"{figures['connect_s']:.1f} s; hello to first offer p50 {first.get('p50_ms')} ms, p99 {first.get('p99_ms')} "
        f"ms, max {first.get('max_ms')} ms"
    )
    print(
        f"  load: {updates['accepted']} updates accepted in {figures['wall_s']:.1f} s, {figures['in_window']} within"
        f" the load's {figures['seconds']:g} s: {figures['updates_per_s']:.0f} updates/s; server CPU"
        f" {figures['server_cpu_s']:.1f} s, {figures['server_cpu_ms_per_update']:.3f} ms per update (one core:"
        f" {1000 / max(figures['server_cpu_ms_per_update'], 1e-9):.0f} updates/s);"
        f" {figures['requests_per_update']} requests per update, {figures['upload_answers_with_next_task']} upload"
        " answers carried the next task"
    )
    offered = figures.get("offered_updates_per_s")
    print(
        f"  event loop thread busy {100 * figures.get('server_loop_busy', 0):.0f}% of the load's wall time; load"
        f" processes' CPU {figures.get('load_processes_cpu_s', 0):.1f} s"
        + (f"; the devices offer {offered:.0f} updates/s (devices / mean training)" if offered else "")
    )
    for endpoint in ENDPOINTS:
        q = figures["latency"][endpoint]
        answers = ", ".join(f"{code} {count}" for code, count in figures["answers"][endpoint].items())
        print(
            f"  {endpoint:<7} n {q['n']:>7}  p50 {q.get('p50_ms', 0):8.2f} ms  p99 {q.get('p99_ms', 0):8.2f} ms"
            f"  ({answers})"
        )
    steady = figures["upload_after_warmup"]
    print(
        f"  upload after the load's first {WARMUP_S:g} s: n {steady['n']}, p50 {steady.get('p50_ms', 0):.2f} ms,"
        f" p99 {steady.get('p99_ms', 0):.2f} ms"
    )
    print(
        f"  server RSS {figures['server_rss_idle_bytes'] / 2**20:.0f} MiB idle, "
        f"{figures['server_rss_connected_bytes'] / 2**20:.0f} MiB with every device connected: "
        f"{figures['server_rss_per_device_bytes'] / 1024:.1f} KiB per device"
    )
    total = updates["accepted"] + updates["refused"] + updates["timed_out"] + updates["failed"]
    print(
        f"  updates: accepted {updates['accepted']} + refused {updates['refused']} + timed out "
        f"{updates['timed_out']} + failed {updates['failed']} = {total}, sent {updates['sent']} "
        f"({'holds' if total == updates['sent'] else 'DOES NOT HOLD'}); the server received "
        f"{server.get('updates_received')}, refused {server.get('refused')} (exit {figures['server_exit']})"
    )
    profile = figures.get("profile")
    if profile is not None:
        print(
            f"  server profile (event loop thread's CPU during the load): {profile['cpu_s']:.2f} s, "
            f"{profile['cpu_us_per_update']:.0f} us per update; per update by area:"
        )
        for area, us in profile["areas_us_per_update"].items():
            print(f"    {us:8.1f} us  {area}")
        for row in profile["functions"]:
            print(
                f"    {row['own_s']:8.3f} s own {row['cumulative_s']:8.3f} s cum {row['calls']:>9}  {row['function']}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, nargs="+", default=[100, 1000], help="devices of each measurement")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds of load once the devices are connected")
    parser.add_argument("--processes", type=int, default=2, help="load processes the devices are spread over")
    parser.add_argument("--profile", type=Path, help="run the server under cProfile, writing PATH.<devices>.prof")
    parser.add_argument("--top", type=int, default=25, help="profile rows printed and stored")
    parser.add_argument("--out", type=Path, default=_HERE / "results" / "remote_load.json", help="results JSON")
    parser.add_argument("--connect-s", type=float, default=10.0, help="longest wait of the devices for a first task")
    parser.add_argument(
        "--client", choices=("wire", "httpx"), default="wire", help="each device's HTTP client (see drive())"
    )
    parser.add_argument(
        "--offer",
        choices=("next", "inline", "separate"),
        default="next",
        help="next: each upload's answer asks for the next task with its model (one request per update when one is"
        " ready; else the offer is asked for as inline); inline: ask for each offer with its model in the answer (a"
        " server without it answers the offer alone); separate: the offer, then the model",
    )
    parser.add_argument(
        "--train-s",
        type=float,
        default=0.0,
        help="mean seconds each device 'trains' between offer and upload (0: saturate the server), drawn per task",
    )
    parser.add_argument(
        "--train-spread",
        type=float,
        default=0.5,
        help="each task's training is uniform in train_s * (1 - spread) .. train_s * (1 + spread)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the devices' training times")
    parser.add_argument("--first-index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another flasync checkout (a git worktree of an earlier commit) whose server is measured too, before "
        "this one at each step (the same load processes, this script's)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="measurements of each configuration, interleaved")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train_s < 0 or not 0 <= args.train_spread <= 1:
        parser.error("--train-s must be >= 0 and --train-spread within 0 .. 1")
    if args.worker:
        url, tokens_file, seconds, connect_s = args.worker
        _worker(url, tokens_file, float(seconds), float(connect_s), args)
        return
    if args.profile is not None:
        args.profile = args.profile.resolve()
    described = machine()
    print(describe(described))
    print(f"{args.seconds} s of load; devices in {args.processes} process(es) on 127.0.0.1")
    servers: dict[str, Path | None] = {"this": None}
    if args.baseline is not None:
        servers = {"baseline": args.baseline.resolve(), "this": None}  # the baseline first in every pair
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {name: {} for name in servers}
    for repeat in range(args.repeat):
        for devices in args.devices:
            for name, checkout in servers.items():
                print(f"\n[{name}{f' {checkout}' if checkout else ''}, repeat {repeat + 1}]", flush=True)
                figures = asyncio.run(_measure(args, devices, checkout))
                figures["load_average_1m"] = round(os.getloadavg()[0], 2)
                runs[name].setdefault(str(devices), []).append(figures)
                _print(figures)
    headline = _headline(runs, args.baseline)
    print()
    for row in headline:
        against = f" ({row.ratio:.2f}x the {row.baseline})" if row.ratio is not None else ""
        print(f"  {row.name}: {row.value:g} {row.unit}{against}")
    settings = {
        "seconds": args.seconds,
        "connect_s": args.connect_s,
        "processes": args.processes,
        "client": args.client,
        "offer": args.offer,
        "train_s": args.train_s,
        "train_spread": args.train_spread,
        "seed": args.seed,
        "repeat": args.repeat,
        "baseline": str(args.baseline) if args.baseline is not None else None,
        "profiled": args.profile is not None,
    }
    store("remote_load", described, settings=settings, headline=headline, figures={"runs": runs}, out=args.out)


_HEADLINE = (
    # (what, the path into a run's figures, its unit)
    ("updates accepted per second", ("updates_per_s",), "updates/s"),
    ("server CPU per update", ("server_cpu_ms_per_update",), "ms"),
    ("server event loop thread busy (its CPU / wall time)", ("server_loop_busy",), "fraction"),
    # inline, the offer's answer holds the model: a server without it answers it alone and is asked for the model next
    ("offer p99 (long poll until the next task, with its model when inline)", ("latency", "offer", "p99_ms"), "ms"),
    ("model download p99 (a request of its own when not inline)", ("latency", "model", "p99_ms"), "ms"),
    ("upload p50", ("latency", "upload", "p50_ms"), "ms"),
    ("upload p99", ("latency", "upload", "p99_ms"), "ms"),
    ("upload p99 after the load's first 3 s", ("upload_after_warmup", "p99_ms"), "ms"),
    ("hello to first task p99", ("first_offer", "p99_ms"), "ms"),
    # --offer next: one request an update when each upload's answer carries the device's next task
    ("requests per accepted update", ("requests_per_update",), "requests"),
)


def _mean(rows: list[dict[str, Any]], path: tuple[str, ...]) -> float:
    values = []
    for row in rows:
        value: Any = row
        for key in path:
            value = value.get(key, 0.0) if isinstance(value, dict) else 0.0
        values.append(float(value))
    return round(sum(values) / max(len(values), 1), 3)


def _headline(runs: dict[str, dict[str, list[dict[str, Any]]]], baseline: Path | None) -> list[Figure]:
    """Return the headline: per number of devices, each figure of :data:`_HEADLINE` as the mean of the repeats of
    this server, with its ratio to the baseline's mean (measured in the same invocation, interleaved)."""
    headline = []
    for devices, rows in runs["this"].items():
        for what, path, unit in _HEADLINE:
            value = _mean(rows, path)
            base = _mean(runs["baseline"][devices], path) if baseline is not None else None
            headline.append(
                Figure(
                    name=f"{what}, {devices} devices",
                    value=value,
                    unit=unit,
                    baseline=f"server of {baseline.name}" if baseline is not None else None,
                    ratio=round(value / base, 3) if base else None,
                )
            )
        if "profile" not in rows[0]:
            continue
        for area in rows[0]["profile"]["areas_us_per_update"]:  # the profile's areas, the largest first
            path = ("profile", "areas_us_per_update", area)
            value = _mean(rows, path)
            base = _mean(runs["baseline"][devices], path) if baseline is not None else None
            headline.append(
                Figure(
                    name=f"event loop CPU per update (profiled): {area}, {devices} devices",
                    value=value,
                    unit="us",
                    baseline=f"server of {baseline.name}" if baseline is not None else None,
                    ratio=round(value / base, 3) if base else None,
                )
            )
    return headline


if __name__ == "__main__":
    main()
