"""A replica's failures end its requests at once and never hang a drain or a stop: a receive that fails
(Redis restarting), a dead engine thread, a final event that cannot be built. And a runtime is handed
out only once started, to every caller that waits for it."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import redis.exceptions
from asgiref.sync import sync_to_async
from channels.layers import InMemoryChannelLayer

from serving import runtime as runtime_module
from serving.cancelling import cancel_and_wait
from serving.replica import model_loop as model_loop_module
from serving.replica import replica as replica_module
from serving.replica.replica import Replica
from serving.transport.protocol import ABORT, ReplicaState
from serving.transport.replica_directory import Heartbeat, HeartbeatPublisher, ReplicaDirectory
from tests.serving.replica.test_replica_pipeline import (
    HeldReplies,
    _assert_one_whole_stream,
    _submit,
    break_the_engine_thread,
)


class FlakyLayer(InMemoryChannelLayer):  # type: ignore[misc]
    """An in-memory layer whose first receive fails as a dropped Redis connection does."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = asyncio.Event()

    async def receive(self, channel: str) -> dict[str, Any]:
        if not self.failed.is_set():
            self.failed.set()
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        return await super().receive(channel)  # type: ignore[no-any-return]


class CancelLosingLayer(InMemoryChannelLayer):  # type: ignore[misc]
    """An in-memory layer whose receive loses its first cancellation, as redis-py's blocking pop can
    (redis/redis-py#2028): the receive goes on waiting as if it had timed out and started again."""

    def __init__(self) -> None:
        super().__init__()
        self.lost = asyncio.Event()

    async def receive(self, channel: str) -> dict[str, Any]:
        while True:
            try:
                return await super().receive(channel)  # type: ignore[no-any-return]
            except asyncio.CancelledError:
                if self.lost.is_set():
                    raise
                self.lost.set()


class FakePublisher:
    """A heartbeat publisher that keeps what it was told."""

    def __init__(self) -> None:
        self.beats: list[Heartbeat] = []
        self.withdrawn: list[str] = []

    async def publish(self, beat: Heartbeat) -> None:
        self.beats.append(beat)

    async def withdraw(self, beat: Heartbeat) -> None:
        self.withdrawn.append(beat.replica_id)


class CancelLosingPublisher(FakePublisher):
    """A publisher whose beat, cancelled the first time, returns as if it had not been: as redis-py's
    calls can on Python 3.11 (serving/cancelling.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.lost = asyncio.Event()

    async def publish(self, beat: Heartbeat) -> None:
        await super().publish(beat)
        if self.lost.is_set():
            return
        try:
            await asyncio.Event().wait()  # a round trip that is under way when the stop comes
        except asyncio.CancelledError:
            self.lost.set()


class WatchedReplies(HeldReplies):
    """Replies sent at once; `ended(request_id)` waits for that request's terminal event."""

    def __init__(self) -> None:
        super().__init__()
        self.let_go()
        self._sent = asyncio.Condition()

    async def send(self, channel: str, message: dict[str, Any]) -> None:
        await super().send(channel, message)
        async with self._sent:
            self._sent.notify_all()

    async def ended(self, request_id: str) -> list[dict[str, Any]]:
        return await self.until(request_id, "finish_reason")

    async def until(self, request_id: str, field: str) -> list[dict[str, Any]]:
        """The request's events once one of them has `field`."""
        async with asyncio.timeout(30), self._sent:
            await self._sent.wait_for(lambda: any(field in e for e in self.events(request_id)))
        return self.events(request_id)


async def _replica(layer: Any, replies: HeldReplies, **kwargs: Any) -> Replica:
    from registry.selectors import version_ref

    ref = await sync_to_async(version_ref)(model_name="demo-chat", version="v1")
    replica = Replica(ref, layer=layer, replies=replies, torch_threads=1, **kwargs)
    await replica.start()
    assert replica.is_ready, replica.error
    return replica


@pytest.mark.django_db(transaction=True)
async def test_a_replica_serves_on_after_a_receive_fails_and_its_stop_withdraws_its_heartbeat(
    registered_model,
) -> None:
    layer, replies, publisher = FlakyLayer(), WatchedReplies(), FakePublisher()
    replica = await _replica(layer, replies, publisher=publisher)
    try:
        await asyncio.wait_for(layer.failed.wait(), timeout=10)
        await _submit(layer, replica, "r1", max_tokens=4)
        _assert_one_whole_stream(await replies.ended("r1"), num_tokens=4)
    finally:
        await asyncio.wait_for(replica.stop(), timeout=30)
    assert publisher.withdrawn == [replica.replica_id]


