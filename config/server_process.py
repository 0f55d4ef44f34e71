"""What a server process does around its requests, whichever server runs it (docs/architecture.md, "One
start path for uvicorn and daphne"): start the data-plane runtime as soon as the server does, so that
embedded replicas load before the first request rather than on it (/readyz says 503 until they are
ready), with the periodic tasks (rollout judge, autoscaler, metrics maintenance) in this process when
there is no Redis (so no Celery beat); on stop, drain the streams in flight for up to SHUTDOWN_DRAIN_S,
end those still open with a final `server_shutting_down` event, then stop the runtime: its replicas
finish the step they are in and release what they hold.

uvicorn calls start and stop through the ASGI lifespan (config/lifespan.py) and drains from its own
shutdown (serving/management/commands/serve.py); daphne has no lifespan, so config/daphne_host.py calls
the same three from Twisted's reactor. One process, one instance: SERVER_PROCESS."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.utils.module_loading import import_string

logger = logging.getLogger(__name__)

# How often the drain looks at the streams still open: they end in the replicas' time, and nothing
# announces the last one.
DRAIN_POLL_S = 0.1
# After the drain's final events: how long they are given to go out before the connections close.
FINAL_EVENT_GRACE_S = 0.5


class ServerProcess:
    def __init__(self) -> None:
        self._tasks: list[asyncio.Task[Any]] = []
        self.is_started = False
        self.is_draining = False  # new requests are refused (503) from here on: the server is stopping

    def start(self) -> None:
        """On the server's running loop, once: the runtime's start and the embedded scheduler, not
        awaited (the server listens at once and reports not-ready while replicas load)."""
        if self.is_started:
            return
        self.is_started = True
        # Deferred: the ASGI application imports this module before Django's apps are loaded, and the
        # runtime reads models at import.
        from serving.runtime import get_runtime

        self._tasks.append(asyncio.get_running_loop().create_task(get_runtime(), name="runtime-start"))
        scheduler = import_string(settings.EMBEDDED_SCHEDULER_STARTER)()  # None with Redis
        if scheduler is not None:
            self._tasks.append(scheduler)

    async def drain(self, *, is_forced: Callable[[], bool] = lambda: False) -> int:
        """Refuse new requests, let the streams in flight run for up to SHUTDOWN_DRAIN_S (less if
        `is_forced` says so: a second signal), then hand those still open a final error event and give
        it a moment to go out. Returns how many were cut."""
        # Deferred, as in start().
        from serving.runtime import started_runtime
        from serving.transport.protocol import SERVER_SHUTTING_DOWN, SERVER_SHUTTING_DOWN_MESSAGE, error_event

        self.is_draining = True
        runtime = started_runtime()
        if runtime is None:
            return 0
        deadline = time.monotonic() + settings.SHUTDOWN_DRAIN_S
        while runtime.hub.num_open and time.monotonic() < deadline and not is_forced():
            await asyncio.sleep(DRAIN_POLL_S)
        cut = runtime.hub.end_all(error_event(SERVER_SHUTTING_DOWN, SERVER_SHUTTING_DOWN_MESSAGE))
        if cut:
            logger.warning("shutdown: the drain ran out; ended %d streams with a final error", cut)
            await asyncio.sleep(FINAL_EVENT_GRACE_S)
        return cut

    async def stop(self) -> None:
        """Stop what start() started, and the runtime. A task that had failed does not keep the runtime
        from being stopped; it is logged."""
        # Deferred, as in start().
        from serving.cancelling import cancel_and_wait
        from serving.runtime import shutdown_runtime

        self.is_draining = True
        await cancel_and_wait(self._tasks)
        self._tasks = []
        try:
            await shutdown_runtime()
        except Exception:
            logger.exception("stopping the runtime failed")
        # Stopped: a later server on a new loop in the same process (tests do this) starts afresh.
        self.is_started = self.is_draining = False


SERVER_PROCESS = ServerProcess()
