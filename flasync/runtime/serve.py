"""Serve a federation to remote clients over HTTP: an ASGI application to mount, and ``flasync serve``.

``asgi_app(federation)`` is a Starlette application over the federation's
:class:`~flasync.clients.remote.transport.RemoteTransport`; mount it in your own service
(``app.mount("/fl", flasync.runtime.serve.asgi_app(federation))``) and run ``await federation.run()`` in that service's
event loop (its lifespan, say). :func:`serve` runs one under uvicorn, as ``python -m flasync serve CONFIG`` does.
Its token-checked endpoints are answered at the application's front door (:mod:`flasync.runtime._asgi`), before
Starlette's router and middleware, which answer ``/v1/status`` and any other request.

The protocol (every request carries ``Authorization: Bearer TOKEN``; control is JSON, models and updates are
flasync's binary codec format as ``application/octet-stream``; refusals are ``{"error": reason, "detail": ...}``):

- ``GET /v1/hello``: the client's id and what it needs to train (model size and shape, local settings, codec).
- ``GET /v1/task?wait_s=S``: long-polls for the client's next task: 200 with the task, 204 when none came within
  ``S`` seconds (ask again), 410 when the run has ended, 429 with ``Retry-After`` when too many clients wait.
  A task is handed to one connection, named by the ``X-Flasync-Session`` header (a random string a client process
  picks once; absent: the empty one): that connection asking again gets the same task; another with the same
  token gets 409 ``token_in_use`` with ``Retry-After`` while the task is in flight, and 403 if it uploads for it.
  With ``model=inline`` (and ``have=V``, the version the client holds; -1: none), a task comes with its model:
  the body is the encoded model of the task's version (empty when that is ``V``), the task's JSON is in the
  ``X-Flasync-Offer`` header; one request where a task used to take two. A server without it answers the JSON
  offer alone, which a client reads as before.
- ``GET /v1/models/{version}``: the encoded model of a version a task is based on (encoded once per version), with
  an ``ETag``; ``If-None-Match`` naming it is answered 304 with no body.
- ``POST /v1/tasks/{task_id}/update``: the encoded update as the body, the training report as JSON in the
  ``X-Flasync-Report`` header (with the client's evaluation of the downloaded model when ``eval.clients`` chose
  the task: :class:`~flasync.clients.remote.transport.EvaluationReport`), the task's ``incarnation`` (from its
  offer) in ``X-Flasync-Incarnation``: 202 once it is on its way to the intake; 403 for a task that is not the
  client's, 409 for a replay (``replay``) or for a task of a server process that died and whose run was resumed
  from a checkpoint (``stale_task``), 413 for a body larger than the model's encoding (refused before it is read
  whole), 503 with ``Retry-After`` when the server's inbox is full. With ``next=inline`` (and ``have=V``), a 202
  carries the client's next task as an inline offer does (``X-Flasync-Offer``, the model in the body, empty when it
  is version ``V``) if the server posts it within a few turns of its event loop (it takes the update and hands the
  freed device its next task): one request an update for a busy device. The answer never waits on a clock for a
  task: without the header the client long-polls ``GET /v1/task`` as before.
- ``POST /v1/tasks/{task_id}/failed``: local training failed (JSON ``{"error": ...}``; the same headers).
- ``GET /v1/status``: whether the run is waiting, running or finished (no token needed).

Under abuse: every refused request (no or a wrong token, a malformed id or header, a task that is not the client's)
costs its address a token of a bucket (:class:`~flasync.clients.remote.limits.AddressLimits`); an address whose
bucket is empty gets 429 with ``Retry-After`` before anything else is done for it. Request headers must arrive
within :data:`HEADER_TIMEOUT_S` and each chunk of a body within :data:`BODY_IDLE_S`, else the connection is closed
(408 for a body); ids are at most 18 digits (400). Refusals are counted per reason; their metric lines are logged
at the 1st, 2nd, 4th, 8th, ... refusal of a reason, so a flood cannot grow the run's store.

Long-polling rather than WebSocket: every exchange is one ordinary HTTP request, so it passes any proxy or load
balancer, needs no WebSocket library on the device (httpx has none), and a client that loses its connection (or a
server that restarts) needs nothing but the next request; a task waits in its client's mailbox between polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

import h11
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from flasync.clients.remote.limits import AddressLimits
from flasync.clients.remote.transport import ModelDownload, Offer, Refusal, RemoteTransport, Report
from flasync.core.errors import ConfigError
from flasync.core.events import ClientId
from flasync.runtime._asgi import Answer, Endpoint, Hot, Incoming, ServedApp, read_body

if TYPE_CHECKING:
    from flasync.runtime.federation import Federation, RunSummary

__all__ = [
    "BODY_IDLE_S",
    "HEADER_TIMEOUT_S",
    "INCARNATION_HEADER",
    "OFFER_HEADER",
    "REPORT_HEADER",
    "SESSION_HEADER",
    "asgi_app",
    "serve",
]

REPORT_HEADER = "x-flasync-report"
"""The header holding an upload's training report (JSON)."""
SESSION_HEADER = "x-flasync-session"
"""The header naming a client process's connection (a random string it picks once): a task is handed to one."""
INCARNATION_HEADER = "x-flasync-incarnation"
"""The header of an answer naming the server process that handed the task out (its offer's ``incarnation``)."""
OFFER_HEADER = "x-flasync-offer"
"""The header of an offer answered with its model inline (``GET /v1/task?model=inline``): the offer's JSON."""
_AUTHORIZATION = b"authorization"
_REPORT = REPORT_HEADER.encode()
_SESSION = SESSION_HEADER.encode()
_INCARNATION = INCARNATION_HEADER.encode()
_OFFER = OFFER_HEADER.encode()
_MAX_SESSION_CHARS = 64
_SESSION_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")
_MAX_REPORT_CHARS = 4096
_OCTETS = b"application/octet-stream"
_MAX_ID_DIGITS = 18
HEADER_TIMEOUT_S = 10.0
"""Seconds a connection has to send a request's headers (a slow-header connection is closed after them)."""
BODY_IDLE_S = 20.0
"""Seconds a request's body may pause between chunks before the request is refused (408) and closed."""
_compact_json = json.JSONEncoder(separators=(",", ":")).encode
"""JSON without spaces (one encoder, not one built per call as ``json.dumps`` with options does)."""
_CHARGED = frozenset({400, 401, 403, 404, 408, 413})
"""The refusals that cost an address a token: what a well-behaved client never gets."""


