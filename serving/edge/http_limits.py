"""The HTTP server's own limits, checked while a request is read, before any of it reaches the app.

uvicorn's httptools parser sets none: a request with 20,000 headers, or one header of 8 MiB, was read
whole and answered 200, and a request whose headers never finish held its connection for as long as the
client liked. This protocol (uvicorn's, with the checks added) answers, and closes the connection:
- 431 when a request's line and headers pass EDGE_MAX_HEADER_BYTES or its headers EDGE_MAX_HEADERS; what
  the client sends after that is not read;
- 408 when the line and headers have not all come within EDGE_HEADER_TIMEOUT_S of the request's first byte
  (or of the connection's opening: a connection that sends nothing is closed too);
- and a body that has not all come within EDGE_BODY_TIMEOUT_S of its headers ends the connection (the app
  reads a disconnect, as for a client that left).
- 503 with Retry-After, for HTTP requests and WebSocket handshakes alike, when the server holds more than
  EDGE_MAX_CONNECTIONS connections or runs that many requests. uvicorn's own `limit_concurrency` answered
  plain text and let WebSocket handshakes through; serve.py sets it one above the cap, so that it never
  answers first.
Bodies are capped by size elsewhere (config/body_limit.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import Any

from django.conf import settings
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from registry.errors import error_body

# How long a refused connection drains the client's bytes before it closes.
LINGER_S = 2.0
_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}
# A refused connection's Retry-After: connections end as streams finish, in seconds rather than minutes.
BUSY_RETRY_AFTER_S = 1
WARN_EVERY_S = 10.0
logger = logging.getLogger(__name__)


_warned_at = -math.inf


def _warn_at_capacity() -> None:
    """Said at most once per WARN_EVERY_S: a flood of refusals is one line, not one per request."""
    global _warned_at
    if time.monotonic() - _warned_at >= WARN_EVERY_S:
        _warned_at = time.monotonic()
        cap = settings.EDGE_MAX_CONNECTIONS
        logger.warning("connection cap (%d) reached: requests refused with 503", cap)


class LimitedHttpToolsProtocol(HttpToolsProtocol):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._max_header_bytes: int = settings.EDGE_MAX_HEADER_BYTES
        self._max_headers: int = settings.EDGE_MAX_HEADERS
        self._header_bytes = 0
        self._num_headers = 0
        self._is_refused = False  # answered 408/431: nothing more is read
        self._deadline: asyncio.TimerHandle | None = None

    # --- the deadlines -----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(settings.EDGE_HEADER_TIMEOUT_S, self._headers_too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, seconds: float, on_expiry: Any) -> None:
        self._disarm()
        if seconds > 0:
            self._deadline = self.loop.call_later(seconds, on_expiry)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_too_slow(self) -> None:
        self._deadline = None
        self._refuse(408, "the request's headers did not arrive in time")

    def _body_too_slow(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()  # the app's receive() reads a disconnect

    # --- parsing -----------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._is_refused:
            return
        super().data_received(data)

    def handle_websocket_upgrade(self) -> None:
        # The parser stops at an upgrade's headers and uvicorn hands the connection over, even when
        # on_headers_complete refused it (the 503 or a 431 sent): a refused one goes nowhere.
        if not self._is_refused:
            super().handle_websocket_upgrade()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = self._num_headers = 0
        # Between requests of a kept-alive connection uvicorn's own keep-alive timeout runs; from the
        # next request's first byte, its headers have this long.
        self._arm(settings.EDGE_HEADER_TIMEOUT_S, self._headers_too_slow)

    def on_url(self, url: bytes) -> None:
        if self._is_refused or not self._count(len(url), headers=0):
            return
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._is_refused or not self._count(len(name) + len(value), headers=1):
            return
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._is_refused:
            return
        self._disarm()
        if self._is_over_capacity():
            _warn_at_capacity()
            self._refuse(503, "the server is at its connection limit", retry_after_s=BUSY_RETRY_AFTER_S)
            return
        super().on_headers_complete()
        if self.parser is not None and not self.parser.should_upgrade():
            self._arm(settings.EDGE_BODY_TIMEOUT_S, self._body_too_slow)

    def on_body(self, body: bytes) -> None:
        if not self._is_refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._is_refused:
            return
        self._disarm()
        super().on_message_complete()

    def _is_over_capacity(self) -> bool:
        """More connections than the cap (this one counted), or as many requests running."""
        cap: int = settings.EDGE_MAX_CONNECTIONS
        return len(self.connections) > cap or len(self.tasks) >= cap

    def _count(self, num_bytes: int, *, headers: int) -> bool:
        """Count part of the request line or a header; False (and a 431) once past a limit."""
        self._header_bytes += num_bytes
        self._num_headers += headers
        if self._header_bytes > self._max_header_bytes or self._num_headers > self._max_headers:
            limits = f"{self._max_headers} headers, {self._max_header_bytes} bytes"
            self._refuse(431, f"request headers over the limit ({limits})")
            return False
        return True

    def _refuse(self, status: int, message: str, *, retry_after_s: int | None = None) -> None:
        """Answer with the JSON error and close, before the app saw anything of the request."""
        if self._is_refused or self.transport.is_closing():
            return
        self._is_refused = True
        self._disarm()
        body = json.dumps(error_body(status, message)).encode()
        head = [
            b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status]),
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"" if retry_after_s is None else b"retry-after: %d\r\n" % retry_after_s,
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        # Half-closed, then closed a moment later: what the client is still sending meanwhile is
        # drained unparsed (data_received drops it). Closed at once with bytes unread, the socket would
        # send a reset, and the client could lose the answer before reading it.
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)
