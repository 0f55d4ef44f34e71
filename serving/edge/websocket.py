"""WebSocket streaming: `ws://host/v1/models/{model}/stream`.

Auth by the `Authorization: Bearer` header of the handshake, or by a first message `{"type": "auth",
"api_key": "..."}`. Then `{"type": "infer", "input": ..., "max_tokens": ..., ...}` (the /infer body without
`stream`) starts a generation; the server answers `{"type": "token", "token", "index"}` per token and
`{"type": "done", "finish_reason", "usage", "timings", "version"}` at the end, or `{"type": "error", "error":
{"type", "message"}}`, with `"retry_after"` (whole seconds, as HTTP's Retry-After) and `"retry_after_ms"` (as
retry-after-ms) on a refusal worth retrying (a 429, a 503), and `"version"` on a request a replica refused (a
prompt too long for its model); an error that ends a generation also carries `"finish_reason": "error"` and
the version that served it. `{"type": "cancel"}` stops the generation in flight and frees its blocks on the
replica. One generation at a time per connection. A client that stops reading is cut off
(serving/transport/reply_hub.py): its generation is aborted, and once it reads again it gets an error of type
"slow_reader" and the connection closes with code 4408. A frame that is not a JSON text message gets an error
and the connection closes: 1003 for a binary frame, 1007 for text that is not JSON (RFC 6455's codes for data
the endpoint cannot take). A message over MAX_REQUEST_BYTES (the limit on an HTTP body) gets an error of type
"request_too_large" and the close code 1009; the server itself closes with 1009 alone on a frame over four
times that, which it will not buffer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings

from registry.errors import error_body
from registry.selectors import TenantContext
from serving.edge.request_bodies import InferRequest, loads_json, parse_infer
from serving.gateway.dispatch import authenticate, dispatch
from serving.gateway.errors import GatewayError
from serving.gateway.in_flight import InFlightRequest, close_all
from serving.gateway.service_tiers import grant_tier
from serving.transport.protocol import KEY_REVOKED, SLOW_READER, SLOW_READER_MESSAGE

logger = logging.getLogger(__name__)
CLOSE_UNAUTHENTICATED = 4401
CLOSE_SLOW_READER = 4408
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_INVALID_PAYLOAD = 1007
CLOSE_MESSAGE_TOO_BIG = 1009
CLOSE_TRY_AGAIN_LATER = 1013


class InferenceStreamConsumer(AsyncJsonWebsocketConsumer):  # type: ignore[misc]
    context: TenantContext | None = None
    authorization: str = ""  # as authenticated: each infer checks it again (a cache hit, mostly)
    task: asyncio.Task[None] | None = None
    # The task's generation has sent its final message: what is left of the task is closing its request
    # (the quota's release, a Redis round trip), which a client's next infer waits out, not a 409.
    has_ended: bool = False
    is_closing: bool = False  # this side closed the socket: messages still queued behind that are dropped
    auth_deadline: asyncio.Task[None] | None = None  # closes a socket that never authenticates

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.auth_deadline is not None:
                self.auth_deadline.cancel()
            # However the consumer ended: a handler that raised (a send to a socket the client had just
            # dropped) ends it before disconnect() runs, and the generation would run on, holding its
            # blocks and its quota slot.
            await self._cancel()

    def _header(self, name: bytes) -> str | None:
        for key, value in self.scope.get("headers", ()):
            if key.lower() == name:
                return str(value.decode("latin-1"))
        return None

    def _client(self) -> str | None:
        client = self.scope.get("client")
        return str(client[0]) if client else None

    async def connect(self) -> None:
        await self.accept()
        authorization = self._header(b"authorization")
        if authorization is not None:
            await self._authenticate(authorization)
        if self.context is None and not self.is_closing:
            # An open socket costs the server a task and buffers whoever holds it; one that has not said
            # who it is within the deadline is closed as unauthenticated.
            self.auth_deadline = asyncio.get_running_loop().create_task(self._close_unless_authenticated())

    async def _close_unless_authenticated(self) -> None:
        deadline_s = settings.WS_AUTH_DEADLINE_S
        await asyncio.sleep(deadline_s)
        if self.context is None and not self.is_closing:
            await self._error(
                GatewayError(401, f"authenticate within {deadline_s:g} s of opening the socket")
            )
            await self._close(CLOSE_UNAUTHENTICATED)

    async def _authenticate(self, authorization: str) -> None:
        try:
            self.context = await authenticate(authorization, client=self._client())
            self.authorization = authorization
        except GatewayError as exc:
            await self._error(exc)
            # A key that could not be checked (the database down, for a key not seen lately) is no bad
            # key: 1013 tells the client to come back, where 4401 tells it to stop.
            await self._close(CLOSE_UNAUTHENTICATED if exc.status == 401 else CLOSE_TRY_AGAIN_LATER)

    async def _close(self, code: int) -> None:
        self.is_closing = True
        await self.close(code=code)

    async def _error(self, exc: GatewayError) -> None:
        message = {"type": "error", **error_body(exc.status, exc.message)}
        if exc.retry_after is not None:  # a 429 or a 503: when to try again, as HTTP's Retry-After says it
            message["retry_after"] = exc.retry_after
            message["retry_after_ms"] = exc.retry_after_ms
        if "X-Served-Version" in exc.served_by:  # a replica refused it: which version did
            message["version"] = exc.served_by["X-Served-Version"]
        with contextlib.suppress(Exception):  # the client gone (or this side closing): nothing to tell
            await self.send_json(message)

    async def receive(
        self, text_data: str | None = None, bytes_data: bytes | None = None, **kwargs: Any
    ) -> None:
        if self.is_closing:
            return
        if text_data is None:
            await self._error(GatewayError(400, "send JSON messages in text frames, not binary ones"))
            await self._close(CLOSE_UNSUPPORTED_DATA)
            return
        # A UTF-8 character is at most 4 bytes: only a message that long can be over, and only it is encoded.
        if (
            len(text_data) * 4 > settings.MAX_REQUEST_BYTES
            and _utf8_size(text_data) > settings.MAX_REQUEST_BYTES
        ):
            await self._error(GatewayError(413, f"message over {settings.MAX_REQUEST_BYTES} bytes"))
            await self._close(CLOSE_MESSAGE_TOO_BIG)
            return
        try:
            content = loads_json(text_data)
        except ValueError:
            await self._error(GatewayError(400, "the message is not JSON"))
            await self._close(CLOSE_INVALID_PAYLOAD)
            return
        await self.receive_json(content)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        kind = content.get("type") if isinstance(content, dict) else None
        if kind == "auth":
            await self._authenticate(f"Bearer {content.get('api_key', '')}")
        elif kind == "cancel":
            await self._cancel()
        elif kind == "infer":
            await self._start(content)
        else:
            await self._error(GatewayError(400, "message type must be auth, infer or cancel"))

    async def _start(self, content: dict[str, Any]) -> None:
        if self.context is None:
            await self._error(
                GatewayError(401, "authenticate first (an Authorization header or auth message)")
            )
            return
        if self.task is not None and not self.task.done():
            if not self.has_ended:
                await self._error(GatewayError(409, "a generation is already running on this connection"))
                return
            with contextlib.suppress(Exception):
                await self.task
        body = {k: v for k, v in content.items() if k not in {"type", "version_pin"}}
        pin = content.get("version_pin")
        try:
            if pin is not None and not isinstance(pin, str):
                raise GatewayError(400, "version_pin must be a string")
            request = parse_infer(body)
            if request.stream:
                raise GatewayError(400, "stream is implied on a WebSocket")
        except GatewayError as exc:
            await self._error(exc)
            return
        # The dispatch runs in the task too: Channels reads a socket's next message only once this one is
        # handled, and a dispatch can wait (for a replica to start, to accept), which a cancel or a
        # disconnect must be able to cut short.
        self.has_ended = False
        self.task = asyncio.get_running_loop().create_task(self._run(request, pin))

    async def _run(self, request: InferRequest, pin: str | None) -> None:
        try:
            # A key revoked, or a quota changed, since the socket opened counts from its next request.
            self.context = await self._reauthenticate()
            if self.context is None:
                return
            handle = await dispatch(
                context=self.context,
                path_model=self.scope["url_route"]["kwargs"]["model"],
                pin=(pin or "").strip() or self._header(b"x-version-pin"),  # a blank one names none
                params=request.sampling_params(),
                text=request.input,
                service_tier=grant_tier(self.context, request.service_tier),
            )
        except GatewayError as exc:
            await self._error(exc)
            return
        except Exception:  # in this task nobody else would see it, and the client would wait for ever
            logger.exception("could not dispatch a WebSocket request")
            await self._error(GatewayError(503, "the request could not be dispatched", retry_after_s=1))
            return
        except asyncio.CancelledError:  # cancelled before any replica had it: dispatch() gave back its slot
            with contextlib.suppress(Exception):
                await self.send_json(_aborted(version=None, num_completion_tokens=0))
            raise
        await self._forward(handle)

    async def _reauthenticate(self) -> TenantContext | None:
        """The socket's key checked again. A key no longer valid closes the socket (4401), as at the
        handshake: every later message would be refused anyway. A check that could not be made (the
        database down, for a key not seen lately) is a 503 for this request, and the socket stays."""
        try:
            return await authenticate(self.authorization, client=self._client())
        except GatewayError as exc:
            if exc.status != 401:
                raise
            await self._error(exc)
            await self._close(CLOSE_UNAUTHENTICATED)
            return None

    async def _forward(self, handle: InFlightRequest) -> None:
        try:
            async for event in handle.events():
                if "token" in event:
                    await self.send_json({"type": "token", "token": event["token"], "index": event["index"]})
                    continue
                self.has_ended = True  # before the send: the client may answer it at once
                if event.get("finish_reason") == "error":
                    await self.send_json(_final_error(handle, event.get("error", {})))
                    if event.get("error", {}).get("type") == KEY_REVOKED:  # as a key refused at the handshake
                        await self._close(CLOSE_UNAUTHENTICATED)
                else:
                    tier = handle.response_headers()["X-Service-Tier"]  # as granted, echoed
                    done = {"type": "done", "version": handle.version, "service_tier": tier}
                    await self.send_json({**done, **event})
        except Exception:  # in this task nobody else would see it, and the client would wait for ever
            logger.exception("request %s: its WebSocket stream failed", handle.request_id)
            if not self.has_ended:
                self.has_ended = True
                error = {"type": "internal_error", "message": "the stream failed"}
                with contextlib.suppress(Exception):
                    await self.send_json(_final_error(handle, error))
        except asyncio.CancelledError:
            # Aborts on the replica, freeing the sequence's blocks, and gives back its quota: all the way
            # through, when a second cancellation (a disconnect after a slow-reader cut-off) comes during it.
            await close_all([handle])
            # These wait until the client reads what is already buffered for it (or goes away).
            with contextlib.suppress(Exception):
                if handle.is_cut_off:
                    error = {"type": SLOW_READER, "message": SLOW_READER_MESSAGE}
                    await self.send_json(_final_error(handle, error))
                    await self._close(CLOSE_SLOW_READER)
                else:
                    await self.send_json(_aborted(handle.version, handle.num_completion_tokens))
            raise
        finally:
            await close_all([handle])

    async def _cancel(self) -> None:
        if self.task is not None and not self.task.done():
            # Once, as config/inference.py does: the task's own cleanup (its done message, its close)
            # must not be cut short by a second cancellation. A task cut off as a slow reader is
            # cancelled already, and is sending its last message.
            if not self.task.cancelling():
                self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def disconnect(self, code: int) -> None:
        await self._cancel()


def _aborted(version: str | None, num_completion_tokens: int) -> dict[str, Any]:
    """The done message of a generation the client cancelled (version None: no replica had it yet)."""
    return {
        "type": "done",
        "version": version,
        "finish_reason": "abort",
        "usage": {"completion_tokens": num_completion_tokens},
    }


def _final_error(handle: InFlightRequest, error: dict[str, Any]) -> dict[str, Any]:
    """The error that ends a generation: it says so, as a done message would, and which version served it."""
    return {"type": "error", "finish_reason": "error", "version": handle.version, "error": error}


def _utf8_size(text: str) -> int:
    # surrogatepass: a lone surrogate is refused later, as not JSON, rather than raising here
    return len(text.encode("utf-8", "surrogatepass"))
