"""New requests while the server drains for its stop (config/server_process.py): an HTTP request gets a
503 `server_shutting_down` with Retry-After and `Connection: close`, a WebSocket handshake is closed with
1012 (service restart), so a client retries elsewhere rather than start what the stop would cut. uvicorn
also stops reading new requests itself; daphne does not, so this is what holds there (docs/architecture.md,
"One start path for uvicorn and daphne")."""

from __future__ import annotations

import json
from typing import Any

from config.server_process import SERVER_PROCESS
from registry.errors import error_body
from serving.transport.protocol import SERVER_SHUTTING_DOWN, SERVER_SHUTTING_DOWN_MESSAGE

CLOSE_SERVICE_RESTART = 1012


def refused_while_draining(app: Any) -> Any:
    async def guarded(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not SERVER_PROCESS.is_draining or scope["type"] not in ("http", "websocket"):
            await app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": CLOSE_SERVICE_RESTART})
            return
        body = json.dumps(error_body(503, SERVER_SHUTTING_DOWN_MESSAGE, SERVER_SHUTTING_DOWN)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"retry-after", b"1"),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return guarded
