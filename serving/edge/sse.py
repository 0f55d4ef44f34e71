"""Server-sent events: the framing, and the streaming response that closes its requests when it is over.

Shared by /infer and the OpenAI endpoints."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from django.http import StreamingHttpResponse

from serving.gateway.in_flight import InFlightRequest, close_all


def sse_frame(payload: Any) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


async def sse_events(handle: InFlightRequest) -> AsyncIterator[bytes]:
    try:
        async for event in handle.events():
            yield sse_frame(event)
    finally:
        # Runs on normal end and when Django cancels the generator because the client went away.
        await close_all([handle])


class InFlightStream(StreamingHttpResponse):
    """An SSE response for dispatched requests, which the inference handler closes once the response is
    over (close_dispatches), whether or not its body was ever read: a client that leaves before the
    first chunk would otherwise leave its sequences running and its quota held (the body's own
    clean-up runs only once it has started)."""

    def __init__(self, events: AsyncIterator[bytes], handles: list[InFlightRequest]) -> None:
        super().__init__(events, content_type="text/event-stream", headers=handles[0].response_headers())
        self.dispatches = handles
        self["Cache-Control"] = "no-cache"
        self["X-Accel-Buffering"] = "no"  # a proxy in front must not buffer the stream

    async def close_dispatches(self) -> None:
        await close_all(self.dispatches)  # idempotent: a body that ran to its end closed them already


def sse_response(events: AsyncIterator[bytes], handles: list[InFlightRequest]) -> InFlightStream:
    return InFlightStream(events, handles)
