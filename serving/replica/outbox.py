"""A replica's outbox: what each step produced goes out in order while the model thread runs the next step.

After each step the new events of every request go out as ONE message per receiving server process (inbox),
never one per token: docs/architecture.md, "One message per step and inbox". Acceptances (or refusals) of
the requests a step admits go out as its forward pass starts (on Redis written by the publisher's own
thread during the pass, and always before the step's tokens), so the gateway sends the response's headers
while the prompt is prefilled rather than on the first token's path.

On Redis the model thread publishes a step itself, without waiting for Redis's reply
(serving/transport/channel_layers.py): handed to the loop thread first, a first token waited a median
~0.8 ms for that thread to wake and win the GIL (docs/architecture.md, "Steps published from the model
thread"). On the in-memory layer, which only the event loop may touch, the loop thread sends it.

Idle (nothing queued, nothing running, everything sent) is declared here, on the loop, after the last
events are out: a drain that waits for it loses nothing."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from serving.replica.inbox import Inbox
from serving.replica.step_result import Outgoing, StepResult
from serving.transport.protocol import Event, error_event, step_message
from serving.transport.reply_hub import ReplyHub

logger = logging.getLogger(__name__)

# How far the model thread may run ahead of the loop's sends (hand-overs not yet sent). A send that
# hangs then stops the engine, as it would have before, instead of piling up steps without bound.
MAX_UNSENT = 64
# Embedded, how long the model thread waits for the loop to deliver a step that starts a stream (see
# Outbox.emit) before it goes on regardless.
START_DELIVERY_WAIT_S = 0.005


class Outbox:
    def __init__(self, replies: Any, *, inbox: Inbox, local_hub: ReplyHub | None, replica_id: str) -> None:
        """`local_hub`: the reply hub of this process (embedded), which gets the steps for its inbox
        handed to it on the loop rather than sent through `replies`."""
        self._replies = replies
        self._inbox = inbox
        # Embedded, a step sent through the in-memory layer is deep-copied, queued, and waits for the
        # hub's task to wake: Python on the loop, holding the GIL while the model thread runs the next
        # step. Handed to the hub directly, the loop used ~8% less CPU while streaming
        # (docs/architecture.md, "The GIL in the embedded server").
        self._local_hub = local_hub
        self._replica_id = replica_id
        # The model thread's own publisher where the reply layer offers one (Redis); else the loop sends.
        make_publisher = getattr(replies, "blocking_publisher", None)
        self.step_publisher: Any = make_publisher() if make_publisher is not None else None
        self._queue: asyncio.Queue[Outgoing] = asyncio.Queue()  # model thread -> loop, in step order
        self._unsent = threading.Semaphore(MAX_UNSENT)
        self._idle = asyncio.Event()  # nothing queued, nothing running, everything sent
        self._idle.set()
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop that sends (start())."""
        self._loop = loop

    def is_loop_closed(self) -> bool:
        return self._loop is None or self._loop.is_closed()

    def connect(self) -> None:
        """On the model thread at load: a Redis that is down fails the load, not the first step."""
        if self.step_publisher is not None:
            self.step_publisher.connect()

    async def close(self) -> None:
        if self.step_publisher is not None:
            # It joins its writer thread and reads Redis's last replies: blocking, so not on the loop,
            # where an embedded replica shares it with every stream of the server.
            await asyncio.to_thread(self.step_publisher.close)

    # --- idle, on the loop -------------------------------------------------------------------------

    @property
    def is_idle(self) -> bool:
        return self._idle.is_set()

    def mark_busy(self) -> None:
        """An arrival, counted in on the loop: idle waits for it."""
        self._idle.clear()

    def mark_idle(self) -> None:
        """Nothing will run any more (the engine thread died): a drain must not wait for ever."""
        self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    # --- sending, on the loop ----------------------------------------------------------------------

    async def send(self, inbox: str, items: dict[str, list[Event]]) -> None:
        try:
            await self._replies.send(inbox, step_message(items))
        except Exception:
            logger.exception("replica %s: could not deliver a step to %s", self._replica_id, inbox)

    async def refuse(self, reply_to: str, request_id: str, error_type: str, message: str) -> None:
        """A submission's only event, its error, sent at once: it never reached the model thread."""
        await self.send(reply_to, {request_id: [error_event(error_type, message)]})

    async def send_result(self, result: StepResult) -> None:
        """A step's events to every inbox they go to, now, on the loop."""
        for inbox, items in result.events_by_inbox.items():
            hub = self._local_hub
            if hub is not None and inbox == hub.channel_name:
                try:
                    hub.deliver(step_message(items))
                except Exception:
                    logger.exception("replica %s: could not deliver a step to %s", self._replica_id, inbox)
            else:
                await self.send(inbox, items)

    async def refuse_malformed(self, message: dict[str, Any], exc: TypeError) -> None:
        """A submission that lacks a field the wire requires: answered, where it says where to, rather
        than left to wait out its gateway's acceptance timeout."""
        reply_to, request_id = message.get("reply_to"), message.get("request_id")
        if not isinstance(reply_to, str) or request_id is None:
            logger.warning(
                "replica %s: dropped a submission with no reply address: %s", self._replica_id, exc
            )
            return
        await self.refuse(reply_to, str(request_id), "invalid_request_error", f"malformed submission: {exc}")

    async def deliver(self) -> None:
        """Send what the model thread handed over, one item after another: a step's events never overtake
        the acceptances before them, nor the previous step's."""
        while True:
            outgoing = await self._queue.get()
            await self.send_result(outgoing.result)
            if outgoing.delivered is not None:
                # Scheduled after the tasks the delivery woke (the streams' SSE writes), so it runs last.
                asyncio.get_running_loop().call_soon(outgoing.delivered.set)
            self._unsent.release()
            if outgoing.is_engine_empty and outgoing.num_taken == self._inbox.num_queued:
                self._idle.set()

    # --- the model thread --------------------------------------------------------------------------

    def emit(
        self, result: StepResult, *, is_engine_empty: bool = False, num_taken: int = 0, soon: bool = False
    ) -> None:
        """Send a step's events: published from this thread where it has a publisher (`soon`: by the
        publisher's thread, still before anything published later), else handed to the loop. The loop
        is told when the engine empties either way, since idle is declared there."""
        if self.step_publisher is None:
            if result.events_by_inbox or is_engine_empty:
                # Embedded, the loop's handling of a step is Python that needs the GIL; run alongside
                # the next forward pass, the two threads trade it at every torch call. For a step that
                # starts a stream (an acceptance, a first token) the model thread lets the loop finish
                # first: the gateway's response start and first chunk go out uncontended, and the prefill
                # runs without them. Other steps do not wait: at 64 streams waiting for every delivery
                # cost 2-7% of the throughput (docs/architecture.md, "The GIL in the embedded server").
                delivered = threading.Event() if result.starts_a_stream else None
                self._hand_to_loop(Outgoing(result, is_engine_empty, num_taken, delivered))
                if delivered is not None:
                    delivered.wait(START_DELIVERY_WAIT_S)
            return
        publish = self.step_publisher.publish_soon if soon else self.step_publisher.publish
        for inbox, items in result.events_by_inbox.items():
            try:
                publish(inbox, step_message(items))
            except Exception:
                logger.exception("replica %s: could not deliver a step to %s", self._replica_id, inbox)
        if is_engine_empty:
            # Idle is what a drain waits for before the process exits: nothing may be left unwritten.
            self.step_publisher.flush()
            self._hand_to_loop(Outgoing(StepResult(), is_engine_empty, num_taken))

    def _hand_to_loop(self, outgoing: Outgoing) -> None:
        assert self._loop is not None
        while not self._unsent.acquire(timeout=0.25):
            if self._inbox.is_stopping or self._loop.is_closed():
                return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, outgoing)
        except RuntimeError:  # the loop closed without stop(): the process is exiting
            self._inbox.stop()