def asgi_app(federation: Federation) -> Starlette:
    """Return the Starlette application serving ``federation``'s tasks to remote clients.

    The federation's config must have ``remote.enabled = true`` (and ``clock = "wall"``). Requests before
    ``federation.run()`` has started are answered 503 with ``Retry-After``.

    Raises:
        ConfigError: If the federation has no remote transport.
    """
    transport = federation.transport
    if transport is None:
        raise ConfigError("remote.enabled: asgi_app needs a federation whose config has remote.enabled = true")
    return _app(transport, lambda: federation.server.version if federation.server is not None else None)


def _app(transport: RemoteTransport, version: Callable[[], int | None]) -> Starlette:
    routes = _Routes(transport, version, AddressLimits())
    limited = routes.limited
    secagg = _SecAggRoutes(routes)
    # Every token-checked endpoint is answered by the application's front door (see flasync.runtime._asgi), the
    # unauthenticated status, wrong methods and unknown paths by Starlette's router.
    hot = [
        Hot("GET", "/v1/task", limited(routes.task)),
        Hot("POST", "/v1/tasks/{task_id}/update", limited(routes.upload)),
        Hot("GET", "/v1/models/{version}", limited(routes.model)),
        Hot("GET", "/v1/hello", limited(routes.hello)),
        Hot("POST", "/v1/tasks/{task_id}/failed", limited(routes.failed)),
        Hot("POST", "/v1/tasks/{task_id}/held", limited(secagg.held)),
        Hot("GET", "/v1/secagg", limited(secagg.instruction)),
        Hot("POST", "/v1/secagg/{group}/{round}", limited(secagg.message)),
    ]
    return ServedApp(hot, [Route("/v1/status", routes.status, methods=["GET"])])