@pytest.mark.django_db(transaction=True)
async def test_a_task_that_failed_does_not_cut_the_stop_short(registered_model, monkeypatch) -> None:
    publisher = FakePublisher()

    async def broken() -> None:
        raise RuntimeError("a bug in a replica's task")

    monkeypatch.setattr(replica_module, "flush_metrics_periodically", lambda *_, **__: broken())
    replica = await _replica(InMemoryChannelLayer(), WatchedReplies(), publisher=publisher)
    (failed,) = [task for task in replica._tasks if task.get_name().endswith("-metrics")]
    with pytest.raises(RuntimeError):
        await failed
    await asyncio.wait_for(replica.stop(), timeout=30)
    assert publisher.withdrawn == [replica.replica_id]
    assert replica._engine_run is not None and replica._engine_run.done()


@pytest.mark.django_db(transaction=True)
async def test_a_stop_ends_though_its_tasks_lost_their_cancellations(registered_model) -> None:
    layer, publisher = CancelLosingLayer(), CancelLosingPublisher()
    replica = await _replica(layer, WatchedReplies(), publisher=publisher)
    await asyncio.wait_for(replica.stop(), timeout=30)
    assert layer.lost.is_set() and publisher.lost.is_set()
    assert publisher.withdrawn == [replica.replica_id]
    assert replica._engine_run is not None and replica._engine_run.done()


@pytest.mark.django_db(transaction=True)
async def test_after_the_engine_thread_died_an_abort_or_a_submission_does_not_hold_up_a_drain(
    registered_model,
) -> None:
    layer, replies = InMemoryChannelLayer(), WatchedReplies()
    replica = await _replica(layer, replies)
    break_the_engine_thread(replica)
    try:
        await _submit(layer, replica, "r1", max_tokens=4)
        assert replica._engine_run is not None
        with pytest.raises(RuntimeError, match="a bug"):
            await asyncio.wait_for(replica._engine_run, timeout=10)
        # The client of r1 leaves, and another request comes: both after the engine has gone.
        await layer.send(replica.channel_name, {"type": ABORT, "request_id": "r1"})
        await _submit(layer, replica, "r2", max_tokens=4)
        # Taken in order: once r2 is answered the abort has been handled too.
        (refusal,) = await replies.ended("r2")
        assert refusal["error"]["type"] == "replica_unavailable"
        replica.drain()
        await asyncio.wait_for(replica.wait_idle(), timeout=10)
        assert replica.state is ReplicaState.FAILED
    finally:
        await replica.stop()


@pytest.mark.django_db(transaction=True)
async def test_a_final_event_that_cannot_be_built_still_ends_its_request(
    registered_model, monkeypatch
) -> None:
    layer, replies = InMemoryChannelLayer(), WatchedReplies()
    replica = await _replica(layer, replies)

    def broken(output: Any, route: Any) -> dict[str, Any]:
        raise ValueError("vectors that cannot be encoded")

    monkeypatch.setattr(model_loop_module, "final_event", broken)
    try:
        await _submit(layer, replica, "r1", max_tokens=3)
        events = await replies.ended("r1")
        assert events[-1] == {
            "finish_reason": "error",
            "error": {
                "type": "internal_error",
                "message": "the replica failed on this request's step (ValueError); try again",
            },
        }
        assert replica.model_loop.routes == {}
        assert replica.is_ready  # the step failed, not the replica
    finally:
        await replica.stop()


async def test_callers_that_come_while_the_runtime_starts_get_it_started(settings, monkeypatch) -> None:
    settings.EMBEDDED_REPLICAS = False
    entered, release = asyncio.Event(), asyncio.Event()
    start = runtime_module.Runtime.start

    async def slow_start(self: Any, **kwargs: Any) -> None:
        entered.set()
        await release.wait()  # as a SUBSCRIBE to Redis waits for its reply
        await start(self, **kwargs)

    monkeypatch.setattr(runtime_module.Runtime, "start", slow_start)

    async def channel_seen() -> tuple[Any, str | None]:
        runtime = await runtime_module.get_runtime()
        return runtime, runtime.hub.channel_name  # at the moment it was handed out

    first, second = asyncio.create_task(channel_seen()), asyncio.create_task(channel_seen())
    await entered.wait()
    release.set()
    (runtime_a, channel_a), (runtime_b, channel_b) = await asyncio.gather(first, second)
    assert runtime_a is runtime_b
    assert channel_a is not None and channel_b is not None


