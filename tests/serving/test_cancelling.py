"""A stop ends its background tasks even where a library lost a cancellation (serving/cancelling.py):
a gateway or a replica that hung at shutdown would never exit, and a drained replica never be replaced."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from channels.layers import InMemoryChannelLayer

from serving.cancelling import cancel_and_wait
from serving.runtime import Runtime


async def _losing_its_first_cancellation(lost: asyncio.Event) -> None:
    """A loop over a call that returned as if not cancelled, as redis-py's can on Python 3.11."""
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if lost.is_set():
                raise
            lost.set()


async def test_every_task_ends_and_each_outcome_is_given_in_order() -> None:
    lost = asyncio.Event()

    async def fails() -> None:
        raise RuntimeError("a bug")

    async def returns() -> None:
        return None

    stubborn = asyncio.create_task(_losing_its_first_cancellation(lost))
    failed, returned = asyncio.create_task(fails()), asyncio.create_task(returns())
    await asyncio.sleep(0)  # the last two end before the cancellation
    outcomes = await asyncio.wait_for(
        cancel_and_wait([stubborn, failed, returned], recancel_after_s=0.05), timeout=10
    )
    assert lost.is_set() and stubborn.cancelled()
    assert isinstance(outcomes[0], asyncio.CancelledError)
    assert isinstance(outcomes[1], RuntimeError) and str(outcomes[1]) == "a bug"
    assert outcomes[2] is None


@pytest.mark.django_db(transaction=True)
async def test_a_gateway_runtime_stops_though_one_of_its_loops_lost_its_cancellation(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.REDIS_URL = ""
    lost = asyncio.Event()
    monkeypatch.setattr(
        Runtime, "_renew_leases_periodically", lambda self: _losing_its_first_cancellation(lost)
    )
    runtime = Runtime(InMemoryChannelLayer())
    await runtime.start(embedded_replicas=False)
    stopping = asyncio.create_task(runtime.stop())
    # Not wait_for: its own cancellation at the timeout would reach the loop a second time, and end it.
    done, _ = await asyncio.wait({stopping}, timeout=15)
    if not done:
        await cancel_and_wait([stopping])
    assert done, "the runtime's stop waited for a loop that had lost its cancellation"
    assert lost.is_set()
