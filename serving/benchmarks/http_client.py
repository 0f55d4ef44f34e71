"""`bench serve`'s HTTP client: HTTP/1.1 on asyncio streams, connections kept alive and reused, no
client library.

The client shares the machine with what it measures, and whatever it spends between writing a request
and reading the first token's bytes counts in that request's TTFT. aiohttp (already leaner than httpx
here) spent ~0.5 ms more of it per request than this, requests one at a time on a 2-core machine
(docs/architecture.md, "The benchmark's own HTTP client"): building the request and parsing the stream line by
line. This one writes the request in one call and times each event when the bytes carrying it were read,
before any JSON is parsed. It speaks only what the benchmark needs: a POST with a JSON body, a response framed
by Content-Length, chunked transfer coding or the connection's end, and server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

_MAX_HEAD_BYTES = 64 * 1024


class HttpProtocolError(Exception):
    """The server's response could not be read as HTTP/1.1."""


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@dataclass(slots=True)
class Response:
    status: int
    headers: dict[str, str]  # names lower-cased
    _client: HttpClient
    _connection: Connection
    _is_done: bool = False

    async def read(self) -> bytes:
        """The whole body."""
        return b"".join([chunk async for chunk, _ in self._chunks()])

    async def sse_data(self) -> AsyncIterator[tuple[bytes, float]]:
        """Each server-sent event's data, with the perf_counter time at which the bytes that completed
        the event were read. Lines may end in LF, CRLF or CR; an event's `data` lines (a space after
        "data:" or none) are joined with LF, and comment lines and other fields are skipped. An event
        the body ends in, before its blank line, is dropped, as the SSE spec has it: it may be cut."""
        buffer = b""
        skip_lf = False  # the last chunk ended in CR: an LF starting the next one ends the same line
        async for chunk, read_at in self._chunks():
            if skip_lf and chunk:
                chunk = chunk[1:] if chunk[:1] == b"\n" else chunk
                skip_lf = False
            if b"\r" in chunk:
                skip_lf = chunk.endswith(b"\r")
                chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                # The platform's events: one "data: " line each.
                if event.startswith(b"data: ") and b"\n" not in event:
                    yield event[6:], read_at
                elif (data := _event_data(event)) is not None:
                    yield data, read_at

    async def _chunks(self) -> AsyncIterator[tuple[bytes, float]]:
        reader = self._connection[0]
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size_line = await _read_line(reader)
                try:
                    size = int(size_line.split(b";", 1)[0], 16)  # a chunk extension after ";" is ignored
                except ValueError:
                    size = -1
                if size < 0:
                    raise HttpProtocolError(f"bad chunk size line {size_line!r}")
                if size == 0:
                    while await _read_line(reader) != b"\r\n":
                        pass  # trailers, up to the empty line that ends the body
                    break
                data = await reader.readexactly(size + 2)
                if data[-2:] != b"\r\n":
                    raise HttpProtocolError("a chunk does not end where its size says")
                yield data[:-2], time.perf_counter()
            self._finish(reusable=True)
        elif "content-length" in self.headers:
            length = _content_length(self.headers["content-length"])
            data = await reader.readexactly(length) if length else b""
            self._finish(reusable=True)
            yield data, time.perf_counter()
        else:  # delimited by the connection's end
            while data := await reader.read(65536):
                yield data, time.perf_counter()
            self._finish(reusable=False)

    def _finish(self, *, reusable: bool) -> None:
        self._is_done = True
        keep = reusable and self.headers.get("connection", "").lower() != "close"
        self._client._release(self._connection, keep=keep)

    def close(self) -> None:
        """Give the connection back: reused if the body was read to its end, closed otherwise."""
        if not self._is_done:
            self._is_done = True
            self._client._release(self._connection, keep=False)


def _event_data(event: bytes) -> bytes | None:
    """The data of one event's lines (LF-separated): its `data` fields joined with LF; None without any."""
    data = []
    for line in event.split(b"\n"):
        if not line or line.startswith(b":"):  # a comment
            continue
        name, _, value = line.partition(b":")
        if name == b"data":
            data.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(data) if data else None


async def _read_line(reader: asyncio.StreamReader) -> bytes:
    try:
        return await reader.readuntil(b"\r\n")
    except asyncio.LimitOverrunError as exc:
        raise HttpProtocolError("a line of the response is too long") from exc


def _content_length(value: str) -> int:
    if not value.isdigit():
        raise HttpProtocolError(f"bad Content-Length {value!r}")
    return int(value)


class HttpClient:
    """Requests to one origin over at most `max_connections` kept-alive connections."""

    def __init__(self, base_url: str, *, max_connections: int = 100) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if parts.scheme == "https" else None
        self._host_header = parts.netloc.rsplit("@", 1)[-1]
        self._base_path = parts.path.rstrip("/")
        self._idle: list[Connection] = []
        self._slots = asyncio.Semaphore(max_connections)

    @contextlib.asynccontextmanager
    async def post(
        self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> AsyncIterator[Response]:
        """POST `body` as JSON; the response's head has been read when this yields."""
        payload = json.dumps(body, separators=(",", ":")).encode()
        lines = [
            f"POST {self._base_path}{path} HTTP/1.1",
            f"Host: {self._host_header}",
            "Content-Type: application/json",
            f"Content-Length: {len(payload)}",
            *(f"{name}: {value}" for name, value in (headers or {}).items()),
        ]
        request = ("\r\n".join(lines) + "\r\n\r\n").encode() + payload
        await self._slots.acquire()
        response: Response | None = None
        try:
            connection, is_reused = await self._connection()
            while response is None:
                try:
                    response = await self._send(connection, request)
                except BaseException as exc:
                    self._release(connection, keep=False)
                    # A kept-alive connection the server closed as it was reused (an idle timeout),
                    # before a byte of the response (_send says when bytes came): the request was not
                    # read there. Once more, on a new connection, which is not retried.
                    if not (is_reused and isinstance(exc, (ConnectionError, asyncio.IncompleteReadError))):
                        raise
                    connection, is_reused = await self._connection(fresh=True)
            yield response
        finally:
            if response is not None:
                response.close()
            self._slots.release()

    async def _connection(self, *, fresh: bool = False) -> tuple[Connection, bool]:
        """A connection, and whether it is a kept-alive one being reused."""
        while self._idle and not fresh:
            reader, writer = self._idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return (reader, writer), True
            writer.close()
        return await asyncio.open_connection(self._host, self._port, ssl=self._ssl), False

    async def _send(self, connection: Connection, request: bytes) -> Response:
        reader, writer = connection
        writer.write(request)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError as exc:
            raise HttpProtocolError("the response head is too long") from exc
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise HttpProtocolError("the connection closed within the response head") from exc
            raise
        if len(head) > _MAX_HEAD_BYTES:
            raise HttpProtocolError("the response head is too long")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        try:
            version, status, *_ = status_line.split(" ", 2)
            if not version.startswith("HTTP/1."):
                raise ValueError(version)
            code = int(status)
        except ValueError as exc:
            raise HttpProtocolError(f"bad status line {status_line!r}") from exc
        headers: dict[str, str] = {}
        for line in header_lines:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        return Response(code, headers, self, connection)

    def _release(self, connection: Connection, *, keep: bool) -> None:
        if keep:
            self._idle.append(connection)
        else:
            connection[1].close()

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
