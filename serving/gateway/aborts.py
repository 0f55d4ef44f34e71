"""Sending a request's abort to its replica, which frees its KV blocks there (a no-op for a request the
replica no longer holds).

A replica's channel full for a moment (many clients leaving at once send their aborts in one turn of the
loop, past its capacity) is waited out in the background, within ABORT_RETRY_S: an abort lost there would
leave its sequence running to max_tokens for nobody. Nothing waits for that: not a retry on another
replica, nor the quota's release, nor the response's end (the channel of a replica that died stays full
until it expires)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from channels.exceptions import ChannelFull

from serving.transport.protocol import Abort

logger = logging.getLogger(__name__)

ABORT_RETRY_FIRST_S = 0.005  # an abort that finds its replica's channel full is sent again after this,
ABORT_RETRY_S = 5.0  # doubling, for up to this long

_aborts_waiting: set[asyncio.Task[None]] = set()  # held: the loop keeps only weak references to tasks


async def send_abort(layer: Any, channel_name: str, wire_id: str, *, request_id: str) -> None:
    """Abort the try `wire_id` on the replica reading `channel_name`. Never raises: a replica gone with
    its channel, or the layer's server down, holds nothing to free. `request_id`: for the log."""
    message = Abort(wire_id).to_wire()
    try:
        await layer.send(channel_name, message)
    except ChannelFull:
        task = asyncio.get_running_loop().create_task(
            _send_when_there_is_room(layer, channel_name, message, request_id), name=f"abort-{request_id}"
        )
        _aborts_waiting.add(task)
        task.add_done_callback(_aborts_waiting.discard)
    except Exception:
        pass


async def _send_when_there_is_room(
    layer: Any, channel: str, message: dict[str, Any], request_id: str
) -> None:
    delay_s, deadline = ABORT_RETRY_FIRST_S, time.monotonic() + ABORT_RETRY_S
    while time.monotonic() + delay_s <= deadline:
        await asyncio.sleep(delay_s)  # the replica takes a message a turn: let it take some
        try:
            await layer.send(channel, message)
            return
        except ChannelFull:
            delay_s = min(2 * delay_s, 0.5)
        except Exception:
            return
    logger.warning("request %s: its replica's channel stayed full; abort not sent", request_id)