async def test_a_runtime_whose_start_failed_is_not_handed_out(settings, monkeypatch) -> None:
    from serving.gateway.errors import GatewayError

    settings.EMBEDDED_REPLICAS = False
    start = runtime_module.Runtime.start

    async def failing_start(self: Any, **kwargs: Any) -> None:
        raise ConnectionError("Redis is restarting")

    monkeypatch.setattr(runtime_module.Runtime, "start", failing_start)
    with pytest.raises(GatewayError) as refused:  # a 503 to the request that met it, not a 500
        await runtime_module.get_runtime()
    assert refused.value.status == 503 and isinstance(refused.value.__cause__, ConnectionError)
    assert asyncio.get_running_loop() not in runtime_module._runtimes
    monkeypatch.setattr(runtime_module.Runtime, "start", start)
    runtime = await runtime_module.get_runtime()
    assert runtime.hub.channel_name is not None


@pytest.mark.redis
async def test_a_replica_that_beats_failed_is_not_alive(redis_url: str) -> None:
    import uuid

    model = f"dir-{uuid.uuid4().hex[:8]}"
    publisher, directory = HeartbeatPublisher(redis_url), ReplicaDirectory(redis_url)
    beats = [
        Heartbeat(f"r-{state}", model, "v1", "switchyard.replica.x", state, 0, 1, 0.0, time.time())
        for state in ("ready", "draining", "failed", "stopped")
    ]
    try:
        for beat in beats:
            await publisher.publish(beat)
        alive = {beat.state: await directory.is_alive(model, "v1", beat.replica_id) for beat in beats}
        assert alive == {"ready": True, "draining": True, "failed": False, "stopped": False}
    finally:
        for beat in beats:
            await publisher.withdraw(beat)
        await publisher.close()
        await directory.close()


async def test_a_directory_that_cannot_be_read_ends_no_stream() -> None:
    """Every stream asks whether its replica is alive every LIVENESS_CHECK_S: Redis restarting made that
    raise, and the error ended every stream in flight without a final event."""
    from channels.layers import InMemoryChannelLayer

    from serving.gateway.data_plane import ReplicaHandle
    from serving.runtime import Runtime

    class Unreadable:
        async def is_alive(self, model_name: str, version: str, replica_id: str) -> bool:
            raise ConnectionError("Redis is restarting")

    runtime = Runtime(InMemoryChannelLayer())
    runtime.directory = Unreadable()  # type: ignore[assignment]
    far = ReplicaHandle("far", "m", "v1", "switchyard.replica.far", "ready", 0, 0.0, True, False)
    assert await runtime.is_alive(far)


@pytest.mark.django_db(transaction=True)
async def test_a_stop_withdraws_the_heartbeat_and_ends_though_the_metrics_store_does_not_answer(
    registered_model, monkeypatch
) -> None:
    publisher = FakePublisher()
    replica = await _replica(InMemoryChannelLayer(), WatchedReplies(), publisher=publisher)
    answer = threading.Event()
    flushed_on: list[threading.Thread] = []

    def hung_flush() -> int:
        flushed_on.append(threading.current_thread())
        answer.wait(30)  # a database that does not answer
        return 0

    monkeypatch.setattr(replica_module, "STOP_FLUSH_TIMEOUT_S", 0.2)
    monkeypatch.setattr(replica.metrics, "flush", hung_flush)
    stopping = asyncio.create_task(replica.stop())
    try:
        done, _ = await asyncio.wait({stopping}, timeout=10)
        if not done:
            await cancel_and_wait([stopping])
        assert done, "the stop waited for the metrics store"
        assert publisher.withdrawn == [replica.replica_id]
        # Still hanging, on a thread that the interpreter's exit does not wait for.
        (thread,) = flushed_on
        assert thread.daemon and thread.is_alive()
    finally:
        answer.set()


