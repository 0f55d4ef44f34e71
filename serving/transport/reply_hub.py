"""The reply side of the channel-layer link: one inbox channel per server process (per event loop).

Replicas send one message per engine step to each inbox, carrying the new events of every request that
inbox waits on; the hub hands each event to the queue of the request it belongs to. One message per
step rather than per token is what keeps the channel layer off the critical path (docs/architecture.md, "One
message per step and inbox"). With Redis the steps travel on the pub/sub layer
(settings.CHANNEL_LAYERS["replies"]): one PUBLISH per step and inbox, against four round trips for a
core-layer send; submissions and aborts stay on the core layer, which queues them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from channels.layers import get_channel_layer
from django.conf import settings

from serving.cancelling import cancel_and_wait
from serving.transport.protocol import STEP_MESSAGE
from serving.transport.receiving import receive_forever

logger = logging.getLogger(__name__)

REPLIES_ALIAS = "replies"


def reply_layer() -> Any:
    """The layer replicas send steps on: the "replies" layer where one is configured, else the default
    (the embedded in-memory layer carries both)."""
    return get_channel_layer(REPLIES_ALIAS if REPLIES_ALIAS in settings.CHANNEL_LAYERS else "default")


class ReplyHub:
    def __init__(self, layer: Any) -> None:
        self._layer = layer
        self._queues: dict[str, tuple[asyncio.Queue[dict[str, Any]], Callable[[], bool]]] = {}
        self.channel_name: str | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._task is None:
            self.channel_name = await self._layer.new_channel("switchyard.inbox.")
            receiving = receive_forever(self._layer, self.channel_name, self._take, reader="reply hub")
            self._task = asyncio.get_running_loop().create_task(receiving, name="reply-hub")

    async def stop(self) -> None:
        if self._task is not None:
            # Cancelled again if its receive (a Redis call) lost the first cancellation: awaited once, a
            # server's shutdown would wait for ever (serving/cancelling.py).
            await cancel_and_wait([self._task])
            self._task = None

    def open(self, request_id: str, on_backlog: Callable[[], bool]) -> asyncio.Queue[dict[str, Any]]:
        """A queue for the request's events. `on_backlog` is called (on the loop) at each delivery that
        leaves more than the cap waiting; once it returns True (the reader is cut off) the queue gets
        nothing more."""
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._queues[request_id] = (queue, on_backlog)
        return queue

    @property
    def num_open(self) -> int:
        """Requests this process still streams."""
        return len(self._queues)

    def end_all(self, event: dict[str, Any]) -> int:
        """Hand `event` (a final one) to every request this process still streams: the server's drain
        ran out (serving/management/commands/serve.py). Returns how many there were."""
        queues = [queue for queue, _ in self._queues.values()]
        for queue in queues:
            queue.put_nowait(event)
        return len(queues)

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def _take(self, message: dict[str, Any]) -> None:
        self.deliver(message)

    def deliver(self, message: dict[str, Any]) -> None:
        """Hand a step's events to the queues of the requests they belong to. On the loop: from the
        receiving task, or directly from a replica in this process (Replica's `local_hub`)."""
        if message.get("type") != STEP_MESSAGE:
            return
        for item in message.get("items", ()):
            request_id = item.get("request_id")
            entry = self._queues.get(request_id)
            if entry is None:
                continue  # the client went away; its abort is already on its way to the replica
            queue, on_backlog = entry
            for event in item.get("events", ()):
                queue.put_nowait(event)
            if queue.qsize() > settings.STREAM_MAX_BACKLOG_EVENTS and on_backlog():
                del self._queues[request_id]
