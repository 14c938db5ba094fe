"""A lean HTTP/1.1 client for load generators: one keep-alive connection per simulated device, little CPU per request.

httpx costs its caller a few hundred microseconds of CPU per request; a load process driving hundreds of devices on
the cores the server runs on then measures itself more than the server. :class:`Connection` sends a request over
one persistent TCP connection (opened on first use, opened again after an error or a ``Connection: close``) and reads
an answer with a ``Content-Length`` (what uvicorn sends for flasync's endpoints), nothing more: no redirects, no
chunked bodies, no TLS. Its :meth:`Connection.request` has the shape of httpx's, so a device can use either.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode, urlsplit

__all__ = ["Answer", "Connection", "WireError"]


class WireError(OSError):
    """The connection broke or the answer was not one this client reads (chunked, malformed)."""


@dataclass(frozen=True, slots=True)
class Answer:
    """An HTTP answer: its status, its headers (lower-case names) and its body."""

    status_code: int
    headers: dict[str, str]
    content: bytes

    def json(self) -> Any:
        """Return the body decoded as JSON."""
        return json.loads(self.content)


class Connection:
    """One device's persistent connection to ``base_url`` (``http://HOST:PORT``).

    Args:
        base_url: Where requests go.
        timeout_s: Longest wait for a whole answer; a request past it closes the connection and raises
            :class:`TimeoutError`.
    """

    def __init__(self, base_url: str, timeout_s: float) -> None:
        """Keep the address (the connection opens on the first request)."""
        parts = urlsplit(base_url)
        self._host, self._port = parts.hostname or "127.0.0.1", parts.port or 80
        self._host_header = f"host: {parts.netloc}\r\n".encode()
        self._timeout_s = timeout_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        headers: dict[str, str] | None = None,
        params: dict[str, Any] | None = None,
        content: bytes = b"",
    ) -> Answer:
        """Send one request and return its answer.

        Raises:
            TimeoutError: No whole answer within the timeout (the connection is closed).
            WireError: The connection broke or the answer could not be read (the connection is closed).
        """
        target = f"{path}?{urlencode(params)}" if params else path
        lines = [f"{method} {target} HTTP/1.1\r\n".encode(), self._host_header]
        lines += [f"{name}: {value}\r\n".encode() for name, value in (headers or {}).items()]
        if content or method == "POST":
            lines.append(f"content-length: {len(content)}\r\n".encode())
        lines.append(b"\r\n")
        try:
            async with asyncio.timeout(self._timeout_s):
                return await self._exchange(b"".join(lines), content)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            self.close()
            raise WireError(f"{method} {path}: {exc!r}") from None
        except TimeoutError:
            self.close()
            raise

    async def _exchange(self, head: bytes, content: bytes) -> Answer:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self._host, self._port)
        reader, writer = self._reader, self._writer
        assert reader is not None
        writer.write(head + content if len(content) < 65536 else head)
        if len(content) >= 65536:
            writer.write(content)
        await writer.drain()
        status_line, *header_lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(status_line.split(" ", 2)[1])
        answer_headers: dict[str, str] = {}
        for line in header_lines:
            if line:
                name, _, value = line.partition(":")
                answer_headers[name.strip().lower()] = value.strip()
        if "chunked" in answer_headers.get("transfer-encoding", ""):
            raise ValueError("chunked answers are not read")
        length = int(answer_headers.get("content-length", "0"))
        body = await reader.readexactly(length) if length else b""
        if answer_headers.get("connection", "").lower() == "close":
            self.close()
        return Answer(status, answer_headers, body)

    def close(self) -> None:
        """Close the connection (the next request opens another)."""
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    async def aclose(self) -> None:
        """Close the connection and wait until it is closed."""
        writer = self._writer
        self.close()
        if writer is not None:
            with contextlib.suppress(OSError):
                await writer.wait_closed()
