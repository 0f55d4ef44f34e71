"""A stream's wait for its next event, with an alarm when a whole period passes without one.

A stream that hears nothing for LIVENESS_CHECK_S asks whether its replica still beats (in_flight.py).
An `asyncio.timeout` around each wait did that by scheduling a timer and cancelling it at every token:
~5-8 µs of the event loop's time a token, of ~60-100 µs in all at 64 streams (docs/architecture.md, "The
event loop's cost of a token"). The alarm here sets one timer per quiet spell instead. When it rings it
looks at when the last event came: if one came within the period it rings again that much later, and
only a whole period with none, while the stream waits, wakes the wait (with QUIET on its queue).

On the loop only, as the queues are."""

from __future__ import annotations

import asyncio
import time
from typing import Any

# What a wait that rang takes from its queue. A dict, as events are: a queue drained at close counts
# its tokens (`"token" in event`), and this carries none.
QUIET: dict[str, Any] = {}


class QuietAlarm:
    def __init__(self, period_s: float) -> None:
        self._period_s = period_s
        self._timer: asyncio.TimerHandle | None = None
        self._waiting_on: asyncio.Queue[dict[str, Any]] | None = None
        self._last_heard = 0.0  # time.monotonic() of the last event taken; 0: none yet

    async def next(self, queue: asyncio.Queue[dict[str, Any]]) -> dict[str, Any] | None:
        """The queue's next event; None once a whole period passed without one (call again to wait on)."""
        if not queue.empty():
            event = queue.get_nowait()
        else:
            if self._timer is None:
                self._timer = asyncio.get_running_loop().call_later(self._period_s, self._ring)
            self._waiting_on = queue
            try:
                event = await queue.get()
            finally:
                self._waiting_on = None
        if event is QUIET:
            return None
        self._last_heard = time.monotonic()
        return event

    def cancel(self) -> None:
        """The stream is over: no alarm rings for it."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _ring(self) -> None:
        self._timer = None
        queue = self._waiting_on
        if queue is None:
            return  # between waits: the next one sets the alarm again
        quiet_s = time.monotonic() - self._last_heard
        if quiet_s < self._period_s:
            self._timer = asyncio.get_running_loop().call_later(self._period_s - quiet_s, self._ring)
        elif queue.empty():
            queue.put_nowait(QUIET)
