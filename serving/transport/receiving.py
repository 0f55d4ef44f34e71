"""Reading one channel for as long as a task runs: the replica's submissions, a gateway process's steps.

A receive that fails (Redis restarting, a dropped connection) is retried after a pause that doubles up to
RETRY_MAX_S: a reader that ended would leave its replica beating ready with nothing reading its channel,
or a gateway's streams waiting out their timeouts. One message that cannot be handled is logged and
skipped, never the end of the reading."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)

RETRY_MIN_S = 0.1
RETRY_MAX_S = 2.0


async def receive_forever(
    layer: Any, channel_name: str, handle: Callable[[dict[str, Any]], Awaitable[None]], *, reader: str
) -> None:
    """`handle` each message received on `channel_name`; `reader` names the reader in the log."""
    backoff_s = RETRY_MIN_S
    while True:
        try:
            message = await layer.receive(channel_name)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.warning("%s: receive failed; retrying in %.1f s", reader, backoff_s, exc_info=True)
            await asyncio.sleep(backoff_s)
            backoff_s = min(2 * backoff_s, RETRY_MAX_S)
            continue
        backoff_s = RETRY_MIN_S
        try:
            await handle(message)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("%s: could not take a message", reader)
