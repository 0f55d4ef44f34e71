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


async def test_a_cold_start_poller_ends_when_its_last_waiter_leaves_though_a_read_lost_the_cancellation(
    settings: Any,
) -> None:
    """Left running, it would record demand for a version nobody waits for, and the autoscaler would
    keep starting replicas of it."""
    settings.REDIS_URL = ""
    runtime = Runtime(InMemoryChannelLayer())
    recording, lost = asyncio.Event(), asyncio.Event()

    class Directory:  # Redis in production
        async def record_demand(self, model_name: str, version: str) -> None:
            recording.set()
            if lost.is_set():
                return
            try:
                await asyncio.sleep(3600)  # the round trip
            except asyncio.CancelledError:
                lost.set()

        async def replicas(self, model_name: str, version: str, **_: bool) -> list[Any]:
            return []

    runtime.directory = Directory()  # type: ignore[assignment]
    waiter = asyncio.create_task(runtime.wait_for_replica("m", "v1"))
    await recording.wait()
    (poller,) = [task for task in asyncio.all_tasks() if task.get_name() == "cold-start-m:v1"]
    await cancel_and_wait([waiter])  # the request gave up: the poller is cancelled once
    done, _ = await asyncio.wait({poller}, timeout=5)
    if not done:
        await cancel_and_wait([poller])
    assert lost.is_set()
    assert done, "the poller went on after its last waiter had left"