class _Routes:
    """The protocol's endpoints over one transport: each checks the client's token and answers one request.

    Args:
        transport: The federation's remote transport.
        version: Returns the server's current model version (None before the run has a server).
        limits: Each address's budget of refused requests.
    """

    def __init__(self, transport: RemoteTransport, version: Callable[[], int | None], limits: AddressLimits) -> None:
        """Serve ``transport``."""
        self.transport = transport
        self.version = version
        self.limits = limits

    def limited(self, handler: Endpoint) -> Endpoint:
        """Return ``handler`` behind its address's budget: 429 once the address has spent it on refused requests."""

        async def endpoint(request: Incoming) -> Response:
            address = request.address
            wait_s = self.limits.retry_after(address)
            if wait_s is not None:
                return _refused(self.transport.rate_limited(wait_s))
            response = await handler(request)
            if response.status_code in _CHARGED:
                self.limits.refused(address)
            return response

        return endpoint

    def authorize(self, request: Incoming) -> ClientId | Refusal:
        """Return the client the request's bearer token names, or the refusal of a missing or unknown token."""
        scheme, _, token = (request.header(_AUTHORIZATION) or "").partition(" ")
        client_id = self.transport.tokens.client_of(token.strip()) if scheme.lower() == "bearer" else None
        return self.transport.unauthorized() if client_id is None else client_id

    def malformed(self, client_id: ClientId, detail: str) -> Response:
        """Answer 400 to a malformed id, header or query parameter of an authenticated client (counted)."""
        return _refused(self.transport.bad_request(client_id, detail))

    def session_of(self, request: Incoming) -> str | Refusal:
        """Return the request's session (the empty one when absent), or the refusal of a malformed one."""
        return _name_header(request.header(_SESSION), SESSION_HEADER) or ""

    def answering(self, request: Incoming) -> tuple[int, str, str | None] | Refusal:
        """Return the task id, session and incarnation (None: not sent) an answer names, or a refusal."""
        task_id = _id(request, "task_id")
        if isinstance(task_id, Refusal):
            return task_id
        session = self.session_of(request)
        if isinstance(session, Refusal):
            return session
        incarnation = _name_header(request.header(_INCARNATION), INCARNATION_HEADER)
        if isinstance(incarnation, Refusal):
            return incarnation
        return task_id, session, incarnation

    async def hello(self, request: Incoming) -> Response:
        """``GET /v1/hello``: answer the client's id and what it needs to train."""
        client_id = self.authorize(request)
        if isinstance(client_id, Refusal):
            return _refused(client_id)
        answer = self.transport.hello(client_id)
        return _refused(answer) if isinstance(answer, Refusal) else Response(answer, media_type="application/json")

    async def task(self, request: Incoming) -> Response:
        """``GET /v1/task``: long-poll for the client's next task."""
        client_id = self.authorize(request)
        if isinstance(client_id, Refusal):
            return _refused(client_id)
        try:
            wait_s = _seconds(request, self.transport.settings.poll_s)
        except ValueError:
            return self.malformed(client_id, "wait_s must be a number of seconds")
        session = self.session_of(request)
        if isinstance(session, Refusal):
            return self.malformed(client_id, session.detail)
        inline = request.query("model") == "inline"
        have = _have(request) if inline else -1
        if have is None:
            return self.malformed(client_id, "have must be a model version (-1: none)")
        offer = await self.transport.next_task(client_id, wait_s if wait_s == wait_s else 0.0, session)
        if offer is None:
            return Response(status_code=204)
        if isinstance(offer, Refusal):
            return _refused(offer)
        if inline:
            return await self.inline(client_id, offer, have)
        return JSONResponse(offer.to_json())

    async def inline(self, client_id: ClientId, offer: Offer, have: int, status: int = 200) -> Response:
        """Answer ``offer`` with the encoded model of its version as the body (empty when the client holds that
        version, ``have``, or when it is no longer served: the client then downloads it), the offer's JSON in
        :data:`OFFER_HEADER`."""
        header = (_OFFER, _compact_json(offer.to_json()).encode("latin-1"))
        if offer.base_version == have:
            return Answer(b"", status, _OCTETS, (header,))
        download = await self.transport.model(client_id, offer.base_version)
        if isinstance(download, Refusal):  # the run ended or the version went meanwhile: the offer alone
            return Answer(b"", status, _OCTETS, (header,))
        return Answer(download.payload, status, _OCTETS, (header, (b"etag", download.etag.encode("latin-1"))))

    async def model(self, request: Incoming) -> Response:
        """``GET /v1/models/{version}``: answer the encoded model of a version (304 when ``If-None-Match`` names
        its entity tag)."""
        client_id = self.authorize(request)
        if isinstance(client_id, Refusal):
            return _refused(client_id)
        version = _id(request, "version")
        if isinstance(version, Refusal):
            return self.malformed(client_id, version.detail)
        download = await self.transport.model(client_id, version, request.header(b"if-none-match"))
        if isinstance(download, Refusal):
            return _refused(download)
        return _model_response(download)

    async def upload(self, request: Incoming) -> Response:
        """``POST /v1/tasks/{task_id}/update``: take a task's encoded update and its training report."""
        client_id = self.authorize(request)
        if isinstance(client_id, Refusal):
            return _refused(client_id)
        answering = self.answering(request)
        if isinstance(answering, Refusal):
            return self.malformed(client_id, answering.detail)
        task_id, session, incarnation = answering
        after = request.query("next") == "inline"
        have = _have(request) if after else -1
        if have is None:
            return self.malformed(client_id, "have must be a model version (-1: none)")
        declared = request.header(b"content-length")
        length = int(declared) if declared is not None and declared.isdigit() else None
        refusal = self.transport.check_upload(client_id, task_id, length, session, incarnation)
        if refusal is not None:
            return _refused(refusal)
        raw = request.header(_REPORT) or ""
        try:
            if len(raw) > _MAX_REPORT_CHARS:
                raise ValueError(f"the report has more than {_MAX_REPORT_CHARS} characters")
            report = Report.from_json(
                json.loads(raw),
                max_num_samples=self.transport.settings.max_num_samples,
                metric_names=self.transport.metric_names,
            )
        except ValueError as exc:  # json.JSONDecodeError is one
            return _refused(self.transport.bad_report(client_id, f"{REPORT_HEADER}: {exc}".splitlines()[0]))
        # Read in chunks, never more than the limit: a body without (or with a false) Content-Length is cut off.
        body = await read_body(request.receive, self.transport.max_upload_bytes, BODY_IDLE_S)
        if isinstance(body, int):
            return _refused(self.transport.oversize(client_id, body))
        if body is None:
            return _refused(self.transport.slow_body(client_id))
        answer = self.transport.upload(client_id, task_id, body, report, session, incarnation)
        if answer is not None:
            return _refused(answer)
        # The next task if it is posted within a few turns of the loop: the answer never waits on a clock for one.
        offer = await self.transport.ready_task(client_id, session) if after else None
        if offer is not None:
            return await self.inline(client_id, offer, have, status=202)
        return JSONResponse({"status": "received", "task_id": task_id}, status_code=202)

    async def failed(self, request: Incoming) -> Response:
        """``POST /v1/tasks/{task_id}/failed``: take the report that a task's local training failed."""
        client_id = self.authorize(request)
        if isinstance(client_id, Refusal):
            return _refused(client_id)
        answering = self.answering(request)
        if isinstance(answering, Refusal):
            return self.malformed(client_id, answering.detail)
        task_id, session, incarnation = answering
        body = await read_body(request.receive, 4096, BODY_IDLE_S)
        if body is None:
            return _refused(self.transport.slow_body(client_id))
        if isinstance(body, int):
            body = b""  # a report too long to be one: the task failed, its error is not known
        try:
            error = str(json.loads(body).get("error", "failed")) if body else "failed"
        except (ValueError, AttributeError):
            error = "failed"
        answer = self.transport.failed(client_id, task_id, error, session, incarnation)
        if answer is not None:
            return _refused(answer)
        return JSONResponse({"status": "received", "task_id": task_id}, status_code=202)

    async def status(self, request: Request) -> Response:
        """``GET /v1/status``: answer whether the run is waiting, running or finished (no token needed)."""
        state = "finished" if self.transport.finished else "running" if self.transport.attached else "waiting"
        return JSONResponse({"state": state, "version": self.version(), "reason": self.transport.finished or None})


