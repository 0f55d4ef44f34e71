"""POST /v1/models/{model}/infer and its classify form. Thin: parse, call dispatch, format."""

from __future__ import annotations

import logging
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from registry.errors import error_response
from registry.models import Model
from registry.selectors import RoutingSnapshot, TenantContext
from serving.edge.error_fields import error_fields
from serving.edge.request_bodies import parse_classify, parse_infer, parse_json_body
from serving.edge.sse import sse_events, sse_response
from serving.gateway.dispatch import authenticate, dispatch, model_snapshot, prompt_usage
from serving.gateway.errors import GatewayError
from serving.gateway.in_flight import InFlightRequest
from serving.gateway.results import collect, collect_vectors
from serving.gateway.router import split_model_name
from serving.gateway.service_tiers import grant_tier
from serving.throttle import Throttle
from serving.transport.vectors import decode_vector

logger = logging.getLogger(__name__)
_directory_warning = Throttle()


def _gateway_error(exc: GatewayError) -> JsonResponse:
    return error_response(exc.status, exc.message, headers=exc.headers, openai=error_fields(exc))


def failed_dispatch(handle: InFlightRequest, exc: GatewayError) -> JsonResponse:
    """A request that reached a replica and failed there: the error, saying which version served it."""
    headers = {**handle.response_headers(), **exc.headers}
    return error_response(exc.status, exc.message, headers=headers, openai=error_fields(exc))


@csrf_exempt
async def infer(request: HttpRequest, model: str) -> HttpResponse:
    """A generative model's text (JSON or SSE), or a classifier's scores: each kind's own body."""
    if request.method != "POST":
        return error_response(405, "use POST", headers={"Allow": "POST"})
    try:
        context = await authenticate(
            request.headers.get("Authorization"), client=request.META.get("REMOTE_ADDR")
        )
        snapshot = await model_snapshot(context, model)
        if snapshot is None:
            raise GatewayError(404, f"model {split_model_name(model)[0]!r} not found")
        if snapshot.kind == Model.Kind.CLASSIFIER:
            return await _classify(request, context, model, snapshot)
        if snapshot.kind == Model.Kind.EMBEDDING:
            raise GatewayError(400, f"model {model!r} is an embedding model: use POST /v1/embeddings")
        body = parse_infer(parse_json_body(request))
        service_tier = grant_tier(context, body.service_tier)
        handle = await dispatch(
            context=context,
            path_model=model,
            pin=request.headers.get("X-Version-Pin"),
            params=body.sampling_params(),
            text=body.input,
            snapshot=snapshot,
            service_tier=service_tier,
        )
    except GatewayError as exc:
        return _gateway_error(exc)
    if body.stream:
        return sse_response(sse_events(handle), [handle])
    try:
        text, final = await collect(handle)
    except GatewayError as exc:
        return failed_dispatch(handle, exc)
    return JsonResponse(
        {
            "id": handle.request_id,
            "object": "inference",
            "model": handle.model_name,
            "version": handle.version,
            "output": text,
            "finish_reason": final.get("finish_reason"),
            "usage": final.get("usage", {}),
            "timings": final.get("timings", {}),
            "service_tier": service_tier,
        },
        headers=handle.response_headers(),
    )


async def _classify(
    request: HttpRequest, context: TenantContext, model: str, snapshot: RoutingSnapshot
) -> HttpResponse:
    """Every input's labels with their scores, best first (the top_k best, if asked)."""
    inputs, top_k = parse_classify(parse_json_body(request))
    handle = await dispatch(
        context=context,
        path_model=model,
        pin=request.headers.get("X-Version-Pin"),
        params={},
        inputs=inputs,
        kind=Model.Kind.CLASSIFIER,
        snapshot=snapshot,
    )
    try:
        rows, final = await collect_vectors(handle, "scores", len(inputs))
        predictions = [_ranked(final.get("labels"), decode_vector(row), top_k) for row in rows]
    except GatewayError as exc:
        return failed_dispatch(handle, exc)
    return JsonResponse(
        {
            "id": handle.request_id,
            "object": "classification",
            "model": handle.model_name,
            "version": handle.version,
            "predictions": predictions,
            "usage": prompt_usage(final),
        },
        headers=handle.response_headers(),
    )


def _ranked(labels: object, scores: list[float], top_k: int | None) -> list[dict[str, Any]]:
    if not isinstance(labels, list) or len(labels) != len(scores):
        raise GatewayError(503, "the replica's scores do not match its labels")
    ranked = sorted(zip(labels, scores, strict=True), key=lambda pair: pair[1], reverse=True)
    return [{"label": label, "score": score} for label, score in ranked[:top_k]]
