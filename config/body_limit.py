"""A cap on request bodies before any of them is read: Django's ASGI handler spools a whole body to a
temporary file before a view (or an API key check) runs, and uvicorn sets no limit, so without this a
client with no key at all could fill the disk with a few multi-GB POSTs. Bodies over
settings.MAX_REQUEST_BYTES get the JSON error with 413: at once when Content-Length says so, else as
soon as the bytes received pass it (a chunked body), and the app then reads a disconnect."""

from __future__ import annotations

import json
from typing import Any

from registry.errors import error_body


def body_limited(app: Any, limit: int) -> Any:
    async def limited(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await _too_large(send, limit)
            return
        received = 0
        answered = False

        async def counted() -> dict[str, Any]:
            nonlocal received, answered
            if answered:
                return {"type": "http.disconnect"}
            message: dict[str, Any] = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    answered = True
                    await _too_large(send, limit)
                    return {"type": "http.disconnect"}
            return message

        async def unless_answered(message: dict[str, Any]) -> None:
            if not answered:
                await send(message)

        await app(scope, counted, unless_answered)

    return limited


async def _too_large(send: Any, limit: int) -> None:
    body = json.dumps(error_body(413, f"request body over {limit} bytes")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
