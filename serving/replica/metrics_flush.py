"""How a replica's metrics reach the store: every METRICS_FLUSH_INTERVAL_S while it serves, and once more
at stop, bounded, on a thread that cannot hold the process at exit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings
from django.db import connections

from serving.telemetry import metric_window as m
from serving.telemetry.recorder import MetricsRecorder

logger = logging.getLogger(__name__)


async def flush_metrics(metrics: MetricsRecorder) -> int:
    """Write pending metrics to the store. Never raises: a store that is down only delays them."""
    try:
        return int(await database_sync_to_async(metrics.flush, thread_sensitive=False)())
    except Exception:
        logger.warning("replica %s: metrics flush failed; will retry", metrics.replica_id, exc_info=True)
        return 0


async def flush_metrics_periodically(metrics: MetricsRecorder, *, layer: Any, channel_name: str) -> None:
    """Every METRICS_FLUSH_INTERVAL_S for as long as the replica serves. The messages the signed Redis
    layer dropped on the replica's channel since the last flush (serving/transport/wire_signing.py) are
    counted with them, as the version's `forged`."""
    while True:
        await asyncio.sleep(settings.METRICS_FLUSH_INTERVAL_S)
        forged = getattr(layer, "forged", None)  # only the signed layer has it
        num_forged = forged.pop(channel_name, 0) if forged is not None else 0
        if num_forged:
            metrics.count({m.FORGED: num_forged})
        await flush_metrics(metrics)


async def flush_metrics_at_stop(metrics: MetricsRecorder) -> None:
    """flush_metrics on a daemon thread of its own. A flush left hanging on a pool thread (the default
    executor's, where flush_metrics runs) would hold the process at exit: asyncio.run and the interpreter
    join those threads, and with no timeout on Python 3.11. The caller bounds the wait."""
    loop = asyncio.get_running_loop()
    flushed: asyncio.Future[None] = loop.create_future()

    def settle() -> None:
        if not flushed.done():
            flushed.set_result(None)

    def flush() -> None:
        try:
            metrics.flush()
        except Exception:
            logger.warning("replica %s: metrics flush failed at stop", metrics.replica_id, exc_info=True)
        finally:
            connections.close_all()  # this thread's own; nothing else would close them
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(settle)

    threading.Thread(target=flush, name=f"replica-{metrics.replica_id}-last-flush", daemon=True).start()
    await flushed
