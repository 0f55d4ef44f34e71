"""The step watchdog: a model thread whose step runs past REPLICA_STEP_WATCHDOG_S (a kernel that never
returns, a device that stopped answering without an error) is taken for hung. Without it the replica went
on beating "ready" while every request routed to it waited out the gateway's inactivity timeout.

It runs on the event loop, which the hung thread does not hold, and reads only the moment the model
thread's step began (ModelLoop.step_started_at). What happens then is the replica's (Replica._step_hung):
it fails, ends the requests it held with a terminal error, and is exited (run_replica, for its supervisor
to restart) or replaced (embedded)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from serving.replica.model_loop import ModelLoop
from serving.replica.outbox import Outbox

# How often the watchdog looks, at most: a step hung for the deadline is caught within this after it.
MAX_CHECK_INTERVAL_S = 1.0


async def watch_steps(
    model_loop: ModelLoop, *, deadline_s: float, on_hung: Callable[[float], Awaitable[None]]
) -> None:
    """Until a step has run past `deadline_s`; then `on_hung(its time so far)`, once."""
    while True:
        await asyncio.sleep(min(MAX_CHECK_INTERVAL_S, deadline_s / 4))
        started = model_loop.step_started_at
        if started is not None and (elapsed_s := time.monotonic() - started) > deadline_s:
            await on_hung(elapsed_s)
            return


async def end_hung_step(model_loop: ModelLoop, outbox: Outbox, message: str) -> None:
    """Every request the hung model thread held ends now, with `message`; and the replica is idle, so
    that a drain or a stop waiting for that does not wait for a thread that will not come back."""
    await outbox.send_result(model_loop.abandon(message))
    outbox.mark_idle()
