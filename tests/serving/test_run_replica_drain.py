"""`run_replica`'s drain: SIGTERM waits for what the replica holds; a second SIGTERM stops without
waiting (an operator who will not wait for the longest request). The process's own signals are covered
end to end in tests/e2e/test_redis_fleet.py; here the command's loop runs against a stand-in replica."""

from __future__ import annotations

import asyncio
import io
from types import SimpleNamespace

from serving.management.commands.run_replica import Command


class HoldingReplica:
    """Ready at once, and holding one request until `finish()`."""

    replica_id = "r-1"
    ref = SimpleNamespace(model_name="demo-chat", version="v1")
    is_ready = True
    error = None

    def __init__(self) -> None:
        self.draining = asyncio.Event()
        self._idle = asyncio.Event()

    async def start(self) -> None:
        return None

    async def wait_engine_ended(self) -> None:
        await asyncio.Event().wait()

    def drain(self) -> None:
        self.draining.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def finish(self) -> None:
        self._idle.set()

    def heartbeat(self) -> SimpleNamespace:
        return SimpleNamespace(num_running=0 if self._idle.is_set() else 1, num_waiting=0)


async def _drain(second_signal: bool) -> tuple[HoldingReplica, asyncio.Task[int], io.StringIO]:
    replica, out = HoldingReplica(), io.StringIO()
    stop_requested, hurry = asyncio.Event(), asyncio.Event()
    running = asyncio.create_task(Command(stdout=out)._run(replica, stop_requested, hurry))
    stop_requested.set()
    await asyncio.wait_for(replica.draining.wait(), timeout=5)
    if second_signal:
        hurry.set()
    return replica, running, out


async def test_a_drain_waits_for_the_request_it_holds() -> None:
    replica, running, out = await _drain(second_signal=False)
    done, _ = await asyncio.wait({running}, timeout=0.2)
    assert not done  # the request is still running
    replica.finish()
    assert await asyncio.wait_for(running, timeout=5) == 0
    assert out.getvalue().splitlines()[-1] == "drained; stopping"


async def test_a_second_signal_stops_without_waiting_for_the_drain() -> None:
    _, running, out = await _drain(second_signal=True)
    assert await asyncio.wait_for(running, timeout=5) == 0
    assert out.getvalue().splitlines()[-1] == "stopping before the drain ended: 1 running, 0 waiting"
