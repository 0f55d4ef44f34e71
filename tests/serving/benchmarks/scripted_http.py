"""A scripted HTTP/1.1 server for client-side tests: bench serve's HTTP client and its load modes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class ScriptedServer:
    """Answers each request on a connection with the next reply of `replies`; counts connections and
    keeps what it received."""

    def __init__(self, replies: list[list[bytes]]) -> None:
        self.replies = list(replies)
        self.num_connections = 0
        self.requests: list[bytes] = []
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            while self.replies:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                self.requests.append(head + await reader.readexactly(length))
                reply = self.replies.pop(0)
                if not reply:  # CLOSE: the connection ends without an answer
                    break
                for piece in reply:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0)  # separate reads on the client where the pieces are separate
                head = reply[0].lower()
                if b"connection: close" in head or not (b"content-length" in head or b"chunked" in head):
                    break  # the body ends with the connection
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[ScriptedServer]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        async with server:
            yield self


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


CLOSE: list[bytes] = []
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
