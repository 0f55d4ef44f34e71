"""Replica failure handling in the gateway: circuit breaker and the one retry before the first token."""

import asyncio
import dataclasses

import pytest

from serving.gateway.breaker import CircuitBreaker
from serving.gateway.results import collect

pytestmark = pytest.mark.django_db(transaction=True)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _hello(tenant, *, max_tokens: int):  # type: ignore[no-untyped-def]
    """dispatch() of a greedy "hello" to demo-chat for `tenant`."""
    from serving.gateway import dispatch as dispatch_module

    params = {"max_tokens": max_tokens, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop": []}
    return dispatch_module.dispatch(
        context=tenant.context, path_model="demo-chat", pin=None, params=params, text="hello"
    )


def one_token_then(handle, monkeypatch, error_type: str, message: str, *, gave_up: bool = False) -> None:  # type: ignore[no-untyped-def]
    """The handle's next events, whatever its replica does: one token, then an error of `error_type`.
    `gave_up`: the error is the gateway's own (its liveness check), which leaves the replica's try to
    be aborted."""
    scripted = iter(
        [
            {"token": "Once", "index": 0},
            {"finish_reason": "error", "error": {"type": error_type, "message": message}},
        ]
    )

    async def next_event(*, timeout_s: float) -> dict:  # type: ignore[type-arg]
        event = next(scripted)
        handle._gave_up = gave_up and "error" in event
        return event

    monkeypatch.setattr(handle, "_next_event", next_event)


async def _a_replica_chosen_first(runtime, monkeypatch, replica_id: str, *, is_alive: bool):  # type: ignore[no-untyped-def]
    """A second replica of demo-chat:v1 that the router chooses whenever it is offered: `is_alive`, by its
    heartbeat, or dead. It has a channel of its own that nothing reads. Returns it and the real one."""
    from serving.gateway import in_flight

    (good,) = await runtime.candidates("demo-chat", "v1")
    extra = dataclasses.replace(good, replica_id=replica_id, channel_name=f"switchyard.replica.{replica_id}")
    real_candidates, real_is_alive = runtime.candidates, runtime.is_alive

    async def candidates(model_name: str, version: str):  # type: ignore[no-untyped-def]
        return [extra, *await real_candidates(model_name, version)]

    async def alive(handle):  # type: ignore[no-untyped-def]
        return is_alive if handle.replica_id == replica_id else await real_is_alive(handle)

    monkeypatch.setattr(in_flight, "choose_replica", lambda replicas, rng: replicas[0])
    monkeypatch.setattr(runtime, "candidates", candidates)
    monkeypatch.setattr(runtime, "is_alive", alive)
    return extra, good


async def _run_scripted(tenant, monkeypatch, script: list, *, max_tokens: int):  # type: ignore[no-untyped-def, type-arg]
    """A request of `tenant` whose replica's events, from the acceptance on, are `script`'s, whatever
    its replica does: the handle, closed, and the events the client got."""
    from serving.gateway.in_flight import InFlightRequest

    async def next_event(self, *, timeout_s: float) -> dict:  # type: ignore[no-untyped-def, type-arg]
        return script.pop(0)

    monkeypatch.setattr(InFlightRequest, "_next_event", next_event)
    handle = await _hello(tenant, max_tokens=max_tokens)
    try:
        events = [event async for event in handle.events()]
    finally:
        await handle.close()
    return handle, events


def test_breaker_opens_after_consecutive_failures_then_lets_one_trial_through() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=3, open_s=5.0, clock=clock)
    for _ in range(2):
        breaker.record_failure("r1")
    assert breaker.allows("r1") and breaker.claim("r1")
    breaker.record_success("r1")  # a success resets the count
    for _ in range(3):
        breaker.record_failure("r1")
    assert not breaker.allows("r1") and not breaker.claim("r1")
    assert breaker.allows("r2")
    clock.now = 5.1
    assert breaker.allows("r1") and breaker.allows("r1")  # half-open; asking claims nothing
    assert breaker.claim("r1")  # the one trial
    assert not breaker.allows("r1") and not breaker.claim("r1")  # and only one
    breaker.record_failure("r1", is_trial=True)  # the trial failed: open again
    assert not breaker.allows("r1")
    clock.now = 10.2
    assert breaker.claim("r1")
    breaker.record_accepted("r1", is_trial=True)
    assert breaker.claim("r1") and breaker.claim("r1")


