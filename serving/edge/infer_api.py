"""Inference and health endpoints. Thin: parse, call dispatch, format."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from registry.errors import error_response
from registry.models import Model
from registry.selectors import RoutingSnapshot, TenantContext
from serving.edge.request_bodies import parse_classify, parse_infer, parse_json_body
from serving.gateway.auth import GatewayError
from serving.gateway.dispatch import Dispatch, authenticate, close_all, dispatch, model_snapshot, prompt_usage
from serving.gateway.router import split_model_name
from serving.runtime import get_runtime
from serving.telemetry.prometheus import has_metrics_token
from serving.throttle import Throttle
from serving.transport.vectors import decode_vector

logger = logging.getLogger(__name__)
_directory_warning = Throttle()


def _gateway_error(exc: GatewayError) -> JsonResponse:
    return error_response(exc.status, exc.message, headers=exc.headers)


def failed_dispatch(handle: Dispatch, exc: GatewayError) -> JsonResponse:
    """A request that reached a replica and failed there: the error, saying which version served it."""
    return error_response(exc.status, exc.message, headers={**handle.response_headers(), **exc.headers})


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


async def _sse_events(handle: Dispatch) -> AsyncIterator[bytes]:
    try:
        async for event in handle.events():
            yield _sse(event)
    finally:
        # Runs on normal end and when Django cancels the generator because the client went away.
        await close_all([handle])


@csrf_exempt
async def infer(request: HttpRequest, model: str) -> HttpResponse:
    """A generative model's text (JSON or SSE), or a classifier's scores: each kind's own body."""
    if request.method != "POST":
        return error_response(405, "use POST", headers={"Allow": "POST"})
    try:
        context = await authenticate(request.headers.get("Authorization"))
        snapshot = await model_snapshot(context, model)
        if snapshot is None:
            raise GatewayError(404, f"model {split_model_name(model)[0]!r} not found")
        if snapshot.kind == Model.Kind.CLASSIFIER:
            return await _classify(request, context, model, snapshot)
        if snapshot.kind == Model.Kind.EMBEDDING:
            raise GatewayError(400, f"model {model!r} is an embedding model: use POST /v1/embeddings")
        body = parse_infer(parse_json_body(request))
        handle = await dispatch(
            context=context,
            path_model=model,
            pin=request.headers.get("X-Version-Pin"),
            params=body.sampling_params(),
            text=body.input,
            snapshot=snapshot,
        )
    except GatewayError as exc:
        return _gateway_error(exc)
    if body.stream:
        return sse_response(_sse_events(handle), [handle])
    try:
        text, final = await handle.collect()
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
        rows, final = await handle.collect_vectors("scores", len(inputs))
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


class DispatchStream(StreamingHttpResponse):
    """An SSE response for dispatched requests, which the inference handler closes once the response is
    over (close_dispatches), whether or not its body was ever read: a client that leaves before the
    first chunk would otherwise leave its sequences running and its quota held (the body's own
    clean-up runs only once it has started)."""

    def __init__(self, events: AsyncIterator[bytes], handles: list[Dispatch]) -> None:
        super().__init__(events, content_type="text/event-stream", headers=handles[0].response_headers())
        self.dispatches = handles
        self["Cache-Control"] = "no-cache"
        self["X-Accel-Buffering"] = "no"  # a proxy in front must not buffer the stream

    async def close_dispatches(self) -> None:
        await close_all(self.dispatches)  # idempotent: a body that ran to its end closed them already


def sse_response(events: AsyncIterator[bytes], handles: list[Dispatch]) -> DispatchStream:
    return DispatchStream(events, handles)


async def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


def _database_ok() -> bool:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return True
    except Exception:
        return False