async def test_after_the_runtime_is_shut_down_no_new_one_starts_on_its_loop(settings) -> None:
    """A request or a live feed still running when the server stops would start a runtime that nobody
    stops: replicas loading during the exit, a Redis subscription left open. It gets a 503 instead."""
    from serving.gateway.errors import GatewayError

    settings.EMBEDDED_REPLICAS = False
    first = await runtime_module.get_runtime()
    await runtime_module.shutdown_runtime()
    with pytest.raises(GatewayError) as refused:
        await runtime_module.get_runtime()
    assert refused.value.status == 503 and refused.value.headers["Retry-After"] == "1"
    assert asyncio.get_running_loop() not in runtime_module._runtimes
    assert first.hub.channel_name is not None  # it had started


@pytest.mark.django_db(transaction=True)
async def test_a_stop_during_a_step_flushes_what_that_step_recorded(registered_model, settings) -> None:
    """A stop while the model thread is in a step (an embedded server's shutdown mid-stream): the step's
    sample lands in the metrics when it ends, which must be before the last flush, not after it."""
    from serving.replica.faults import Faults

    settings.ALLOW_FAULT_INJECTION = True
    layer, replies = InMemoryChannelLayer(), WatchedReplies()
    replica = await _replica(layer, replies, faults=Faults(step_delay_ms=1500))
    await _submit(layer, replica, "long", max_tokens=100)
    await replies.until("long", "token")  # the next step is under way
    await asyncio.wait_for(replica.stop(), timeout=30)
    assert replica.metrics._pending == {}, "recorded after the last flush: lost"


@pytest.mark.django_db(transaction=True)
async def test_a_drain_past_its_deadline_ends_what_it_holds_and_goes_idle(registered_model, settings) -> None:
    """end_drain (run_replica's --drain-timeout): a stream already under way ends with one
    replica_unavailable error, as at a replica's loss, and every block comes back."""
    from serving.replica.faults import Faults

    settings.ALLOW_FAULT_INJECTION = True

    layer, replies = InMemoryChannelLayer(), WatchedReplies()
    replica = await _replica(layer, replies, faults=Faults(step_delay_ms=20))  # 500 tokens: ~10 s
    baseline = replica.engine.kv_cache.num_free_blocks
    try:
        await _submit(layer, replica, "long", max_tokens=500)
        await replies.until("long", "token")
        replica.drain()
        reason = "the replica stopped: its drain ran past 1 s"
        replica.end_drain(reason)
        events = await replies.ended("long")
        await asyncio.wait_for(replica.wait_idle(), timeout=10)
        assert [e for e in events if "finish_reason" in e] == [events[-1]]
        assert events[-1] == {
            "finish_reason": "error",
            "error": {"type": "replica_unavailable", "message": reason},
        }
        assert len([e for e in events if "token" in e]) < 500
        assert replica.engine.kv_cache.num_free_blocks == baseline
        assert replica.model_loop.routes == {}
        # Its stream had begun: an error its client saw, in the error rate the rollout judge reads, not a
        # refusal before any model work (the gateway retries only those).
        counters = replica.metrics.snapshot().totals.counters
        assert counters.get("errors") == 1 and counters.get("errors.replica_failed") == 1, counters
        assert "rejected" not in counters
    finally:
        await replica.stop()


class _DrainingReplica:
    """What run_replica's loop sees of a replica whose drain never ends by itself."""

    replica_id, ref = "r-1", type("Ref", (), {"model_name": "m", "version": "v1"})()
    is_ready, error = True, None

    def __init__(self) -> None:
        self.idle = asyncio.Event()
        self.ended_with: str | None = None
        self.calls: list[str] = []

    async def start(self) -> None:
        pass

    async def wait_failed(self) -> None:
        await asyncio.Event().wait()

    async def announce_drain(self) -> None:
        self.calls.append("announce_drain")

    def drain(self) -> None:
        self.calls.append("drain")

    async def wait_idle(self) -> None:
        await self.idle.wait()

    def heartbeat(self) -> Heartbeat:
        return type("Beat", (), {"num_running": 2, "num_waiting": 0})()  # type: ignore[return-value]

    def end_drain(self, message: str) -> None:
        self.ended_with = message
        self.idle.set()