def test_a_half_open_replica_keeps_its_trial_until_one_is_sent_and_the_trial_then_ends() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, open_s=5.0, trial_timeout_s=30.0, clock=clock)
    breaker.record_failure("r1")
    clock.now = 6.0
    # A candidate many times over, never the one chosen: it still has its trial.
    for _ in range(10):
        assert breaker.allows("r1")
    assert breaker.claim("r1") and not breaker.claim("r1")
    breaker.release("r1")  # the trial said nothing of the replica (refused by quota, say): another may try
    assert breaker.claim("r1")
    # A claim nobody settles stops counting after trial_timeout_s.
    clock.now = 35.9
    assert not breaker.allows("r1")
    clock.now = 36.1
    assert breaker.claim("r1")
    breaker.record_accepted("r1", is_trial=True)  # the replica took the trial: closed
    assert not breaker.is_open("r1") and breaker.claim("r1") and breaker.claim("r1")


def test_the_states_of_replicas_nothing_has_heard_of_for_long_are_dropped() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=3, open_s=5.0, forget_after_s=600.0, clock=clock)
    breaker.trip("died-long-ago")
    clock.now = 300.0
    breaker.record_failure("still-failing")
    clock.now = 650.0
    breaker.record_failure("still-failing")  # touched 350 s ago: kept; the dead one (650 s) is dropped
    assert set(breaker._states) == {"still-failing"}
    assert breaker.allows("died-long-ago") and not breaker.is_open("died-long-ago")


def test_only_its_trial_closes_an_open_breaker() -> None:
    """Work sent before the breaker opened (a stream that then ends well, an acceptance that comes late)
    says nothing of the replica now; nor may its failure, or a missed heartbeat, hand out a second
    trial while the first is under way."""
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, open_s=5.0, trial_timeout_s=60.0, clock=clock)
    breaker.record_failure("r1")
    breaker.record_success("r1")  # an older stream ends well
    breaker.record_accepted("r1")  # an older request's acceptance comes late
    assert breaker.is_open("r1") and not breaker.allows("r1")
    clock.now = 5.1
    assert breaker.claim("r1")  # the trial
    breaker.record_failure("r1")  # an older stream fails meanwhile: open 5 s more, the trial still on
    breaker.trip("r1")  # and a heartbeat is missed
    clock.now = 10.2
    assert not breaker.claim("r1")  # one trial at a time
    breaker.record_accepted("r1", is_trial=True)
    assert not breaker.is_open("r1") and breaker.claim("r1") and breaker.claim("r1")


def test_an_acceptance_keeps_a_closed_breakers_count_of_failures() -> None:
    breaker = CircuitBreaker(failure_threshold=2, open_s=5.0, clock=FakeClock())
    breaker.record_failure("r1")
    breaker.record_accepted("r1")  # accepted, then (say) lost mid-stream: the failures still add up
    breaker.record_failure("r1")
    assert breaker.is_open("r1")


