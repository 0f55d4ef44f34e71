"""What the ASGI app answers where nothing else does, instead of an exception and a traceback.

A WebSocket handshake on a path no route matches (`/nope`, `/v1/models/x/stream/extra`, a path with
`..` in it) would make Channels' URLRouter raise "No route found", which the server turns into a 500 and a
logged traceback, for a client that need not even hold a key. It gets the documented JSON error with 404
instead, as an HTTP response to the handshake where the server offers that (the ASGI "websocket.http.response"
extension; uvicorn does), else a close before accept, which the server answers with 403.

A static file path that leaves the static root (`/static/%2e%2e/config/settings.py`) would make Django's
static handler raise SuspiciousFileOperation, unhandled there: it is a 404, as any other file not found."""

from __future__ import annotations

import json
from typing import Any

from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core.exceptions import SuspiciousFileOperation
from django.http import Http404, HttpRequest, HttpResponseBase

from registry.errors import error_body


async def unrouted_websocket(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The last WebSocket route: refuse the handshake with a 404."""
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    if "websocket.http.response" in (scope.get("extensions") or {}):
        body = json.dumps(error_body(404, "no WebSocket route at this path")).encode()
        await send(
            {
                "type": "websocket.http.response.start",
                "status": 404,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008})


class ContainedStaticFilesHandler(ASGIStaticFilesHandler):  # type: ignore[misc]
    """Django's static handler, for the embedded server (SERVE_STATIC), with paths outside the root a 404."""

    def serve(self, request: HttpRequest) -> HttpResponseBase:
        try:
            return super().serve(request)
        except SuspiciousFileOperation as exc:
            raise Http404("no such static file") from exc
