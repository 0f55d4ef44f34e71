"""A request's whole result, for a response that is not streamed: its text (and logprobs) or its vectors,
read from its in-flight handle to the end."""

from __future__ import annotations

from typing import Any

from serving.gateway.errors import GatewayError
from serving.gateway.in_flight import InFlightRequest


async def collect(
    handle: InFlightRequest, *, logprobs: list[dict[str, Any]] | None = None
) -> tuple[str, dict[str, Any]]:
    """Run to the end and return the whole text and the final event; closes the request. A request
    that failed, whatever text it had produced, raises GatewayError(503): an answer cut off part-way,
    without usage, is not one a client can take for a result. `logprobs`: a list that gets each
    token's entry, for a request that asked for them."""
    pieces: list[str] = []
    final: dict[str, Any] = {}
    try:
        async for event in handle.events():
            if "token" in event:
                pieces.append(event["token"])
                if logprobs is not None and "logprob" in event:
                    logprobs.append(event["logprob"])
            elif "finish_reason" in event:
                final = event
    finally:
        await handle.close()
    if final.get("finish_reason") == "error":
        message = final.get("error", {}).get("message", "the replica failed")
        raise GatewayError(503, message, retry_after_s=1)
    return "".join(pieces), final


async def collect_vectors(
    handle: InFlightRequest, result_field: str, count: int
) -> tuple[list[str], dict[str, Any]]:
    """A non-generative request's result: the `count` rows (base64 float32, serving/transport/vectors.py)
    its final event carries under `result_field`, and that event. Raises GatewayError(503) when the
    replica failed or sent no such rows."""
    _, final = await collect(handle)
    rows = final.get(result_field)
    if not isinstance(rows, list) or len(rows) != count:
        raise GatewayError(503, f"the replica returned no {result_field}")
    return rows, final
