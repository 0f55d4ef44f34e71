"""/healthz and /readyz: liveness, and readiness from the database and this process's replicas.

The one edge module that reads the composition root (serving/runtime.py): readiness is a question about
this process's data plane as a whole, replicas included (docs/architecture.md, "Import rules")."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, JsonResponse

from serving.gateway.errors import GatewayError
from serving.runtime import get_runtime
from serving.telemetry.prometheus import has_metrics_token
from serving.throttle import Throttle

logger = logging.getLogger(__name__)
_directory_warning = Throttle()


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