# /readyz answers anyone, so its database probe is shared: one at a time, its answer kept for a second.
# A probe per request, each on a new connection, let a flood of probes load the database and hold the
# worker threads that key lookups and routing reads wait for. A probe that has not answered within
# _DATABASE_PROBE_WAIT_S reads as the database down (a partition can hold one for the connection's
# timeouts, 15 s and more), and the next request after it ends starts another.
_DATABASE_PROBE_S = 1.0
_DATABASE_PROBE_WAIT_S = 2.0
_database_probe_task: asyncio.Task[bool] | None = None
_database_probe_started = 0.0


async def _database_probe() -> bool:
    global _database_probe_task, _database_probe_started
    loop = asyncio.get_running_loop()
    task = _database_probe_task
    if (
        task is None
        or task.get_loop() is not loop
        or (task.done() and loop.time() - _database_probe_started >= _DATABASE_PROBE_S)
    ):
        # Channels' wrapper: the thread's kept connection, replaced when it has gone bad.
        task = loop.create_task(database_sync_to_async(_database_ok, thread_sensitive=False)())
        task.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved: never logged
        _database_probe_task, _database_probe_started = task, loop.time()
    try:
        # Shielded: a caller that leaves, or gives up waiting, does not cancel the others' probe.
        return await asyncio.wait_for(asyncio.shield(task), _DATABASE_PROBE_WAIT_S)
    except Exception:  # TimeoutError, or the probe itself failed
        return False


async def readyz(request: HttpRequest) -> JsonResponse:
    database_ok = await _database_probe()
    directory_ok = True
    try:
        runtime = await get_runtime()
    except GatewayError:  # it could not start (Redis unreachable): get_runtime logged it
        handles, directory_ok = [], False
    else:
        try:
            handles = await runtime.all_replicas()
        except Exception as exc:  # the replica directory (Redis) unreachable: this process's own, and say so
            if _directory_warning.is_due():  # once per 10 s of an outage, not once per probe
                logger.warning("/readyz: the replica directory could not be read (%s)", type(exc).__name__)
            handles, directory_ok = runtime.local_replicas(), False
    replicas = [
        {
            "model": h.model_name,
            "version": h.version,
            "state": h.state,
            "replica_id": h.replica_id,
            "load": h.load,
            "kv_cache_usage": round(h.kv_cache_usage, 4),
            "local": h.is_local,
        }
        for h in handles
    ]
    num_ready = sum(1 for h in handles if h.is_ready)
    if settings.EMBEDDED_REPLICAS:
        # Not while a replica of this process is still loading: a server that reported ready with its
        # embedding model loaded and its chat model not yet answered the first chat requests with 503s.
        # (A replica that failed to load does not hold readiness back; the others serve.)
        local = [h for h in handles if h.is_local]
        is_loading = any(h.state == "loading" for h in local)
        is_ready = database_ok and any(h.is_ready for h in local) and not is_loading
    else:
        # A gateway in front of replica processes serves whatever they are doing: it routes, holds a
        # request through a cold start, or answers a 503 of its own. A replica loading somewhere (a
        # scale-up), or none at all (every model scaled to zero), must not take every gateway out of its
        # load balancer, which would leave the clients with refused connections instead.
        is_ready = database_ok
    body: dict[str, Any] = {"ready": is_ready, "database": database_ok, "num_ready_replicas": num_ready}
    if not directory_ok:
        # Still ready: every gateway shares the directory, and a load balancer that took them all out
        # would leave clients refused connections instead of the 503s each request gets meanwhile.
        body["replica_directory"] = False
    # The list names every model served, tenants' own included, and its load: for those who may read
    # /metrics, not for whoever can reach a load balancer's health check.
    if await _may_read_metrics(request):
        body["replicas"] = replicas
    return JsonResponse(body, status=200 if is_ready else 503)


async def _may_read_metrics(request: HttpRequest) -> bool:
    if has_metrics_token(request.headers.get("Authorization")):
        return True
    try:
        user = await request.auser()  # the session is in the database, which may be what is down
    except Exception:
        return False
    return bool(user.is_authenticated and user.is_active and user.is_staff)