class _SecAggRoutes:
    """Secure aggregation's endpoints (:mod:`flasync.clients.remote.secure`): a client holds its trained update,
    then long-polls for and answers its group's rounds.

    Args:
        routes: The protocol's other endpoints (their token and task checks).
    """

    def __init__(self, routes: _Routes) -> None:
        """Serve beside ``routes``."""
        self.routes = routes
        self.transport = routes.transport

    async def held(self, request: Incoming) -> Response:
        """``POST /v1/tasks/{task_id}/held``: the client finished the task and holds its update for its group."""
        client_id = self.routes.authorize(request)
        if isinstance(client_id, Refusal):
            return _refused(client_id)
        answering = self.routes.answering(request)
        if isinstance(answering, Refusal):
            return self.routes.malformed(client_id, answering.detail)
        groups = self.transport.secure
        if groups is None:
            return self.routes.malformed(client_id, "this run does not run secure aggregation")
        task_id, session, incarnation = answering
        refusal = self.transport.check_upload(client_id, task_id, None, session, incarnation)
        if refusal is not None:
            return _refused(refusal)
        body = await read_body(request.receive, 4096, BODY_IDLE_S)
        try:
            num_samples = int(json.loads(body)["num_samples"]) if isinstance(body, bytes) else -1
        except (ValueError, KeyError, TypeError):
            num_samples = -1
        if not 0 < num_samples <= self.transport.settings.max_num_samples:
            return _refused(self.transport.bad_report(client_id, 'the body must be {"num_samples": N}, N > 0'))
        groups.hold(self.transport.held(client_id, task_id), num_samples)
        return JSONResponse({"status": "held", "task_id": task_id}, status_code=202)

    async def instruction(self, request: Incoming) -> Response:
        """``GET /v1/secagg``: long-poll for the client's next round (``after``: the ``GROUP/ROUND`` it did last)."""
        client_id = self.routes.authorize(request)
        if isinstance(client_id, Refusal):
            return _refused(client_id)
        groups = self.transport.secure
        if self.transport.finished or groups is None:
            return JSONResponse({"error": "finished", "detail": "the run has ended"}, status_code=410)
        try:
            wait_s = min(_seconds(request, self.transport.settings.poll_s), 60.0)
        except ValueError:
            return self.routes.malformed(client_id, "wait_s must be a number of seconds")
        step = await groups.next_instruction(int(client_id), request.query("after") or "", wait_s)
        return Response(status_code=204) if step is None else JSONResponse(step)

    async def message(self, request: Incoming) -> Response:
        """``POST /v1/secagg/{group}/{round}``: a member's message of a round, in its wire form."""
        client_id = self.routes.authorize(request)
        if isinstance(client_id, Refusal):
            return _refused(client_id)
        group = _id(request, "group")
        groups = self.transport.secure
        if isinstance(group, Refusal) or groups is None:
            return self.routes.malformed(client_id, "no such secure aggregation group")
        body = await read_body(request.receive, self.transport.max_upload_bytes + _MAX_SHARES_BYTES, BODY_IDLE_S)
        if isinstance(body, int):
            return _refused(self.transport.oversize(client_id, body))
        if body is None:
            return _refused(self.transport.slow_body(client_id))
        refused = groups.receive(int(client_id), group, str(request.path_params["round"]), body)
        if refused is not None:  # late (the round closed without it) or out of turn: the client goes on
            return JSONResponse({"error": "not_expected", "detail": refused}, status_code=409)
        return JSONResponse({"status": "received"}, status_code=202)


