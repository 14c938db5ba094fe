"""A remote client: ask a flasync server for tasks over HTTP, train locally, upload the encoded update.

``await flasync.clients.remote.client.Client(server, token, dataset, model_factory).run()`` is what ``python -m flasync
client``
runs. It trains with flasync's own local training (:func:`flasync.training.local.train`, the server's ``client``
settings) and encodes with the server's upload codec; the error-feedback residual stays on the device and changes
only when an update was delivered. Network errors, 429 and 503 are retried with exponential backoff and jitter
(honouring ``Retry-After``), so a client rides out a server restart; a task the server no longer holds is dropped.
Each client process names its connection with a random session (``X-Flasync-Session``): a task is handed to one
connection, and a client whose token another device is using waits (409 ``token_in_use``) rather than train the
same task. A task is asked for with its model inline (``model=inline``, naming the version the client holds), so a
task costs two requests; from a server that answers the task alone, the model is downloaded next.
See :mod:`flasync.runtime.serve` for the protocol.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import secrets
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import torch
from torch import nn

from flasync import codecs
from flasync.algorithms.client_eval import Selection, evaluates
from flasync.clients.remote.member import take_part
from flasync.config import GRUModel, ModelConfig, RunConfig, SmallCNNModel, validate
from flasync.core import seeding
from flasync.core.errors import ConfigError, DecodeError, FlasyncError, TrainingError
from flasync.data import ArrayData, Partition, from_dataset, prepare
from flasync.training.local import FlatModel, LocalTraining, evaluate, train
from flasync.training.metrics import MetricSet, resolve_metrics
from flasync.training.models import MLP, CharGRU, SmallCNN

__all__ = ["Client", "ClientStats", "RemoteError", "model_from_config"]

_REPORT_HEADER = "x-flasync-report"  # flasync.runtime.serve.REPORT_HEADER (not imported: the client needs no Starlette)
_SESSION_HEADER = "x-flasync-session"  # flasync.runtime.serve.SESSION_HEADER
_INCARNATION_HEADER = "x-flasync-incarnation"  # flasync.runtime.serve.INCARNATION_HEADER
_OFFER_HEADER = "x-flasync-offer"  # flasync.runtime.serve.OFFER_HEADER


class RemoteError(FlasyncError):
    """The server refused the client for good (a bad token, an incompatible model) or stayed unreachable."""


def _ended(stats: ClientStats, response: httpx.Response) -> None:
    """Note the run's end (410) in ``stats``; a run that failed is the client's error too, with the server's reason.

    Raises:
        RemoteError: The server's run failed.
    """
    try:
        detail = str(response.json().get("detail", ""))
    except ValueError:
        detail = ""
    stats.finished = "finished"
    if "(FAILED" in detail:
        stats.finished = "failed"
        reason = detail.removeprefix("the run has ended (FAILED").removesuffix(")").removeprefix(": ")
        raise RemoteError(f"the server's run failed: {reason or 'no reason given'}")


@dataclass(slots=True)
class ClientStats:
    """What one client did: tasks received, updates delivered, refusals, retries and bytes on the wire."""

    client_id: int = -1
    tasks: int = 0
    uploads: int = 0
    dropped: int = 0
    """Tasks whose answer the server no longer took: timed out or abandoned there, or the run had ended (the server
    counts them as timeouts or abandoned tasks, not as refused updates)."""
    stale: int = 0
    """Of :attr:`dropped`: tasks of a server process that died, answered to the one that resumed the run from a
    checkpoint taken before them (refused there as ``stale_task``; it hands out the tasks of its checkpoint again)."""
    failures: int = 0
    retries: int = 0
    download_bytes: int = 0
    upload_bytes: int = 0
    finished: str = ""


@dataclass(frozen=True, slots=True)
class _Trained:
    payload: bytes
    residual: torch.Tensor | None
    report: dict[str, Any]


class Client:
    """One device of a federation served by ``flasync serve`` or :func:`flasync.runtime.serve.asgi_app`.

    Args:
        server: Base URL of the served application (e.g. ``http://127.0.0.1:8080`` or ``https://host/fl``).
        token: This client's bearer token.
        dataset: Local training data: an :class:`~flasync.data.ArrayData` or a map-style torch ``Dataset`` of
            ``(x, y)`` pairs (None: the partition of the server's configured data set that belongs to this
            client id, which is what a simulation would give it: for trials and tests).
        model_factory: Builds the model (None: the server's ``model`` config with the server's feature shape and
            classes). It must have as many parameters as the server's model.
        verify: TLS verification: True, False, or an ``ssl.SSLContext`` (e.g. one trusting a private CA).
        http: An ``httpx.AsyncClient`` to use (e.g. one over ``httpx.ASGITransport``); closed by its owner.
        poll_s: How long one request for a task waits at the server.
        backoff_s: First retry delay; doubled per failed attempt up to ``max_backoff_s``, with jitter.
        max_backoff_s: Longest retry delay.
        give_up_s: Fail with :class:`RemoteError` after the server was unreachable this long (None: never).
        seed: Seeds the retry jitter.
        wall: Monotonic real seconds.
        on_status: Called with one line of text when the client connects, when it starts waiting for a server it
            cannot reach (or that is busy: 429, 502-504; the reason and the delay before the next try), again at
            most every ``status_every_s`` while that lasts or when the reason changes, and when it gets through
            again; e.g. ``print`` (``flasync client`` prints them on stderr). None: silent.
        status_every_s: Least seconds between two lines about one stretch of waiting.

    Attributes:
        session: This client's connection name, random, sent with every request (a task is handed to one).
    """

    def __init__(
        self,
        server: str,
        token: str,
        dataset: ArrayData | torch.utils.data.Dataset[Any] | None = None,
        model_factory: Callable[[], nn.Module] | None = None,
        *,
        verify: bool | ssl.SSLContext = True,
        http: httpx.AsyncClient | None = None,
        poll_s: float = 20.0,
        backoff_s: float = 0.2,
        max_backoff_s: float = 10.0,
        give_up_s: float | None = 120.0,
        seed: int = 0,
        wall: Callable[[], float] = time.perf_counter,
        on_status: Callable[[str], None] | None = None,
        status_every_s: float = 30.0,
    ) -> None:
        """Keep the settings (nothing is sent yet)."""
        self.server = server.rstrip("/")
        # A task is handed to one connection (see flasync.runtime.serve): this client's, for as long as it runs.
        self.session = secrets.token_urlsafe(12)
        self._headers = {"authorization": f"Bearer {token.strip()}", _SESSION_HEADER: self.session}
        self._dataset = dataset
        self._model_factory = model_factory
        self._verify = verify
        self._http = http
        self.poll_s = poll_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.give_up_s = give_up_s
        self._jitter = random.Random(seed)
        self._wall = wall
        self.stats = ClientStats()
        self._residual: torch.Tensor | None = None
        self._model: FlatModel | None = None
        self._data: tuple[torch.Tensor, torch.Tensor] | None = None
        self._held: tuple[torch.Tensor, torch.Tensor] | None = None
        self._metrics = MetricSet()
        self._setup: dict[str, Any] = {}
        self._cached: tuple[int, torch.Tensor] | None = None
        self._on_status = on_status
        self.status_every_s = status_every_s
        self._waiting: _Waiting | None = None
        self._following: dict[str, Any] | None = None

    # ------------------------------------------------------------------------------------------------ run
    async def run(self, *, max_tasks: int | None = None) -> ClientStats:
        """Train tasks until the run ends (or ``max_tasks`` were answered); return what the client did.

        Raises:
            RemoteError: The token was refused, the model does not fit, or the server stayed unreachable.
        """
        if self._http is not None:
            return await self._run(self._http, max_tasks)
        timeout = httpx.Timeout(self.poll_s + 30.0, connect=10.0)
        async with httpx.AsyncClient(verify=self._verify, timeout=timeout) as http:
            return await self._run(http, max_tasks)

    async def _run(self, http: httpx.AsyncClient, max_tasks: int | None) -> ClientStats:
        hello = await self._request(http, "GET", "/v1/hello")
        if hello.status_code == 410:
            _ended(self.stats, hello)
            return self.stats
        self._setup = _json(hello)
        self.stats.client_id = int(self._setup["client_id"])
        self._say(f"connected to {self.server} as client {self.stats.client_id}")
        await asyncio.to_thread(self._prepare)
        answered = 0
        while max_tasks is None or answered < max_tasks:
            offer, self._following = self._following, None  # the next task, when the last upload's answer held it
            if offer is None:
                # The task with its model in one answer (unless the model is the one held); a server that does not
                # inline answers the offer alone and the model is downloaded next.
                params = {"wait_s": self.poll_s, "model": "inline", "have": self._held_version()}
                response = await self._request(http, "GET", "/v1/task", params=params)
                if response.status_code == 204:
                    continue
                if response.status_code == 410:
                    _ended(self.stats, response)
                    break
                offer = self._offer(response)
            self.stats.tasks += 1
            if await self._answer(http, offer, more=max_tasks is None or answered + 1 < max_tasks):
                answered += 1
        return self.stats

    async def _answer(self, http: httpx.AsyncClient, offer: dict[str, Any], *, more: bool = True) -> bool:
        """Download, train, upload one task; True if the server took the answer. With ``more`` (another task is
        wanted), the upload asks for the next task in its answer (kept for :meth:`_run`; a server without it or
        with none posted answers without one, and the next task is long-polled for)."""
        task_id, version = int(offer["task_id"]), int(offer["base_version"])
        # Sent back with the answer: a server resumed from a checkpoint refuses answers to the tasks of one that died.
        incarnation = str(offer.get("incarnation", ""))
        answer_headers = {_INCARNATION_HEADER: incarnation} if incarnation else {}
        start = self._wall()
        weights = await self._weights(http, version)
        if weights is None:
            self.stats.dropped += 1
            return False
        download_s = self._wall() - start
        try:
            trained = await asyncio.to_thread(self._train, weights, int(offer["participation"]), download_s)
        except TrainingError as exc:
            self.stats.failures += 1
            body = json.dumps({"error": f"{type(exc).__name__}: {exc}"[:200]})
            await self._request(
                http, "POST", f"/v1/tasks/{task_id}/failed", content=body.encode(), headers=answer_headers
            )
            return False
        if self._config().secure_aggregation.enabled:
            return await self._hold(http, task_id, trained, answer_headers)
        response = await self._request(
            http,
            "POST",
            f"/v1/tasks/{task_id}/update",
            params={"next": "inline", "have": self._held_version()} if more else None,
            content=trained.payload,
            headers={
                "content-type": "application/octet-stream",
                _REPORT_HEADER: json.dumps(trained.report),
                **answer_headers,
            },
        )
        # 409 replay: an earlier attempt of this very upload arrived (its answer was lost), so it was delivered.
        if response.status_code == 202 or (response.status_code == 409 and _error(response) != "stale_task"):
            self._residual = trained.residual
            self.stats.uploads += 1
            self.stats.upload_bytes += len(trained.payload)
            if response.status_code == 202 and _OFFER_HEADER in response.headers:
                self._following = self._offer(response)
            return True
        # The task was timed out, the run ended, or the server that dispatched it died: the residual stays as it was.
        self.stats.dropped += 1
        self.stats.stale += response.status_code == 409
        return False

    async def _hold(self, http: httpx.AsyncClient, task_id: int, trained: _Trained, headers: dict[str, str]) -> bool:
        """Hold the trained update for its secure-aggregation group and take part in its rounds; True if it is in
        the group's sum."""

        async def request(method: str, path: str, **kwargs: Any) -> httpx.Response:
            return await self._request(http, method, path, **{"headers": headers, **kwargs})

        delta = codecs.decode(trained.payload, expected_elements=int(self._setup["num_params"]))
        num_samples = int(trained.report["num_samples"])
        outcome = await take_part(
            request,
            client_id=self.stats.client_id,
            task_id=task_id,
            delta=delta,
            num_samples=num_samples,
            poll_s=self.poll_s,
        )
        self.stats.uploads += outcome == "summed"
        self.stats.dropped += outcome != "summed"
        return outcome == "summed"

    def _offer(self, response: httpx.Response) -> dict[str, Any]:
        """Return an answered task; keep the model that came inline with it (see :mod:`flasync.runtime.serve`)."""
        inline = response.headers.get(_OFFER_HEADER)
        if inline is None:
            return _json(response)
        try:
            offer: dict[str, Any] = json.loads(inline)
        except ValueError:
            raise RemoteError(f"{self.server} sent an offer that is not JSON") from None
        if response.content:
            self._keep(int(offer["base_version"]), response.content)
        return offer

    def _held_version(self) -> int:
        return self._cached[0] if self._cached is not None else -1

    async def _weights(self, http: httpx.AsyncClient, version: int) -> torch.Tensor | None:
        """Return the model of ``version``: the one held, else downloaded (None: the server no longer serves it)."""
        cached = self._cached
        if cached is not None and cached[0] == version:
            return cached[1]
        response = await self._request(http, "GET", f"/v1/models/{version}")
        if response.status_code != 200:
            return None
        return self._keep(version, response.content)

    def _keep(self, version: int, payload: bytes) -> torch.Tensor:
        """Decode the model of ``version`` and hold it (the last one only).

        Raises:
            RemoteError: It does not decode to the model's size.
        """
        self.stats.download_bytes += len(payload)
        try:
            weights = codecs.decode(payload, expected_elements=int(self._setup["num_params"]))
        except DecodeError as exc:
            raise RemoteError(f"the server's model of version {version} does not decode: {exc}") from None
        self._cached = (version, weights)
        return weights

    # ------------------------------------------------------------------------------------------ training
    def _config(self) -> RunConfig:
        return validate(self._setup["config"])

    def _prepare(self) -> None:
        """Build the model and the local data (in a worker thread)."""
        config = self._config()
        feature_shape = tuple(int(d) for d in self._setup["feature_shape"])
        num_classes = int(self._setup["num_classes"])
        if self._dataset is None:
            x, y, held = _own_partition(config, self.stats.client_id)
        else:
            data = self._dataset if isinstance(self._dataset, ArrayData) else from_dataset(self._dataset)
            x, y, held = _held_out(config, self.stats.client_id, data.x, data.y)
        if tuple(x.shape[1:]) != feature_shape:
            raise RemoteError(
                f"local samples have shape {tuple(x.shape[1:])}, the server's model takes {feature_shape}"
            )
        if len(y) == 0:
            raise RemoteError("the local data set is empty")
        factory = self._model_factory or (lambda: model_from_config(config.model, feature_shape, num_classes))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # the weights are overwritten by every download; only the shapes matter
            module = factory()
        model = FlatModel(module)
        if model.flat.numel() != int(self._setup["num_params"]):
            raise RemoteError(
                f"the local model has {model.flat.numel()} parameters, the server's {self._setup['num_params']}"
            )
        self._model = model
        self._data = (x.float(), y.long())
        self._held = None if held is None else (held[0].float(), held[1].long())
        try:
            self._metrics = resolve_metrics(config.eval.metrics, num_classes=num_classes)
        except ConfigError as exc:
            raise RemoteError(f"the server's {exc}") from None

    def _train(self, weights: torch.Tensor, participation: int, download_s: float) -> _Trained:
        """Train from ``weights`` and encode the delta with error feedback (in a worker thread)."""
        assert self._model is not None and self._data is not None
        config = self._config()
        seed, client_id = config.seed, self.stats.client_id
        local = LocalTraining(**config.client.model_dump(exclude={"personal"}))
        x, y = self._data
        evaluation = config.eval.clients
        chosen = (
            self._held is not None
            and len(self._held[1]) > 0
            and evaluates(
                Selection(seed, fraction=evaluation.fraction, every=evaluation.every), client_id, participation
            )
        )
        report: dict[str, Any] = {}
        if chosen and evaluation.when == "before":
            report["evaluation"] = self._evaluate(weights, "before")
        generator = seeding.torch_stream(seed, seeding.TASK, client_id, participation)
        result = train(self._model, weights, x, y, local, generator)
        if chosen and evaluation.when == "after":
            report["evaluation"] = self._evaluate(weights - result.delta.to(weights.device), "after")
        if not bool(torch.isfinite(result.delta).all()):
            raise TrainingError(f"local training diverged: the update has NaN or Inf (loss {result.loss})")
        from flasync.codecs.build import pipeline

        codec = pipeline(config.codec.upload)
        start = self._wall()
        encoded = codec.encode(
            result.delta.cpu(),
            generator=seeding.torch_stream(seed, seeding.CODEC, client_id, participation),
            residual=self._residual,
        )
        report |= {
            "num_samples": result.num_samples,
            "train_loss": result.loss if math.isfinite(result.loss) else 0.0,
            "train_s": result.train_s,
            "encode_s": self._wall() - start,
            "download_s": download_s,
            "peak_mem_bytes": result.peak_mem_bytes,
        }
        return _Trained(encoded.payload, encoded.residual, report)

    def _evaluate(self, weights: torch.Tensor, when: str) -> dict[str, Any]:
        """Evaluate ``weights`` on the held-out samples; return the report's ``evaluation`` (in a worker thread)."""
        assert self._model is not None and self._held is not None
        start = self._wall()
        done = evaluate(self._model, weights, *self._held, metrics=self._metrics)
        return {
            "num_samples": done.num_samples,
            "accuracy": done.accuracy,
            "loss": done.loss,
            "when": when,
            "eval_s": self._wall() - start,
            "metrics": dict(done.metrics),
        }

    # --------------------------------------------------------------------------------------------- HTTP
    async def _request(self, http: httpx.AsyncClient, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """Send a request, retrying network errors, 429, 502-504 with backoff; raise on 401 and other 4xx."""
        headers = {**self._headers, **kwargs.pop("headers", {})}
        delay, first_failure = self.backoff_s, None
        while True:
            try:
                response = await http.request(method, self.server + path, headers=headers, **kwargs)
            except httpx.TransportError as exc:
                now = self._wall()
                first_failure = now if first_failure is None else first_failure
                if self.give_up_s is not None and now - first_failure > self.give_up_s:
                    raise RemoteError(f"{self.server} unreachable for {self.give_up_s:g} s: {exc!r}") from None
                delay = await self._back_off(f"cannot reach it ({_reason(exc)})", delay)
                continue
            status = response.status_code
            if status in (429, 502, 503, 504):
                if status != 429:  # a server that is stopping (or a proxy without one) counts as unreachable
                    now = self._wall()
                    first_failure = now if first_failure is None else first_failure
                    if self.give_up_s is not None and now - first_failure > self.give_up_s:
                        raise RemoteError(f"{self.server} answered {status} for {self.give_up_s:g} s") from None
                answer = f"{status} {response.reason_phrase}".strip()
                reason = f"it is busy ({answer})" if status == 429 else f"it answers {answer}"
                delay = await self._back_off(reason, delay, _retry_after(response))
                continue
            if status == 409 and _error(response) == "token_in_use":
                # Another device with this token holds this client's task: wait until it is answered or timed out.
                reason = "its token is in use by another connection, which holds this client's task"
                delay = await self._back_off(reason, delay, _retry_after(response))
                continue
            self._got_through()
            if status == 401:
                raise RemoteError(f"{self.server} refused the token (401)")
            if status in (400, 413):
                raise RemoteError(f"{self.server} refused {method} {path}: {status} {_detail(response)}")
            return response

    async def _back_off(self, reason: str, delay: float, retry_after: float | None = None) -> float:
        """Count a retry, say why the client waits, sleep ``retry_after`` (else ``delay`` with jitter); return the
        next delay (doubled, at most ``max_backoff_s``)."""
        self.stats.retries += 1
        pause = retry_after if retry_after is not None else delay * (0.5 + self._jitter.random())
        self._wait(reason, pause)
        await asyncio.sleep(pause)
        return min(2 * delay, self.max_backoff_s)

    # ------------------------------------------------------------------------------------------- status
    def _say(self, line: str) -> None:
        if self._on_status is not None:
            self._on_status(line)

    def _wait(self, reason: str, pause_s: float) -> None:
        """Note one failed try; say so when a stretch of waiting starts, its reason changes, or every so often."""
        now = self._wall()
        waiting = self._waiting
        if waiting is None:
            self._waiting = _Waiting(since=now, said_at=now, reason=reason)
            self._say(f"waiting for {self.server}: {reason}; next try in {pause_s:.1f} s")
            return
        waiting.tries += 1
        if reason != waiting.reason or now - waiting.said_at >= self.status_every_s:
            waiting.reason, waiting.said_at = reason, now
            self._say(
                f"still waiting for {self.server} after {now - waiting.since:.0f} s and {waiting.tries} tries: "
                f"{reason}; next try in {pause_s:.1f} s"
            )

    def _got_through(self) -> None:
        """End a stretch of waiting; say so once connected (before that, the connection's line says it)."""
        waiting, self._waiting = self._waiting, None
        if waiting is not None and self.stats.client_id >= 0:
            self._say(f"got through to {self.server} again after {self._wall() - waiting.since:.1f} s")


@dataclass(slots=True)
class _Waiting:
    """A stretch of failed tries to reach the server: since when, what the last line said and when."""

    since: float
    said_at: float
    reason: str
    tries: int = 1


def _reason(exc: httpx.TransportError) -> str:
    """Return a short reason for a failed request: the error's type and its message, on one line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:120]}" if text else type(exc).__name__


def model_from_config(model: ModelConfig, feature_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build the model a ``model`` config section describes for samples of ``feature_shape``."""
    if isinstance(model, SmallCNNModel):
        return SmallCNN(
            in_channels=model.in_channels, image_size=model.image_size, num_classes=num_classes, channels=model.channels
        )
    if isinstance(model, GRUModel):
        return CharGRU(num_classes, model.embed, model.hidden, model.layers)
    return MLP(int(np.prod(feature_shape)), model.hidden, num_classes)


_Held = tuple[torch.Tensor, torch.Tensor] | None


def _own_partition(config: RunConfig, client_id: int) -> tuple[torch.Tensor, torch.Tensor, _Held]:
    """Return the samples the server's configured data set and partition give ``client_id`` to train on, and those
    held out for its evaluation (None: no split), as a simulation gives them."""
    loaded = prepare.load(config)
    part = loaded.partition if loaded.partition is not None else prepare.partition(config, loaded.train)
    share = config.eval.clients.held_out_share
    held: Partition | None = None
    if share > 0.0:
        part, held = part.hold_out(share, seeding.numpy_stream(config.seed, seeding.CLIENT_EVAL))
    x, y = loaded.train.x, loaded.train.y
    rows = torch.from_numpy(np.array(part[client_id], dtype=np.int64))
    if held is None:
        return x[rows], y[rows], None
    kept = torch.from_numpy(np.array(held[client_id], dtype=np.int64))
    return x[rows], y[rows], (x[kept], y[kept])


def _held_out(
    config: RunConfig, client_id: int, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, _Held]:
    """Split a device's own samples as the partitioner splits a client's (``eval.clients.held_out``; None: none)."""
    share = config.eval.clients.held_out_share
    if share <= 0.0:
        return x, y, None
    whole = Partition.from_lists([np.arange(len(y), dtype=np.int64)])
    train_part, held = whole.hold_out(share, seeding.numpy_stream(config.seed, seeding.CLIENT_EVAL, client_id))
    rows, kept = (torch.from_numpy(np.array(p[0], dtype=np.int64)) for p in (train_part, held))
    return x[rows], y[rows], (x[kept], y[kept])


def _json(response: httpx.Response) -> dict[str, Any]:
    if response.status_code != 200:
        raise RemoteError(f"unexpected answer {response.status_code}: {_detail(response)}")
    try:
        data = response.json()
    except ValueError:
        raise RemoteError(f"the server's answer is not JSON ({response.status_code})") from None
    if not isinstance(data, dict):
        raise RemoteError("the server's answer is not a JSON object")
    return data


def _error(response: httpx.Response) -> str:
    """Return the ``error`` key of a refusal's JSON body (empty when there is none)."""
    try:
        data = response.json()
    except ValueError:
        return ""
    return str(data.get("error", "")) if isinstance(data, dict) else ""


def _detail(response: httpx.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text[:200]
    return str(data.get("detail", data)) if isinstance(data, dict) else str(data)[:200]


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return min(max(float(value), 0.0), 3600.0) if value is not None else None
    except ValueError:
        return None
