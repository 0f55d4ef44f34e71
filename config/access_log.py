"""The access log: one line per HTTP request (and per WebSocket, when it closes) on the
`switchyard.access` logger: method, path, status, duration and the tenant whose key authenticated it.
Never the key, the query string or the body (a prompt): docs/configuration.md, "Logs". On by default;
SWITCHYARD_ACCESS_LOG=0 turns it off. uvicorn's own access log stays off (serve.py), and daphne's goes to
its own logger, so under either server this is the one line per request."""

from __future__ import annotations

import logging
import time
from typing import Any

from registry import request_tenant

logger = logging.getLogger("switchyard.access")


def access_logged(app: Any) -> Any:
    async def logged(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await app(scope, receive, send)
            return
        record = request_tenant.begin()
        began = time.perf_counter()
        status: list[int | str] = ["-"]

        async def noted(message: dict[str, Any]) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                status[0] = message["status"]
            elif kind == "websocket.accept":
                status[0] = 101
            elif kind == "websocket.close" and status[0] == "-":
                status[0] = f"close {message.get('code', 1000)}"  # refused before it was accepted
            elif kind == "websocket.http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await app(scope, receive, noted)
        finally:
            method = scope.get("method", "WS") if scope["type"] == "http" else "WS"
            logger.info(
                "%s %s %s %.1f ms tenant=%s",
                method,
                scope.get("path", ""),
                status[0],
                (time.perf_counter() - began) * 1000,
                "-" if record.tenant_id is None else record.tenant_id,
            )

    return logged
