"""The front door's reading of a request: query, headers and body as Starlette reads them."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from starlette.datastructures import Headers, QueryParams
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from flasync.runtime._asgi import Answer, Hot, Incoming, ServedApp, parse_query, read_body

_QUERIES = [
    b"",
    b"wait_s=5",
    b"wait_s=0.5&model=inline&have=-1",
    b"wait_s=",
    b"wait_s",
    b"&&wait_s=1&",
    b"=3&have=1&have=2",
    b"a=b=c",
    b"wait_s=0%2E5&after=1%2F2",
    b"session=a+b&x=%E2%82%AC",
    b"x=%ZZ&y=%",
    b"name=\xe9t\xe9",
    b"name=\xe9t%C3%A9",
]


@pytest.mark.parametrize("raw", _QUERIES)
def test_a_query_reads_as_starlettes(raw: bytes) -> None:
    """Each query parameter has the value Starlette's ``query_params`` gives it (its last, blank ones kept, ``+``
    and ``%XX`` decoded), with or without anything to decode."""
    expected = QueryParams(raw)
    parsed = parse_query(raw)
    assert parsed == dict(expected.items())
    incoming = Incoming({"query_string": raw}, _never, {})
    for name in {*expected.keys(), "absent"}:
        assert incoming.query(name) == expected.get(name)
    assert incoming.query("absent", "-1") == "-1"


def test_headers_read_as_starlettes() -> None:
    """A header is its first value, decoded as Latin-1; an absent one is None; the client's address is the
    scope's."""
    raw = [(b"authorization", b"Bearer one"), (b"x-flasync-session", b"s\xe9"), (b"authorization", b"Bearer two")]
    incoming = Incoming({"headers": raw, "client": ("10.0.0.7", 5000)}, _never, {})
    headers = Headers(raw=raw)
    for name in ("authorization", "x-flasync-session", "content-length"):
        assert incoming.header(name.encode()) == headers.get(name)
    assert incoming.address == "10.0.0.7"
    assert Incoming({"headers": []}, _never, {}).address == ""


async def _never() -> dict[str, Any]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def _chunks(*messages: dict[str, Any]) -> Callable[[], Awaitable[dict[str, Any]]]:
    queue = list(messages)

    async def receive() -> dict[str, Any]:
        return queue.pop(0) if queue else await _never()

    return receive


async def test_a_body_is_read_whole_bounded_or_timed_out() -> None:
    """Its chunks joined; the size read once past the limit (nothing more read); None once a chunk is late; a
    disconnect raises ClientDisconnect."""
    whole = _chunks(
        {"type": "http.request", "body": b"ab", "more_body": True},
        {"type": "http.request", "body": b"", "more_body": True},
        {"type": "http.request", "body": b"cd"},
    )
    assert await read_body(whole, 4, 5.0) == b"abcd"
    assert await read_body(_chunks({"type": "http.request"}), 4, 5.0) == b""
    over = _chunks({"type": "http.request", "body": b"abc", "more_body": True}, {"type": "http.request", "body": b"de"})
    assert await read_body(over, 4, 5.0) == 5
    late = _chunks({"type": "http.request", "body": b"ab", "more_body": True})
    assert await read_body(late, 4, 0.01) is None
    with pytest.raises(ClientDisconnect):
        await read_body(_chunks({"type": "http.disconnect"}), 4, 5.0)


async def test_the_front_door_matches_whole_segments_only() -> None:
    """A hot route's request is answered with its path parameters; an empty parameter, another number of segments
    or another method goes to Starlette's router (404 or 405 here)."""
    seen: list[dict[str, str]] = []

    async def endpoint(request: Incoming) -> Response:
        seen.append(request.path_params)
        return Response(b"ok")

    app = ServedApp([Hot("POST", "/v1/tasks/{task_id}/update", endpoint)], [])
    answers = [await _status(app, method, path) for method, path in _PATHS]
    assert answers == [200, 404, 404, 405, 404]
    assert seen == [{"task_id": "12"}]
    assert app.middleware_stack is not None  # the other requests went through Starlette


_PATHS = [
    ("POST", "/v1/tasks/12/update"),
    ("POST", "/v1/tasks//update"),
    ("POST", "/v1/tasks/1/2/update"),
    ("GET", "/v1/tasks/12/update"),
    ("POST", "/v1/tasks/12/updated"),
]


async def _status(app: ServedApp, method: str, path: str) -> int:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": [], "query_string": b"", "root_path": ""}
    await app(scope, _chunks({"type": "http.request"}), send)
    status: int = sent[0]["status"]
    return status


@pytest.mark.parametrize("body", [b"", b"\x00model bytes"])
def test_an_answer_sends_what_starlettes_response_sends(body: bytes) -> None:
    """Status, headers in order (those given, then the length and type) and body are Starlette's."""
    given = {"x-flasync-offer": '{"task_id":3}', "etag": '"ab12"'}
    expected = Response(body, 202, media_type="application/octet-stream", headers=given)
    answer = Answer(body, 202, b"application/octet-stream", [(k.encode(), v.encode()) for k, v in given.items()])
    assert (answer.status_code, answer.raw_headers, answer.body) == (202, expected.raw_headers, expected.body)
