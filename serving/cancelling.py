"""Cancelling background tasks so that they end, even where a library lost the cancellation.

On Python 3.11, `asyncio.wait_for` returns its inner result, and drops the CancelledError, when the
inner future finished just as the outer task was cancelled (fixed in 3.12, where it is built on
`asyncio.timeout`). redis-py sends every command through `wait_for` on a connection with a socket
timeout, and since redis-py 8 that timeout defaults to 5 s. So any Redis call can lose a cancellation:
the task runs on as if nothing had happened, and a stop that cancelled it once and awaits it waits for
ever. CI saw exactly that: a replica said "drained; stopping" and never exited. A loop of script calls
(a heartbeat's) cancelled at random moments lost 209 cancellations in 1,000 here; a blocking pop with
a 20 ms timeout, 8 in 300.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)

RECANCEL_AFTER_S = 1.0


async def cancel_and_wait(
    tasks: Iterable[asyncio.Future[Any]], *, recancel_after_s: float = RECANCEL_AFTER_S
) -> list[BaseException | None]:
    """Cancel `tasks` and wait until every one has ended, cancelling again those still running after
    `recancel_after_s`. Each task's outcome, in order: the exception it ended with (CancelledError for
    one that obeyed), or None for one that returned. Never raises for a task's own failure: it logs it,
    by the task's name, so that a stop neither ends early on it nor loses it.

    Cancelled itself, it stops waiting and raises; the tasks have been cancelled at least once."""
    tasks = list(tasks)
    pending = {task for task in tasks if not task.done()}
    for task in pending:
        task.cancel()
    while pending:
        _, pending = await asyncio.wait(pending, timeout=recancel_after_s)
        for task in pending:
            name = task.get_name() if isinstance(task, asyncio.Task) else repr(task)
            logger.warning(
                "task %s still running %.1f s after its cancellation; cancelling it again",
                name,
                recancel_after_s,
            )
            task.cancel()
    outcomes = [_outcome(task) for task in tasks]
    for task, outcome in zip(tasks, outcomes, strict=True):
        if outcome is not None and not isinstance(outcome, asyncio.CancelledError):
            name = task.get_name() if isinstance(task, asyncio.Task) else repr(task)
            logger.error("%s had failed", name, exc_info=outcome)
    return outcomes


def _outcome(task: asyncio.Future[Any]) -> BaseException | None:
    if task.cancelled():
        return asyncio.CancelledError()
    return task.exception()


def raise_if_cancelling() -> None:
    """Raise CancelledError where the current task was asked to stop but the CancelledError never
    reached it: for a loop over a blocking Redis command, after a reply that brought nothing."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