_MAX_SHARES_BYTES = 1 << 20
"""Room beside a masked update for a round's other messages (a share bundle is about 200 bytes a neighbour)."""


def _name_header(name: str | None, header: str) -> str | Refusal | None:
    """Return the value of a header holding a name (a session, an incarnation; None when absent), or the refusal of
    a malformed one (``header``: its name)."""
    if name is not None and (len(name) > _MAX_SESSION_CHARS or not set(name) <= _SESSION_CHARS):
        return Refusal(400, "bad_request", f"{header}: at most {_MAX_SESSION_CHARS} letters, digits, '-' or '_'")
    return name


def _seconds(request: Incoming, default: float) -> float:
    """Return the seconds the query's ``wait_s`` names (``default`` when absent).

    Raises:
        ValueError: It is not a number.
    """
    raw = request.query("wait_s")
    return default if raw is None else float(raw)


def _have(request: Incoming) -> int | None:
    """Return the model version the query's ``have`` names (-1, the default: none), or None when malformed."""
    have = request.query("have", "-1") or ""
    if have == "-1" or (have.isascii() and have.isdigit() and len(have) <= _MAX_ID_DIGITS):
        return int(have)
    return None


def _id(request: Incoming, name: str) -> int | Refusal:
    """Return the path parameter ``name`` as an id, or the refusal of one that is not at most 18 digits."""
    text = str(request.path_params[name])
    if not (text.isascii() and text.isdigit() and len(text) <= _MAX_ID_DIGITS):
        return Refusal(400, "bad_request", f"{name} must be a number of at most {_MAX_ID_DIGITS} digits")
    return int(text)


def _model_response(download: ModelDownload) -> Response:
    if not download.modified:
        return Response(status_code=304, headers={"etag": download.etag, "cache-control": "private, no-cache"})
    headers = ((b"etag", download.etag.encode("latin-1")), (b"cache-control", b"private, no-cache"))
    return Answer(download.payload, 200, _OCTETS, headers)