async def test_a_half_open_replica_gets_one_trial_request_and_the_rest_go_elsewhere(
    make_tenant, runtime, monkeypatch
) -> None:
    import asyncio
    import contextlib

    from asgiref.sync import sync_to_async

    from serving.gateway import dispatch as dispatch_module
    from serving.gateway import in_flight

    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, open_s=5.0, clock=clock)
    monkeypatch.setattr(in_flight, "breaker", breaker)
    acme = await sync_to_async(make_tenant)("acme")
    # Alive by its heartbeat, but it never answers: its trial stays in flight.
    _, good = await _a_replica_chosen_first(runtime, monkeypatch, "silent", is_alive=True)
    breaker.record_failure("silent")
    clock.now = 6.0  # half-open

    def request():  # type: ignore[no-untyped-def]
        params = {"max_tokens": 2, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop": []}
        return dispatch_module.dispatch(
            context=acme.context, path_model="demo-chat", pin=None, params=params, text="hello"
        )

    trial = asyncio.create_task(request())
    async with asyncio.timeout(10):
        while breaker.allows("silent"):  # until the trial has claimed it
            await asyncio.sleep(0)
    handle = await request()  # preferred too, but its one trial is taken
    try:
        assert handle.replica.replica_id == good.replica_id
        events = [event async for event in handle.events()]
        assert [e["finish_reason"] for e in events if "finish_reason" in e] == ["length"]
    finally:
        await handle.close()
    trial.cancel()  # its client leaves before the replica answered: no verdict
    with contextlib.suppress(asyncio.CancelledError):
        await trial
    assert breaker.allows("silent") and breaker.is_open("silent")  # the next request is the trial


async def test_a_request_whose_replica_dies_before_its_first_token_is_retried_elsewhere(
    make_tenant, runtime, monkeypatch
) -> None:
    from asgiref.sync import sync_to_async

    from serving.gateway.breaker import breaker

    acme = await sync_to_async(make_tenant)("acme")
    _, good = await _a_replica_chosen_first(runtime, monkeypatch, "dead-replica", is_alive=False)

    handle = await _hello(acme, max_tokens=3)
    events = [event async for event in handle.events()]
    await handle.close()
    assert handle.num_retries == 1
    assert handle.replica.replica_id == good.replica_id
    assert [e["index"] for e in events if "token" in e] == [0, 1, 2]
    assert events[-1]["finish_reason"] == "length"
    breaker.record_success("dead-replica")  # one failure was recorded; leave no state for other tests


@pytest.mark.parametrize("store", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def test_an_over_quota_request_sends_nothing_to_a_replica(
    store, make_tenant, runtime, monkeypatch, request
) -> None:
    """With a Redis store the replica is chosen before admission (so that both can go to Redis
    together), but a refusal still costs the gateway alone: no submission and no abort reaches the
    replica. The first refusal comes from the combined step, the next ones from admission alone."""
    from asgiref.sync import sync_to_async

    from serving.gateway import dispatch as dispatch_module
    from serving.gateway.errors import GatewayError
    from serving.gateway.quota_memory import MemoryQuotaStore
    from serving.gateway.quota_store import reset_quota_store
    from serving.transport.protocol import SUBMIT

    if store == "redis":
        from serving.gateway.quota_redis import RedisQuotaStore

        quota = RedisQuotaStore(request.getfixturevalue("redis_url"), key_prefix="test:quota-dispatch:")
        quota.clear()
    else:
        quota = MemoryQuotaStore()
    reset_quota_store(quota)  # the autouse fixture resets it after the test
    burst_of_one = await sync_to_async(make_tenant)("burst", requests_per_second=0.001)
    sent: list[str] = []
    send = runtime.layer.send

    async def watched_send(channel: str, message: dict) -> None:  # type: ignore[type-arg]
        if channel.startswith("switchyard.replica."):
            sent.append(message["type"])
        await send(channel, message)

    monkeypatch.setattr(runtime.layer, "send", watched_send)
    params = {"max_tokens": 2, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop": []}
    handle = await dispatch_module.dispatch(
        context=burst_of_one.context, path_model="demo-chat", pin=None, params=params, text="hello"
    )
    assert [e for e in [event async for event in handle.events()] if "finish_reason" in e]
    await handle.close()
    for _ in range(3):
        with pytest.raises(GatewayError) as refused:
            await dispatch_module.dispatch(
                context=burst_of_one.context, path_model="demo-chat", pin=None, params=params, text="hello"
            )
        assert refused.value.status == 429
    assert sent == [SUBMIT]


async def test_a_replica_that_misses_its_heartbeats_waits_out_the_open_breaker_when_it_returns() -> None:
    import time

    from channels.layers import InMemoryChannelLayer

    from serving.gateway.breaker import breaker
    from serving.runtime import Runtime
    from serving.transport.protocol import STALE_AFTER_S
    from serving.transport.replica_directory import MISSED_AFTER_S, Heartbeat

    class Directory:  # what the other processes' heartbeats say (Redis in production)
        # Stale, but no older than a beat read from the directory's cache can be: not tripped for that.
        sent_at = time.time() - (STALE_AFTER_S + MISSED_AFTER_S) / 2

        async def replicas(self, model_name: str, version: str, **_: bool) -> list[Heartbeat]:
            beat = Heartbeat(
                "far", model_name, version, "switchyard.replica.x", "ready", 0, 0, 0.0, self.sent_at
            )
            return [beat]

    runtime = Runtime(InMemoryChannelLayer())
    runtime.directory = Directory()  # type: ignore[assignment]
    try:
        (cached,) = await runtime.candidates("m", "v1")
        assert not cached.is_ready and not breaker.is_open("far")
        Directory.sent_at = time.time() - MISSED_AFTER_S - 1  # its last beat: missed ones since
        (stale,) = await runtime.candidates("m", "v1")
        assert not stale.is_ready and breaker.is_open("far")
        Directory.sent_at = time.time()  # it beats again: ready, but the breaker holds it back a while
        (back,) = await runtime.candidates("m", "v1")
        assert back.is_ready and not breaker.allows("far")
    finally:
        breaker.record_success("far")  # leave no state for other tests


async def test_a_retry_aborts_the_try_left_on_a_replica_that_went_silent(
    make_tenant, runtime, monkeypatch
) -> None:
    """A replica alive by its heartbeat that does not accept in time may only be slow: the request is
    retried elsewhere, and its first try is aborted there, or it would run on beside the retry."""
    from asgiref.sync import sync_to_async

    from serving.gateway import in_flight
    from serving.gateway.breaker import breaker
    from serving.transport.protocol import ABORT, SUBMIT

    acme = await sync_to_async(make_tenant)("acme")
    slow, good = await _a_replica_chosen_first(runtime, monkeypatch, "slow-replica", is_alive=True)
    sent: list[tuple[str, str, str]] = []
    send = runtime.layer.send

    async def watched_send(channel: str, message: dict) -> None:  # type: ignore[type-arg]
        if channel.startswith("switchyard.replica."):
            sent.append((channel, message["type"], message["request_id"]))
        await send(channel, message)

    monkeypatch.setattr(in_flight, "ACCEPT_TIMEOUT_S", 0.2)
    monkeypatch.setattr(in_flight, "LIVENESS_CHECK_S", 0.05)
    monkeypatch.setattr(runtime.layer, "send", watched_send)
    try:
        handle = await _hello(acme, max_tokens=2)
        events = [event async for event in handle.events()]
        await handle.close()
    finally:
        breaker.record_success("slow-replica")  # one failure was recorded; leave no state for other tests
    assert handle.num_retries == 1 and handle.replica.replica_id == good.replica_id
    assert events[-1]["finish_reason"] == "length"
    first_try = handle.request_id
    assert sent[:2] == [(slow.channel_name, SUBMIT, first_try), (slow.channel_name, ABORT, first_try)]
    assert (good.channel_name, SUBMIT, f"{first_try}-1") in sent


async def test_a_request_that_fails_after_some_text_is_an_error_not_a_partial_answer(
    make_tenant, runtime, monkeypatch
) -> None:
    """Without a stream there is nothing to cut off part-way: the client gets a 503 to retry, not a
    200 holding half an answer, no usage and a finish_reason no client knows."""
    from asgiref.sync import sync_to_async

    from serving.gateway.errors import GatewayError

    acme = await sync_to_async(make_tenant)("acme")
    handle = await _hello(acme, max_tokens=2)
    one_token_then(handle, monkeypatch, "internal_error", "the step failed")
    with pytest.raises(GatewayError) as failed:
        await collect(handle)
    assert failed.value.status == 503 and failed.value.message == "the step failed"
    assert failed.value.headers["Retry-After"] == "1"


async def test_a_lost_acceptance_does_not_lose_the_first_token(make_tenant, runtime, monkeypatch) -> None:
    """Steps published while the gateway's reply hub reconnects to Redis are lost; when the acceptance
    is, the first event to arrive is a token, which was taken for the acceptance and dropped."""
    from asgiref.sync import sync_to_async

    acme = await sync_to_async(make_tenant)("acme")
    token = {"token": "Once", "index": 0}
    final = {"finish_reason": "length", "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    handle, events = await _run_scripted(acme, monkeypatch, [token, final], max_tokens=1)
    assert events == [token, final]
    assert handle.num_prompt_tokens == 3  # from the usage: the quota settles on what the prompt took


async def test_a_step_lost_on_the_way_ends_the_stream_in_an_error_and_frees_its_blocks(
    make_tenant, runtime, monkeypatch
) -> None:
    """Redis pub/sub drops what a replica publishes while the gateway's subscriber reconnects. A stream
    that lost a step has a hole in its text: it must not end "length" as if whole."""
    from asgiref.sync import sync_to_async

    from serving.gateway.breaker import breaker
    from serving.transport.protocol import ABORT, SUBMIT

    acme = await sync_to_async(make_tenant)("acme")
    deliver = runtime.hub.deliver
    dropped = []

    def lossy_deliver(message):  # type: ignore[no-untyped-def]
        for item in message.get("items", ()):
            if any(event.get("index") == 1 for event in item["events"]):
                dropped.append(item["request_id"])
                message = {**message, "items": [i for i in message["items"] if i is not item]}
        deliver(message)

    monkeypatch.setattr(runtime.hub, "deliver", lossy_deliver)
    sent, send = [], runtime.layer.send

    async def recorded_send(channel, message):  # type: ignore[no-untyped-def]
        sent.append((message["type"], message["request_id"]))
        await send(channel, message)

    monkeypatch.setattr(runtime.layer, "send", recorded_send)
    handle = await _hello(acme, max_tokens=6)
    try:
        events = [event async for event in handle.events()]
    finally:
        await handle.close()
    assert dropped == [handle.request_id]
    assert [e["index"] for e in events if "token" in e] == [0]
    assert events[-1]["finish_reason"] == "error" and events[-1]["error"]["type"] == "tokens_lost"
    # The rest of its generation was aborted on the replica, and the loss is not the replica's fault.
    assert sent == [(SUBMIT, handle.request_id), (ABORT, handle.request_id)]
    (replica,) = runtime.replicas.values()
    await replica.wait_idle()
    assert replica.engine.stats().kv_cache_usage == 0.0
    assert breaker.allows(handle.replica.replica_id) and not breaker.is_open(handle.replica.replica_id)
    assert runtime.failures._recorders == {}


async def test_a_final_event_counting_tokens_that_never_came_is_an_error(
    make_tenant, runtime, monkeypatch
) -> None:
    from asgiref.sync import sync_to_async

    acme = await sync_to_async(make_tenant)("acme")
    token = {"token": "Once", "index": 0}
    final = {"finish_reason": "length", "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    accepted = {"accepted": True, "num_prompt_tokens": 3}
    _, events = await _run_scripted(acme, monkeypatch, [accepted, token, final], max_tokens=2)
    assert events[0] == token
    assert events[-1]["error"]["type"] == "tokens_lost"
    # Its acceptance lost too: the quota still settles on the prompt the final event counts.
    handle, events = await _run_scripted(acme, monkeypatch, [token, final], max_tokens=2)
    assert events[-1]["error"]["type"] == "tokens_lost" and handle.num_prompt_tokens == 3


async def test_a_stream_cancelled_during_a_liveness_check_ends_though_the_check_lost_it(
    make_tenant, runtime, monkeypatch
) -> None:
    """The client leaves while the gateway reads its replica's heartbeat in Redis, and the read loses
    the cancellation (serving/cancelling.py): the stream must end, not wait on for the replica's events
    and hold the tenant's concurrency slot."""
    import asyncio

    from asgiref.sync import sync_to_async

    from serving.gateway import in_flight

    acme = await sync_to_async(make_tenant)("acme")
    handle = await _hello(acme, max_tokens=2)
    assert [event async for event in handle.events()][-1]["finish_reason"] == "length"
    checking, lost = asyncio.Event(), asyncio.Event()

    async def alive_losing_the_cancellation(replica):  # type: ignore[no-untyped-def]
        checking.set()
        try:
            await asyncio.sleep(3600)  # the Redis read
        except asyncio.CancelledError:
            if lost.is_set():
                raise
            lost.set()
        return True

    monkeypatch.setattr(in_flight, "LIVENESS_CHECK_S", 0.01)
    monkeypatch.setattr(runtime, "is_alive", alive_losing_the_cancellation)
    waiting = asyncio.create_task(handle._next_event(timeout_s=60))  # nothing more will come
    await checking.wait()
    waiting.cancel()
    done, _ = await asyncio.wait({waiting}, timeout=5)
    if not done:
        waiting.cancel()
    assert lost.is_set()
    assert done and waiting.cancelled(), "the stream waited on after its client had left"
    await handle.close()


async def test_a_retry_whose_replica_went_silent_is_aborted_there_when_the_stream_ends(
    make_tenant, runtime, monkeypatch
) -> None:
    """Accepted, then its replica dies before the first token: the retry goes to a replica alive by its
    heartbeat that never accepts. The stream ends in an error, and the try left there is aborted; or it
    would run to max_tokens for nobody, on the one replica already too slow."""
    from asgiref.sync import sync_to_async

    from serving.gateway import in_flight
    from serving.gateway.breaker import breaker
    from serving.gateway.in_flight import InFlightRequest
    from serving.transport.protocol import ABORT

    acme = await sync_to_async(make_tenant)("acme")
    (good,) = await runtime.candidates("demo-chat", "v1")
    dead, slow = (
        dataclasses.replace(good, replica_id=rid, channel_name=f"switchyard.replica.{rid}")
        for rid in ("dead-replica", "slow-replica")
    )
    real_candidates, real_next_event, send = (
        runtime.candidates,
        InFlightRequest._next_event,
        runtime.layer.send,
    )

    async def candidates(model_name: str, version: str):  # type: ignore[no-untyped-def]
        return [dead, slow, *await real_candidates(model_name, version)]

    async def alive(handle) -> bool:  # type: ignore[no-untyped-def]
        return handle.replica_id != dead.replica_id

    async def next_event(self, *, timeout_s: float) -> dict:  # type: ignore[no-untyped-def, type-arg]
        if self.replica.replica_id != dead.replica_id:
            return await real_next_event(self, timeout_s=timeout_s)
        if not self.num_prompt_tokens:
            return {"accepted": True, "num_prompt_tokens": 1}
        self._gave_up = True  # as the liveness check leaves it
        return {"finish_reason": "error", "error": {"type": "replica_lost", "message": "it stopped"}}

    sent: list[tuple[str, str, str]] = []

    async def watched_send(channel: str, message: dict) -> None:  # type: ignore[type-arg]
        if channel.startswith("switchyard.replica."):
            sent.append((channel, message["type"], message["request_id"]))
        await send(channel, message)

    monkeypatch.setattr(in_flight, "choose_replica", lambda replicas, rng: replicas[0])
    monkeypatch.setattr(in_flight, "ACCEPT_TIMEOUT_S", 0.2)
    monkeypatch.setattr(in_flight, "LIVENESS_CHECK_S", 0.05)
    monkeypatch.setattr(runtime, "candidates", candidates)
    monkeypatch.setattr(runtime, "is_alive", alive)
    monkeypatch.setattr(runtime.layer, "send", watched_send)
    monkeypatch.setattr(InFlightRequest, "_next_event", next_event)
    try:
        handle = await _hello(acme, max_tokens=2)
        events = [event async for event in handle.events()]
        await handle.close()
    finally:
        for replica in (dead, slow):  # failures were recorded; leave no state for other tests
            breaker.record_success(replica.replica_id)
    assert handle.num_retries == 1 and handle.replica.replica_id == slow.replica_id
    assert events[-1]["finish_reason"] == "error"
    assert (slow.channel_name, ABORT, f"{handle.request_id}-1") in sent


async def test_tokens_that_came_but_were_never_read_are_charged(make_tenant, runtime, monkeypatch) -> None:
    """A client that stops reading (cut off as a slow reader, or gone) is charged for every token its
    replica generated and sent, not only those it read: else unread tokens would be free."""
    import asyncio

    from asgiref.sync import sync_to_async

    from serving.gateway.quota_store import quota_store

    acme = await sync_to_async(make_tenant)("acme")
    all_sent, deliver = asyncio.Event(), runtime.hub.deliver
    settled: list[int] = []
    release = quota_store().arelease

    def watched_deliver(message: dict) -> None:  # type: ignore[type-arg]
        deliver(message)
        if any("finish_reason" in e for item in message.get("items", ()) for e in item["events"]):
            all_sent.set()

    async def watched_release(ticket, *, used_tokens: int) -> None:  # type: ignore[no-untyped-def]
        settled.append(used_tokens)
        await release(ticket, used_tokens=used_tokens)

    monkeypatch.setattr(runtime.hub, "deliver", watched_deliver)
    monkeypatch.setattr(quota_store(), "arelease", watched_release)
    handle = await _hello(acme, max_tokens=12)
    events = handle.events()
    assert "token" in await events.__anext__()  # the client reads one token, then nothing more
    await asyncio.wait_for(all_sent.wait(), timeout=30)
    await events.aclose()
    await handle.close()
    assert handle.num_prompt_tokens > 0
    assert settled == [handle.num_prompt_tokens + 12]


async def test_a_stream_whose_tokens_keep_coming_ends_though_a_call_lost_its_cancellation(
    make_tenant, runtime, monkeypatch
) -> None:
    """The client leaves while a Redis call on the stream's way loses the cancellation (as redis-py can
    on Python 3.11): with tokens arriving back to back no idle wait ever notices, so the stream itself
    must, or it runs to max_tokens with the tenant's slot held."""
    import asyncio
    import contextlib

    from asgiref.sync import sync_to_async

    from serving.gateway.in_flight import InFlightRequest

    acme = await sync_to_async(make_tenant)("acme")
    handle = await _hello(acme, max_tokens=100)
    calls, in_call = iter(range(1000)), asyncio.Event()

    async def next_event(self, *, timeout_s: float) -> dict:  # type: ignore[no-untyped-def, type-arg]
        index = next(calls)
        if index == 0:
            in_call.set()
            with contextlib.suppress(asyncio.CancelledError):  # lost, by the call the disconnect lands on
                await asyncio.sleep(3600)
        if index < 100:
            return {"token": "x", "index": index}
        return {"finish_reason": "length", "usage": {"prompt_tokens": 1, "completion_tokens": 100}}

    monkeypatch.setattr(InFlightRequest, "_next_event", next_event)
    received: list[dict] = []  # type: ignore[type-arg]

    async def read() -> None:
        async for event in handle.events():
            received.append(event)

    reader = asyncio.create_task(read())
    await in_call.wait()
    reader.cancel()
    await asyncio.wait({reader}, timeout=10)
    await handle.close()
    assert reader.cancelled()
    assert len(received) < 100


async def test_aborts_that_find_the_replicas_channel_full_are_sent_again(
    make_tenant, runtime, monkeypatch
) -> None:
    """Clients leaving all at once (a load balancer's reset) send their aborts in one turn of the loop,
    past what the replica's channel holds: one lost there would leave its sequence running to
    max_tokens, holding its blocks, for nobody."""
    from asgiref.sync import sync_to_async
    from channels.exceptions import ChannelFull

    from serving.gateway.in_flight import close_all
    from serving.transport.protocol import ABORT

    acme = await sync_to_async(make_tenant)("acme")
    (replica,) = runtime.replicas.values()
    aborted_before = replica.metrics.snapshot().totals.counters.get("aborted", 0)
    handles = [await _hello(acme, max_tokens=2000) for _ in range(3)]
    for handle in handles:  # each has a token: running on the replica
        assert "token" in await handle.events().__anext__()
    refused, send = [], runtime.layer.send

    async def full_at_first(channel, message):  # type: ignore[no-untyped-def]
        if message["type"] == ABORT and message["request_id"] not in refused:
            refused.append(message["request_id"])
            raise ChannelFull(channel)
        await send(channel, message)

    monkeypatch.setattr(runtime.layer, "send", full_at_first)
    await close_all(handles)
    assert sorted(refused) == sorted(h.request_id for h in handles)
    await asyncio.wait_for(replica.wait_idle(), timeout=10)
    assert replica.metrics.snapshot().totals.counters.get("aborted", 0) - aborted_before == 3
    assert replica.engine.stats().kv_cache_usage == 0.0


async def test_a_request_closed_while_its_retry_looks_for_a_replica_sends_nothing_more(
    make_tenant, runtime, monkeypatch
) -> None:
    """The end of an n-choice stream closes every choice from its own task, one perhaps in the middle of
    its retry: what the retry then sent, nothing would abort."""
    from asgiref.sync import sync_to_async

    from serving.gateway.in_flight import InFlightRequest
    from serving.transport.protocol import REPLICA_LOST, SUBMIT

    acme = await sync_to_async(make_tenant)("acme")
    script = [
        {"accepted": True, "num_prompt_tokens": 1},
        {"finish_reason": "error", "error": {"type": REPLICA_LOST, "message": "gone"}},
    ]

    async def next_event(self, *, timeout_s: float) -> dict:  # type: ignore[no-untyped-def, type-arg]
        return script.pop(0) if script else {"finish_reason": "length", "usage": {"completion_tokens": 0}}

    monkeypatch.setattr(InFlightRequest, "_next_event", next_event)
    # Two replicas: the first try goes to one (scripted to die), the retry would go to the other.
    await _a_replica_chosen_first(runtime, monkeypatch, "extra", is_alive=True)
    handle = await _hello(acme, max_tokens=4)
    assert handle.replica.replica_id == "extra"
    real_candidates, sent, send = runtime.candidates, [], runtime.layer.send

    async def closed_meanwhile(model_name: str, version: str):  # type: ignore[no-untyped-def]
        await handle.close()  # as the stream's end does, from another task
        return await real_candidates(model_name, version)

    async def recorded_send(channel, message):  # type: ignore[no-untyped-def]
        sent.append((message["type"], message["request_id"]))
        await send(channel, message)

    monkeypatch.setattr(runtime, "candidates", closed_meanwhile)
    monkeypatch.setattr(runtime.layer, "send", recorded_send)
    events = [event async for event in handle.events()]
    assert not any(kind == SUBMIT for kind, _ in sent), sent  # no retry reached a replica
    assert events[-1]["finish_reason"] == "error"
    assert not [wire for wire in runtime.hub._queues if wire.startswith(handle.request_id)]


async def test_an_abort_waiting_for_room_holds_up_neither_the_close_nor_the_quota(
    make_tenant, runtime, monkeypatch
) -> None:
    """The channel of a replica that died stays full until it expires: its requests' closes (and so
    their responses' ends and their quota slots) must not wait out the abort's retries."""
    from asgiref.sync import sync_to_async
    from channels.exceptions import ChannelFull

    from serving.gateway import aborts
    from serving.gateway.quota_store import quota_store
    from serving.transport.protocol import ABORT

    acme = await sync_to_async(make_tenant)("acme")
    (replica,) = runtime.replicas.values()
    handle = await _hello(acme, max_tokens=2000)
    assert "token" in await handle.events().__anext__()
    is_full, send = True, runtime.layer.send

    async def full_for_aborts(channel, message):  # type: ignore[no-untyped-def]
        if message["type"] == ABORT and is_full:
            raise ChannelFull(channel)
        await send(channel, message)

    monkeypatch.setattr(runtime.layer, "send", full_for_aborts)
    await asyncio.wait_for(handle.close(), timeout=1)  # not the 5 s the abort may retry for
    assert quota_store().usage([acme.context])[acme.context.tenant_id].num_in_flight == 0
    (waiting,) = aborts._aborts_waiting
    is_full = False  # room again: the abort goes through, and the sequence ends
    await asyncio.wait_for(waiting, timeout=10)
    await asyncio.wait_for(replica.wait_idle(), timeout=10)
    assert replica.engine.stats().kv_cache_usage == 0.0
