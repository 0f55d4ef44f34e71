"""The server's start and stop (ASGI lifespan): the data-plane runtime starts as soon as the server
does, so embedded replicas load before the first request rather than on it (/readyz says 503 until
they are ready), and, without Redis (so without Celery beat), the periodic tasks (rollout judge,
metrics maintenance) run in this process on the same schedule. On stop, the runtime stops: its
replicas finish the step they are in and release what they hold."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from django.conf import settings
from django.utils.module_loading import import_string

logger = logging.getLogger(__name__)


async def lifespan(scope: dict[str, Any], receive: Any, send: Any) -> None:
    # Deferred: the ASGI application imports this module before Django's apps are loaded, and the
    # runtime reads models at import.
    from serving.cancelling import cancel_and_wait
    from serving.runtime import get_runtime, shutdown_runtime

    started: list[asyncio.Task[Any] | None] = []
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            # Not awaited: the server listens at once and reports not-ready while replicas load.
            started.append(asyncio.get_running_loop().create_task(get_runtime(), name="runtime-start"))
            started.append(import_string(settings.EMBEDDED_SCHEDULER_STARTER)())  # None with Redis
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            # A task that had failed does not keep the runtime from being stopped; it is logged.
            await cancel_and_wait(task for task in started if task is not None)
            try:
                await shutdown_runtime()
            except Exception:
                logger.exception("stopping the runtime failed")
            await send({"type": "lifespan.shutdown.complete"})
            return