async def test_run_replica_ends_a_drain_at_its_deadline(monkeypatch) -> None:
    import io

    from serving.management.commands import run_replica
    from serving.management.commands.run_replica import Command

    monkeypatch.setattr(run_replica, "ROUTED_AFTER_LEAVING_S", 0.0)
    replica, stopped, err = _DrainingReplica(), asyncio.Event(), io.StringIO()
    stopped.set()  # SIGTERM came
    command = Command(stdout=io.StringIO(), stderr=err)
    code = await asyncio.wait_for(command._run(replica, stopped, drain_timeout_s=0.2), timeout=10)
    assert code == 0
    assert replica.ended_with == "the replica stopped: its drain ran past 0.2 s"
    assert replica.calls == ["announce_drain", "drain"]
    assert "drain deadline (0.2 s) passed: ending 2 running, 0 waiting" in err.getvalue()


@pytest.mark.django_db(transaction=True)
async def test_run_replica_stopped_while_it_loads_never_goes_ready(registered_model, monkeypatch) -> None:
    """SIGTERM during a long load (a canary rolled back just after its replica was started): the process
    stops once the load is over, without beating ready, announcing a drain and waiting out its 1.5 s."""
    import io
    import threading

    from registry.selectors import version_ref
    from serving.management.commands.run_replica import Command

    loading, may_finish, real_load = threading.Event(), threading.Event(), Replica._load

    def slow_load(self):  # type: ignore[no-untyped-def]
        loading.set()
        may_finish.wait(30)
        return real_load(self)

    monkeypatch.setattr(Replica, "_load", slow_load)
    ref = await sync_to_async(version_ref)(model_name="demo-chat", version="v1")
    publisher = FakePublisher()
    replica = Replica(ref, layer=InMemoryChannelLayer(), replies=WatchedReplies(), publisher=publisher)
    stop_requested, out = asyncio.Event(), io.StringIO()
    command = Command(stdout=out, stderr=io.StringIO())
    running = asyncio.ensure_future(command._run(replica, stop_requested))
    await asyncio.to_thread(loading.wait, 10)
    stop_requested.set()  # SIGTERM
    assert await asyncio.wait_for(running, timeout=5) == 0  # at once, not after the load
    assert "stop requested while loading" in out.getvalue()
    may_finish.set()
    await asyncio.wait_for(replica.stop(), timeout=30)  # as run_replica's handle() does: waits the load out
    assert not await asyncio.wait_for(replica.wait_loaded(), timeout=5)
    assert {beat.state for beat in publisher.beats} <= {"loading"}
    assert publisher.withdrawn == [replica.replica_id]


@pytest.mark.django_db(transaction=True)
async def test_a_replica_leaving_beats_draining_at_once_and_serves_what_comes_meanwhile(
    registered_model,
) -> None:
    """SIGTERM: gateways learn from its beat to stop choosing it, but those that read the directory
    before that still send it requests for a moment; it serves them, rather than refusing them to be
    retried (and, were two replicas leaving at once, fail)."""
    layer, replies, publisher = InMemoryChannelLayer(), WatchedReplies(), FakePublisher()
    replica = await _replica(layer, replies, publisher=publisher)
    try:
        await replica.announce_drain()
        assert publisher.beats[-1].state == "draining"
        assert replica.heartbeat().state == "draining"
        await _submit(layer, replica, "late", max_tokens=3)
        _assert_one_whole_stream(await replies.ended("late"), num_tokens=3)
        replica.drain()
        await _submit(layer, replica, "after", max_tokens=3)
        (refusal,) = await replies.ended("after")
        assert refusal["error"]["type"] == "replica_unavailable"
    finally:
        await replica.stop()


class GatedPublisher(FakePublisher):
    """A publisher whose first beat waits for `gate`, as a Redis round trip under way does."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.waiting = asyncio.Event(), asyncio.Event()

    async def publish(self, beat: Heartbeat) -> None:
        if not self.waiting.is_set():
            self.waiting.set()
            await self.gate.wait()
        await super().publish(beat)


@pytest.mark.django_db(transaction=True)
async def test_a_beat_under_way_when_the_replica_leaves_is_not_written_after_its_draining_one(
    registered_model,
) -> None:
    publisher = GatedPublisher()
    replica = await _replica(InMemoryChannelLayer(), WatchedReplies(), publisher=publisher)
    try:
        await publisher.waiting.wait()  # a beat built before the replica left, its write under way
        announcing = asyncio.create_task(replica.announce_drain())
        await asyncio.sleep(0)  # the announcement starts while that write is under way
        publisher.gate.set()
        await asyncio.wait_for(announcing, timeout=10)
        states = [beat.state for beat in publisher.beats]
        assert states[-1] == "draining" and "draining" not in states[:-1], states
    finally:
        await replica.stop()
