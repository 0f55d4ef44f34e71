"""The stream's wait with an alarm (serving/gateway/quiet_alarm.py): it rings only after a whole quiet
period, however the events before it were spaced, and it costs the loop one timer a quiet spell, not one
a token (what it replaced, an asyncio.timeout around each wait, scheduled and cancelled one per token)."""

import asyncio
import time
from typing import Any

import pytest

from serving.gateway.quiet_alarm import QUIET, QuietAlarm

PERIOD_S = 0.1


async def test_a_quiet_period_wakes_the_wait_with_none() -> None:
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    alarm = QuietAlarm(PERIOD_S)
    began = time.monotonic()
    assert await alarm.next(queue) is None
    assert time.monotonic() - began >= PERIOD_S * 0.9  # the loop's clock may round a little early
    assert queue.empty()  # the wake-up was taken, nothing is left for the next wait to misread


async def test_events_in_time_never_ring_it_however_long_the_stream() -> None:
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    alarm = QuietAlarm(PERIOD_S)

    async def feed() -> None:
        for index in range(12):  # 12 gaps of 0.4 periods: 4.8 periods in all, never one quiet period
            await asyncio.sleep(PERIOD_S * 0.4)
            queue.put_nowait({"token": "x", "index": index})

    feeder = asyncio.create_task(feed())
    taken = [await alarm.next(queue) for _ in range(12)]
    await feeder
    assert [event["index"] for event in taken if event is not None] == list(range(12))
    assert None not in taken
    alarm.cancel()


async def test_a_quiet_period_after_events_is_counted_from_the_last_one() -> None:
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    alarm = QuietAlarm(PERIOD_S)
    loop = asyncio.get_running_loop()
    loop.call_later(PERIOD_S * 0.6, queue.put_nowait, {"token": "a", "index": 0})
    assert await alarm.next(queue) == {"token": "a", "index": 0}
    heard = time.monotonic()
    # The timer set by the first wait rings at 1.0 period, 0.4 after the event: too soon, it rings again.
    assert await alarm.next(queue) is None
    assert time.monotonic() - heard >= PERIOD_S * 0.9


async def test_events_already_queued_are_taken_without_a_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.get_running_loop()
    timers: list[float] = []
    real_call_later = loop.call_later

    def counted(delay: float, *args: Any) -> asyncio.TimerHandle:
        timers.append(delay)
        return real_call_later(delay, *args)

    monkeypatch.setattr(loop, "call_later", counted)
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    alarm = QuietAlarm(PERIOD_S)
    for index in range(100):
        queue.put_nowait({"token": "x", "index": index})
    assert [(await alarm.next(queue))["index"] for _ in range(100)] == list(range(100))  # type: ignore[index]
    assert timers == []

    # Waits that each get their event soon after: the first wait's timer serves them all.
    for index in range(20):
        loop.call_soon(queue.put_nowait, {"token": "y", "index": index})
        assert await alarm.next(queue) is not None
    assert len(timers) == 1
    alarm.cancel()


async def test_the_wake_up_is_a_dict_with_no_token() -> None:
    """A queue drained at close counts the tokens left in it (in_flight.py): the wake-up is not one."""
    assert isinstance(QUIET, dict) and "token" not in QUIET