def _refused(refusal: Refusal) -> Response:
    headers = {"retry-after": str(refusal.retry_after_s)} if refusal.retry_after_s is not None else {}
    if refusal.status == 401:
        headers["www-authenticate"] = "Bearer"
    return JSONResponse(
        {"error": refusal.reason, "detail": refusal.detail}, status_code=refusal.status, headers=headers
    )


async def serve(
    federation: Federation,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
    linger_s: float = 2.0,
    run: Callable[[Federation], Awaitable[RunSummary]] | None = None,
    on_ready: Callable[[int], None] | None = None,
) -> RunSummary:
    """Run ``federation`` and serve it under uvicorn until the run ends; return the run's summary.

    Args:
        federation: A federation with ``remote.enabled``.
        host: Interface to listen on.
        port: TCP port (0: any free port; ``on_ready`` is told which).
        ssl_certfile: PEM certificate for HTTPS (with ``ssl_keyfile``; uvicorn's TLS).
        ssl_keyfile: PEM private key.
        linger_s: Keep answering this long after the run ended, so that waiting clients learn it (410).
        run: Runs the federation (default: ``federation.run()``; the CLI adds its signal handling).
        on_ready: Called with the bound port once the server listens.
    """
    app = asgi_app(federation)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="off",
        http=_FastHeaderDeadline,
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
        timeout_graceful_shutdown=1,
    )
    server = _QuietServer(config)
    serving = asyncio.ensure_future(server.serve())
    try:
        while not server.started:
            if serving.done():
                serving.result()  # raises the reason it could not start (e.g. the port is taken)
                raise OSError(f"could not listen on {host}:{port}")
            await asyncio.sleep(0.02)
        if on_ready is not None:
            on_ready(_bound_port(server, port))
        try:
            summary = await (run(federation) if run is not None else federation.run())
        except Exception:
            # A failed run: clients learn it (410 with the error) for linger_s too, rather than finding no server.
            await _linger(serving, linger_s)
            raise
        # Waiting clients were told the run ended; a client mid-upload learns it within linger_s.
        await _linger(serving, linger_s)
        return summary
    finally:
        server.should_exit = True
        await serving


async def _linger(serving: asyncio.Future[None], linger_s: float) -> None:
    """Keep serving for ``linger_s`` seconds (or until the server stops)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(serving), timeout=linger_s)


def _bound_port(server: Any, default: int) -> int:
    for listener in getattr(server, "servers", []):
        for sock in listener.sockets:
            return int(sock.getsockname()[1])
    return default


class _QuietServer(uvicorn.Server):
    """uvicorn's server without its own signal handlers (the run's handlers stop the run, then the server)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Leave the process's signal handlers alone."""
        yield


class _HeaderDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on a request's headers: a connection that has not sent a whole
    request line and headers :data:`HEADER_TIMEOUT_S` after it opened or started a request is closed (uvicorn's
    keep-alive timeout covers only the silence between requests)."""

    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Start the connection's first deadline."""
        super().connection_made(transport)
        self._deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_late)

    def handle_events(self) -> None:
        """Handle what arrived; keep a deadline while the next request's headers are incomplete."""
        super().handle_events()
        if self.conn.their_state is h11.IDLE:  # the next request's headers are still to come
            if self._deadline is None and not self.transport.is_closing():
                self._deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_late)
        elif self._deadline is not None:  # a whole request line and headers came
            self._deadline.cancel()
            self._deadline = None

    def connection_lost(self, exc: Exception | None) -> None:
        """Drop the deadline with the connection."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        super().connection_lost(exc)

    def _headers_late(self) -> None:
        self._deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


class _FastHeaderDeadline(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol on httptools (llhttp's C parser, the one :func:`serve` runs) with the deadline of
    :class:`_HeaderDeadline` on a request's headers.

    The deadline runs from the moment the connection opened or answered its last request (its next request's
    headers are what is to come) until that request's headers are complete; a request taken in while another was
    answered (pipelined) has its headers already.
    """

    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Start the connection's first deadline."""
        super().connection_made(transport)
        self._arm()

    def on_headers_complete(self) -> None:
        """Drop the deadline: a whole request line and headers came."""
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        """Start the next request's deadline unless that request came whole already (pipelined)."""
        pipelined = bool(self.pipeline)
        super().on_response_complete()
        if not pipelined:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        """Drop the deadline with the connection."""
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._deadline is None and not self.transport.is_closing():
            self._deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_late(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()
