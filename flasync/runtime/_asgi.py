"""The lean request path of a served run: its token-checked endpoints answered straight from the ASGI callable.

A device's exchanges (long-polling for a task, uploading an update, downloading a model) are most of a served run's
requests, and Starlette's per-request layers (its middleware stack, the router trying each route's regular
expression, a ``Request`` with its ``Headers`` and ``QueryParams``) cost about as much of the event loop as the
endpoints' own work. :class:`ServedApp` is the Starlette application of :func:`flasync.runtime.serve.asgi_app` with
a front door: a request whose method and path match one of its :class:`Hot` routes (one dictionary lookup on the
method and the path's first fixed segments, then a comparison of the others) is handed to that route's endpoint as
an :class:`Incoming`, which reads the ASGI scope directly: the headers the endpoint asks for from one dictionary
built once, the query string parsed once, the body read from ``receive``. Every other request (``/v1/status``, a
wrong method, an unknown path) and every request of an application given middleware of its own goes through
Starlette as before. The endpoints are the same in either path: they answer the same statuses, headers and bodies.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from urllib.parse import parse_qsl

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

__all__ = ["Answer", "Endpoint", "Hot", "Incoming", "ServedApp", "read_body"]


class Incoming:
    """One request as an endpoint reads it: straight from the ASGI scope, each part decoded once when first asked.

    Args:
        scope: The request's ASGI scope.
        receive: Its ASGI ``receive`` (the body's chunks).
        path_params: The path's parameters, by name.
    """

    __slots__ = ("_headers", "_query", "path_params", "receive", "scope")

    def __init__(self, scope: Scope, receive: Receive, path_params: dict[str, str]) -> None:
        """Wrap ``scope``; nothing is decoded yet."""
        self.scope = scope
        self.receive = receive
        self.path_params = path_params
        self._headers: dict[bytes, bytes] | None = None
        self._query: dict[str, str] | None = None

    @property
    def address(self) -> str:
        """Return the client's host address (empty when the server does not know it)."""
        client = self.scope.get("client")
        return str(client[0]) if client else ""

    def header(self, name: bytes) -> str | None:
        """Return the first header ``name`` (lower case) holds, decoded as Latin-1, or None when it is absent."""
        headers = self._headers
        if headers is None:
            # ASGI header names are lower case; reversed, so that the first of a repeated header is the one kept.
            headers = self._headers = dict(reversed(self.scope["headers"]))
        value = headers.get(name)
        return None if value is None else value.decode("latin-1")

    def query(self, name: str, default: str | None = None) -> str | None:
        """Return the query parameter ``name`` (its last value, as Starlette's ``query_params`` answers), or
        ``default``."""
        query = self._query
        if query is None:
            query = self._query = parse_query(self.scope.get("query_string", b""))
        return query.get(name, default)

    @classmethod
    def of(cls, request: Request) -> Incoming:
        """Return the request Starlette routed (same scope, ``receive`` and path parameters)."""
        return cls(request.scope, request.receive, {k: str(v) for k, v in request.path_params.items()})


def parse_query(raw: bytes) -> dict[str, str]:
    """Parse a query string as Starlette does (blank values kept, ``+`` and ``%XX`` decoded as UTF-8; a name given
    twice: its last value), without :func:`urllib.parse.parse_qsl`'s work on a query with nothing to decode."""
    text = raw.decode("latin-1")
    if "%" in text or "+" in text:
        return dict(parse_qsl(text, keep_blank_values=True))
    query: dict[str, str] = {}
    for part in text.split("&"):
        if part:
            name, _, value = part.partition("=")
            query[name] = value
    return query


async def read_body(receive: Receive, limit: int, idle_s: float) -> bytes | int | None:
    """Read a request's body from ``receive`` in chunks.

    Args:
        receive: The request's ASGI ``receive``.
        limit: The most bytes read.
        idle_s: The longest wait for a chunk.

    Returns:
        Its bytes; the size read so far once it passes ``limit`` (the rest is never read); None when a chunk took
        longer than ``idle_s`` to come.

    Raises:
        ClientDisconnect: The client went away before its body was whole.
    """
    loop = asyncio.get_running_loop()
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(idle_s) as deadline:  # one deadline, moved on at every chunk
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    raise ClientDisconnect()
                chunk = message.get("body", b"")
                if chunk:
                    size += len(chunk)
                    if size > limit:
                        return size
                    chunks.append(chunk)
                if not message.get("more_body", False):
                    break
                deadline.reschedule(loop.time() + idle_s)
    except TimeoutError:
        return None
    return b"".join(chunks)  # one chunk: that very object, not a copy


class Answer(Response):
    """A response of bytes with raw headers: what Starlette's ``Response(body, status, headers=..., media_type=...)``
    sends (the headers given, then its length and type), without converting a header mapping for each answer.

    Args:
        body: The body.
        status: The status code (one with a body: 200, 202, ...).
        media_type: The content type.
        headers: Headers before the length and type, as (lower-case name, value) bytes.
    """

    def __init__(
        self, body: bytes, status: int, media_type: bytes, headers: Sequence[tuple[bytes, bytes]] = ()
    ) -> None:
        """Keep the answer's parts."""
        self.status_code = status
        self.body = body
        self.background = None
        self.raw_headers = [*headers, (b"content-length", b"%d" % len(body)), (b"content-type", media_type)]


Endpoint = Callable[[Incoming], Awaitable[Response]]
"""An endpoint: answers one request."""


@dataclass(frozen=True, slots=True)
class Hot:
    """A route answered by the front door, and by Starlette's router in the application's route list too.

    Attributes:
        method: Its HTTP method.
        path: Its path, with ``{name}`` for a parameter (one whole segment: non-empty, no ``/``).
        endpoint: What answers it.
    """

    method: str
    path: str
    endpoint: Endpoint

    def route(self) -> Route:
        """Return the route Starlette's router answers it with (the same endpoint, given the request routed)."""
        endpoint = self.endpoint

        async def routed(request: Request) -> Response:
            return await endpoint(Incoming.of(request))

        return Route(self.path, routed, methods=[self.method])


class _Template:
    """A :class:`Hot` route's path split into segments: each fixed one compared, each ``{name}`` one taken."""

    __slots__ = ("endpoint", "fixed", "names")

    def __init__(self, hot: Hot) -> None:
        """Split ``hot``'s path."""
        segments = hot.path.split("/")
        self.endpoint = hot.endpoint
        self.fixed = [(i, s) for i, s in enumerate(segments) if not s.startswith("{")]
        self.names = [(i, s[1:-1]) for i, s in enumerate(segments) if s.startswith("{")]

    def match(self, segments: Sequence[str]) -> dict[str, str] | None:
        """Return the path parameters of a path split into ``segments`` (as many as the template's), or None when
        it is not this route's."""
        for index, segment in self.fixed:
            if segments[index] != segment:
                return None
        params = {name: segments[index] for index, name in self.names}
        return params if all(params.values()) else None


def _key(method: str, segments: Sequence[str]) -> tuple[str, int, str]:
    """Return the lookup key of a path split into ``segments``: method, number of segments, the third (the
    resource's name: ``task``, ``tasks``, ``models``, ...; a template's is fixed)."""
    return method, len(segments), segments[2] if len(segments) > 2 else ""


class ServedApp(Starlette):
    """A Starlette application whose :class:`Hot` routes are answered before Starlette's layers.

    Args:
        hot: The routes answered by the front door (also in Starlette's route list, after them).
        routes: The application's other routes.
    """

    def __init__(self, hot: Sequence[Hot], routes: Sequence[BaseRoute]) -> None:
        """Index ``hot`` by method, number of path segments and resource name."""
        super().__init__(routes=[*(h.route() for h in hot), *routes])
        self._hot: dict[tuple[str, int, str], list[_Template]] = {}
        for route in hot:
            template = _Template(route)
            self._hot.setdefault(_key(route.method, route.path.split("/")), []).append(template)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer a hot route's request directly, any other through Starlette."""
        if scope["type"] == "http" and not self.user_middleware:
            found = self._find(scope)
            if found is not None:
                endpoint, params = found
                try:
                    response = await endpoint(Incoming(scope, receive, params))
                except ClientDisconnect:
                    return  # nobody to answer
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    def _find(self, scope: Scope) -> tuple[Endpoint, dict[str, str]] | None:
        """Return the endpoint and path parameters of a hot route's request (None: Starlette answers it)."""
        path: str = scope["path"]
        root: str = scope.get("root_path", "")
        if root and path.startswith(root) and path[len(root) : len(root) + 1] == "/":
            path = path[len(root) :]  # mounted: the route's path is what follows the mount's
        segments = path.split("/")
        for template in self._hot.get(_key(scope["method"], segments), ()):
            params = template.match(segments)
            if params is not None:
                return template.endpoint, params
        return None
