"""Scaling to zero, at the gateway: a request for a version that has no replica waits while one starts
(a cold start), and asks the autoscaler for it through Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]
PARAMS = {"max_tokens": 3, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop": []}


@pytest.fixture
async def remote_runtime(redis_url: str) -> AsyncIterator[Any]:
    """A gateway's runtime that hosts no replica and learns of replicas from their heartbeats in Redis,
    as in production; messages go over the in-memory layer, which a replica of the test joins."""
    import redis.asyncio as aioredis
    from channels.layers import InMemoryChannelLayer

    from serving.runtime import Runtime
    from serving.transport.replica_directory import ReplicaDirectory

    client = aioredis.Redis.from_url(redis_url)
    await client.flushdb()
    runtime = Runtime(InMemoryChannelLayer())
    runtime.directory = ReplicaDirectory(redis_url)
    await runtime.start(embedded_replicas=False)
    try:
        yield runtime
    finally:
        await runtime.stop()
        await client.flushdb()
        await client.aclose()


def _dispatch(runtime: Any, *, cold_start: bool, counts_failures: bool = False) -> Any:
    from serving.gateway.in_flight import InFlightRequest

    submission = {
        "reply_to": runtime.hub.channel_name,
        "input": "hello",
        "messages": None,
        "inputs": None,
        "params": PARAMS,
        "tenant": "t",
        "cache_group": "t",
    }
    return InFlightRequest(
        runtime, None, "demo-chat", "v1", submission, cold_start=cold_start, counts_failures=counts_failures
    )


async def _demand(redis_url: str) -> bytes | None:
    import redis.asyncio as aioredis

    from serving.transport.replica_directory import DEMAND_KEY

    client = aioredis.Redis.from_url(redis_url)
    try:
        value: bytes | None = await client.hget(DEMAND_KEY, "demo-chat:v1")
        return value
    finally:
        await client.aclose()


async def test_a_request_waits_for_a_replica_to_start_and_is_served_by_it(
    registered_model: Any, remote_runtime: Any, redis_url: str
) -> None:
    from asgiref.sync import sync_to_async

    from registry.selectors import version_ref
    from serving.replica.replica import Replica
    from serving.transport.replica_directory import HeartbeatPublisher

    handle = _dispatch(remote_runtime, cold_start=True)
    waiting = asyncio.create_task(handle.submit())
    async with asyncio.timeout(10):  # the gateway tells the autoscaler it wants a replica
        while await _demand(redis_url) is None:
            await asyncio.sleep(0.05)
    assert not waiting.done()

    ref = await sync_to_async(version_ref)(model_name="demo-chat", version="v1")
    replica = Replica(ref, layer=remote_runtime.layer, publisher=HeartbeatPublisher(redis_url))
    try:
        await replica.start()  # loads, reports ready in its heartbeat
        async with asyncio.timeout(30):
            await waiting
        events = [event async for event in handle.events()]
        assert handle.replica.replica_id == replica.replica_id
        assert [e["index"] for e in events if "token" in e] == [0, 1, 2]
        assert events[-1]["finish_reason"] == "length"
    finally:
        await handle.close()
        await replica.stop()


async def test_a_cold_start_past_its_timeout_is_a_503_and_without_scaling_to_zero_the_503_is_at_once(
    registered_model: Any, remote_runtime: Any, redis_url: str, settings: Any
) -> None:
    from serving.gateway.errors import GatewayError

    handle = _dispatch(remote_runtime, cold_start=False)
    with pytest.raises(GatewayError, match="no ready replica for demo-chat:v1") as at_once:
        await handle.submit()
    assert at_once.value.status == 503 and await _demand(redis_url) is None
    await handle.close()

    settings.COLD_START_TIMEOUT_S = 0.5
    handle = _dispatch(remote_runtime, cold_start=True)
    with pytest.raises(GatewayError, match=r"became ready within 0\.5 s") as timed_out:
        await handle.submit()
    assert timed_out.value.status == 503 and timed_out.value.retry_after_s == 5
    assert await _demand(redis_url) is not None
    await handle.close()


async def test_a_request_waiting_for_a_version_its_routing_then_moves_away_from_gets_its_503_at_once(
    registered_model: Any, remote_runtime: Any, redis_url: str, demo_model_dir: Any
) -> None:
    """A rollback while requests wait for the version's first replica: the autoscaler starts none for
    it now, so they would wait out COLD_START_TIMEOUT_S (120 s), or be served by the version just rolled
    back should its replica come up anyway."""
    from asgiref.sync import sync_to_async

    from registry.services import alias_set, model_version_register, routing_table_set
    from serving.gateway.errors import GatewayError

    handle = _dispatch(remote_runtime, cold_start=True)
    waiting = asyncio.create_task(handle.submit())
    async with asyncio.timeout(10):
        while await _demand(redis_url) is None:  # it waits, and has asked for a replica
            await asyncio.sleep(0.05)

    def roll_back_to_v2() -> None:
        v2 = model_version_register(name="demo-chat", version="v2", source_dir=demo_model_dir, created_by="t")
        alias_set(model=v2.model, name="stable", version=v2, actor="test")
        routing_table_set(model=v2.model, weights={"v2": 100})

    await sync_to_async(roll_back_to_v2)()
    with pytest.raises(GatewayError, match="takes no traffic any more") as moved:
        async with asyncio.timeout(5):  # within the routing cache's second, not the 120-s wait
            await waiting
    assert moved.value.status == 503 and moved.value.retry_after_s == 1
    await handle.close()


async def test_requests_waiting_for_one_version_share_one_poll_and_it_stops_when_they_leave(
    registered_model: Any, remote_runtime: Any, redis_url: str
) -> None:
    handles = [_dispatch(remote_runtime, cold_start=True) for _ in range(3)]
    waiting = [asyncio.create_task(handle.submit()) for handle in handles]
    async with asyncio.timeout(10):
        while await _demand(redis_url) is None:
            await asyncio.sleep(0.05)
    (cold,) = remote_runtime._cold_starts.values()
    assert cold.num_waiting == 3
    waiting[0].cancel()  # a client leaves: the others wait on
    await asyncio.gather(waiting[0], return_exceptions=True)
    assert cold.num_waiting == 2 and not cold.poller.done()
    for task in waiting[1:]:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert remote_runtime._cold_starts == {}
    await asyncio.gather(cold.poller, return_exceptions=True)
    assert cold.poller.cancelled()
    for handle in handles:
        await handle.close()


async def test_a_request_held_for_a_cold_start_holds_its_quota_slot_and_gives_it_back_when_it_leaves(
    registered_model: Any, remote_runtime: Any, redis_url: str, make_tenant: Any, monkeypatch: Any
) -> None:
    """Through dispatch(), as the views call it: the routing table says the model scales to zero."""
    from asgiref.sync import sync_to_async

    from registry.models import Model
    from rollouts.scaling import scaling_bounds_set
    from serving.gateway import dispatch as dispatch_module
    from serving.gateway.errors import GatewayError
    from serving.gateway.router import routing_cache

    model = await Model.objects.aget(name="demo-chat")
    await sync_to_async(scaling_bounds_set)(model=model, min_replicas=0, max_replicas=1)
    routing_cache.clear()
    one_at_a_time = await sync_to_async(make_tenant)("solo", max_concurrent_requests=1)

    async def runtime() -> Any:
        return remote_runtime

    monkeypatch.setattr(dispatch_module, "data_plane", runtime)

    def request() -> Any:
        return dispatch_module.dispatch(
            context=one_at_a_time.context, path_model="demo-chat", pin=None, params=PARAMS, text="hello"
        )

    waiting = asyncio.create_task(request())
    async with asyncio.timeout(10):
        while await _demand(redis_url) is None:
            await asyncio.sleep(0.05)
    with pytest.raises(GatewayError) as refused:  # its one slot is the waiting request's
        await request()
    assert refused.value.status == 429
    waiting.cancel()  # the client leaves: its slot is free again, and its wait is over
    await asyncio.gather(waiting, return_exceptions=True)
    assert remote_runtime._cold_starts == {}
    again = asyncio.create_task(request())
    async with asyncio.timeout(10):
        while not remote_runtime._cold_starts:
            await asyncio.sleep(0.05)
    assert not again.done()  # waiting, not refused
    again.cancel()
    await asyncio.gather(again, return_exceptions=True)


@pytest.fixture
async def pin_waiting(
    registered_model: Any,
    remote_runtime: Any,
    redis_url: str,
    make_tenant: Any,
    monkeypatch: Any,
    demo_model_dir: Any,
) -> asyncio.Task[Any]:
    """A request of a tenant allowed to pin, pinned to demo-chat v2 (registered here, without traffic),
    dispatched on the remote runtime; given once its gateway has told the autoscaler it waits."""
    import redis.asyncio as aioredis
    from asgiref.sync import sync_to_async

    from registry.services import model_version_register
    from serving.gateway import dispatch as dispatch_module
    from serving.gateway.router import routing_cache
    from serving.transport.replica_directory import DEMAND_KEY

    await sync_to_async(model_version_register)(name="demo-chat", version="v2", source_dir=demo_model_dir)
    routing_cache.clear()
    pinner = await sync_to_async(make_tenant)("pinner", may_pin=True)

    async def runtime() -> Any:
        return remote_runtime

    monkeypatch.setattr(dispatch_module, "data_plane", runtime)
    waiting = asyncio.create_task(
        dispatch_module.dispatch(
            context=pinner.context, path_model="demo-chat", pin="v2", params=PARAMS, text="hi"
        )
    )
    client = aioredis.Redis.from_url(redis_url)
    try:
        async with asyncio.timeout(10):
            while await client.hget(DEMAND_KEY, "demo-chat:v2") is None:
                await asyncio.sleep(0.05)
    finally:
        await client.aclose()
    return waiting


async def test_a_request_pinned_to_a_version_without_traffic_waits_and_asks_the_autoscaler_for_it(
    remote_runtime: Any, redis_url: str, pin_waiting: asyncio.Task[Any]
) -> None:
    """Through the provisioner as in the embedded mode (issue 43: it was a 503 at once): the pin's wait is
    the gateway's demand in Redis, from which the autoscaler gives the version a replica
    (tests/rollouts/fleet/test_pinned_demand.py); the request is served by it once it is ready. Its
    version has no traffic, so the wait does not end for that (as a scaled-to-zero version's does)."""
    from asgiref.sync import sync_to_async

    from registry.selectors import version_ref
    from serving.replica.replica import Replica
    from serving.transport.replica_directory import HeartbeatPublisher

    waiting = pin_waiting
    await asyncio.sleep(0.5)  # past a poll or two: still waiting, not refused for having no traffic
    assert not waiting.done()

    ref = await sync_to_async(version_ref)(model_name="demo-chat", version="v2")
    replica = Replica(ref, layer=remote_runtime.layer, publisher=HeartbeatPublisher(redis_url))
    try:
        await replica.start()  # what the provisioner runs for the autoscaler's target
        async with asyncio.timeout(30):
            handle = await waiting
        assert handle.version == "v2" and handle.replica.replica_id == replica.replica_id
        await handle.close()
    finally:
        await replica.stop()


async def test_a_pin_the_autoscaler_declines_is_a_503_saying_why_at_once_not_at_the_timeout(
    redis_url: str, settings: Any, pin_waiting: asyncio.Task[Any]
) -> None:
    """A fleet that starts no replica for versions without traffic (PROVISIONER_MAX_PINNED 0, or that many
    warm already): the autoscaler's tick declines the pinned version in Redis
    (serving.selectors.publish_pin_declines), and the request that waits gets a 503 saying why at the
    gateway's next demand, where it used to wait out COLD_START_TIMEOUT_S for a replica nobody would start."""
    from asgiref.sync import sync_to_async

    from rollouts.scaling import autoscale
    from serving.gateway.errors import GatewayError
    from serving.runtime import PIN_DECLINED_RETRY_S

    settings.REDIS_URL = redis_url  # the autoscaler's tick reads the demand and writes its word there
    settings.PROVISIONER_MAX_PINNED = 0
    waiting = pin_waiting  # for up to COLD_START_TIMEOUT_S (120 s) before this change
    assert await sync_to_async(autoscale)(heartbeats=[]) == {("demo-chat", "v1"): 1}  # none for v2
    async with asyncio.timeout(5):  # the gateway's next demand, within DEMAND_EVERY_S
        with pytest.raises(GatewayError, match="none will be started: this fleet starts no") as refused:
            await waiting
    assert refused.value.status == 503 and refused.value.retry_after_s == PIN_DECLINED_RETRY_S


async def test_a_pin_by_a_tenant_that_may_not_pin_asks_for_nothing(
    registered_model: Any, remote_runtime: Any, redis_url: str, make_tenant: Any, demo_model_dir: Any
) -> None:
    from asgiref.sync import sync_to_async

    from registry.services import model_version_register
    from serving.gateway import dispatch as dispatch_module
    from serving.gateway.errors import GatewayError

    await sync_to_async(model_version_register)(name="demo-chat", version="v2", source_dir=demo_model_dir)
    plain = await sync_to_async(make_tenant)("plain")
    with pytest.raises(GatewayError) as refused:
        await dispatch_module.dispatch(
            context=plain.context, path_model="demo-chat", pin="v2", params=PARAMS, text="hi"
        )
    assert refused.value.status == 403
    assert remote_runtime._cold_starts == {}


async def test_a_replica_process_beats_loading_while_it_loads_and_its_503s_are_not_the_versions_failures(
    registered_model: Any, remote_runtime: Any, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica process restarting: until it beat, a gateway saw no replica at all, and counted each
    request's 503 meanwhile against the version, as if it had lost every replica."""
    import threading

    from asgiref.sync import sync_to_async

    from registry.selectors import version_ref
    from serving.gateway.errors import GatewayError
    from serving.replica.replica import Replica
    from serving.transport.replica_directory import HeartbeatPublisher

    loaded = threading.Event()
    real_load = Replica._load

    def slow_load(self):  # type: ignore[no-untyped-def]
        loaded.wait(30)
        return real_load(self)

    monkeypatch.setattr(Replica, "_load", slow_load)
    ref = await sync_to_async(version_ref)(model_name="demo-chat", version="v1")
    replica = Replica(ref, layer=remote_runtime.layer, publisher=HeartbeatPublisher(redis_url))
    starting = asyncio.create_task(replica.start())
    try:
        async with asyncio.timeout(10):
            while not (beats := await remote_runtime.directory.replicas("demo-chat", "v1", refresh=True)):
                await asyncio.sleep(0.05)
        assert [b.state for b in beats] == ["loading"]
        handle = _dispatch(remote_runtime, cold_start=False, counts_failures=True)
        with pytest.raises(GatewayError, match="no ready replica") as refused:
            await handle.submit()
        assert refused.value.status == 503
        await handle.close()
        assert handle._failure.error_type is None  # not the version's failure: its replica is on its way
        loaded.set()
        await starting
        async with asyncio.timeout(10):  # its next beat says so
            while [
                b.state for b in await remote_runtime.directory.replicas("demo-chat", "v1", refresh=True)
            ] != ["ready"]:
                await asyncio.sleep(0.05)
    finally:
        loaded.set()
        await starting
        await replica.stop()


async def test_a_loading_beat_that_stopped_is_not_a_replica_on_its_way(
    registered_model: Any, remote_runtime: Any, redis_url: str
) -> None:
    """A replica killed while it loaded (OOM, SIGKILL) never withdraws its "loading" beat, which stays a
    minute: the version's 503s meanwhile are its failures."""
    import json
    import time

    import redis.asyncio as aioredis

    from serving.gateway.errors import GatewayError
    from serving.transport.replica_directory import version_key

    beat = {
        "replica_id": "killed-while-loading",
        "model_name": "demo-chat",
        "version": "v1",
        "channel_name": "switchyard.replica.gone",
        "state": "loading",
        "num_waiting": 0,
        "num_running": 0,
        "kv_cache_usage": 0.0,
        "sent_at": time.time() - 10,  # Redis's clock is this host's here
    }
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.hset(version_key("demo-chat", "v1"), "killed-while-loading", json.dumps(beat))
        handle = _dispatch(remote_runtime, cold_start=False, counts_failures=True)
        with pytest.raises(GatewayError, match="no ready replica"):
            await handle.submit()
        await handle.close()
        assert handle._failure.error_type == "no_ready_replica"
    finally:
        await client.aclose()
