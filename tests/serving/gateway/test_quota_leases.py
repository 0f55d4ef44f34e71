"""Quota admission's in-flight leases (one never released stops counting, one in flight is renewed),
admission cancelled after Redis ran it, Retry-After over every binding limit, and the 400 for a request
no wait would admit."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

from registry.errors import error_body
from serving.gateway.errors import GatewayError
from serving.gateway.quota_memory import MemoryQuotaStore
from tests.serving.conftest import one_trip_layer
from tests.serving.gateway.test_gateway import _context


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def store(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Each store, for the behaviour both must share."""
    if request.param == "memory":
        yield MemoryQuotaStore()
        return
    from serving.gateway.quota_redis import RedisQuotaStore

    redis_store = RedisQuotaStore(request.getfixturevalue("redis_url"), key_prefix="test:quota-leases:")
    redis_store.clear()
    yield redis_store
    redis_store.clear()


def _redis_store(redis_url: str, **options: Any) -> Any:
    from serving.gateway.quota_redis import RedisQuotaStore

    store = RedisQuotaStore(redis_url, key_prefix="test:quota-leases:", **options)
    store.clear()
    return store


# --- leases ----------------------------------------------------------------------------------------------


@pytest.mark.redis
def test_a_request_never_released_stops_counting_at_its_lease_deadline_while_the_tenant_keeps_sending(
    redis_url: str,
) -> None:
    """A gateway killed mid-request leaks its admission. The count used to clear only with the idle
    expiry of the tenant's key, which every admission, refusals included, pushed back: a tenant that kept
    sending was refused for ever."""
    store = _redis_store(redis_url, lease_s=1.0)
    context = _context(31, requests_per_second=1000, tokens_per_minute=10**6, max_concurrent_requests=1)
    try:
        leaked = store.admit(context, tokens=1)  # never released
        leaked_at = time.monotonic()
        refusals = 0
        deadline = time.monotonic() + 10.0
        while True:
            try:
                ticket = store.admit(context, tokens=1)
                break
            except GatewayError as exc:
                assert exc.status == 429 and "concurrent" in exc.message
                refusals += 1
            assert time.monotonic() < deadline, "the leaked lease never stopped counting"
            time.sleep(0.05)
        # It kept sending, and was refused until the lease ran out, not before.
        assert refusals >= 3 and time.monotonic() - leaked_at >= 0.9
        assert store.usage([context])[31].num_in_flight == 1

        store.release(leaked, used_tokens=1)  # late: its lease is gone, and it frees no one else's slot
        assert store.usage([context])[31].num_in_flight == 1
        with pytest.raises(GatewayError, match="concurrent"):
            store.admit(context, tokens=1)
        store.release(ticket, used_tokens=1)
        assert store.usage([context])[31].num_in_flight == 0
        store.admit(context, tokens=1)
    finally:
        store.clear()


@pytest.mark.redis
def test_a_count_left_by_the_layout_before_leases_is_dropped(redis_url: str) -> None:
    """Hashes written before leases kept a bare count, leaks included: the first admission drops it."""
    store = _redis_store(redis_url)
    context = _context(39, requests_per_second=1000, tokens_per_minute=600, max_concurrent_requests=2)
    try:
        store._redis.hset(store._key(39), mapping={"rt": "1000", "tt": "600", "ts": "0", "n": "2"})
        ticket = store.admit(context, tokens=1)
        assert store._redis.hget(store._key(39), "n") is None
        assert store.usage([context])[39].num_in_flight == 1
        store.release(ticket, used_tokens=1)
        assert store.usage([context])[39].num_in_flight == 0
    finally:
        store.clear()


@pytest.mark.redis
async def test_a_request_in_flight_keeps_its_slot_while_its_gateway_renews_the_lease(redis_url: str) -> None:
    """Leases are short, so that a dead gateway's requests stop counting soon; the gateway renews those it
    still runs. One held for 2.5 leases keeps its slot; once released, or once its lease is gone, no
    renewal brings it back."""
    store = _redis_store(redis_url, lease_s=1.0)
    context = _context(32, requests_per_second=1000, tokens_per_minute=10**6, max_concurrent_requests=1)
    key = store._key(32)
    try:
        ticket = await store.aadmit(context, tokens=1)
        held_until = time.monotonic() + 2.5
        while time.monotonic() < held_until:
            await store.arenew()
            assert store._redis.ttl(key) >= 1  # the hash, which holds the lease, outlives it
            with pytest.raises(GatewayError, match="concurrent"):
                await store.aadmit(context, tokens=1)
            await asyncio.sleep(0.25)  # the renewal's cadence, a quarter of the lease
        await store.arelease(ticket, used_tokens=1)
        await store.arenew()
        assert store.usage([context])[32].num_in_flight == 0

        dropped = await store.aadmit(context, tokens=1)
        store._redis.hdel(key, f"l:{dropped.ticket_id}")  # as an admission drops a lease past its deadline
        await store.arenew()
        assert store.usage([context])[32].num_in_flight == 0
        await store.arelease(dropped, used_tokens=1)
    finally:
        store.clear()


@pytest.mark.redis
async def test_a_ticket_held_past_the_longest_request_is_no_longer_renewed(
    redis_url: str, monkeypatch: Any
) -> None:
    """A release a bug lost would otherwise keep its lease, and its tenant's slot, for as long as the
    gateway runs."""
    from serving.gateway import quota_redis

    store = _redis_store(redis_url, lease_s=0.5)
    context = _context(40, requests_per_second=1000, tokens_per_minute=10**6, max_concurrent_requests=1)
    try:
        await store.aadmit(context, tokens=1)  # never released
        monkeypatch.setattr(quota_redis, "longest_request_s", lambda: 0.0)
        await store.arenew()
        assert store._held == {}
        deadline = time.monotonic() + 10.0
        while store.usage([context])[40].num_in_flight:  # until its lease runs out, not renewed
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await store.arelease(await store.aadmit(context, tokens=1), used_tokens=1)
    finally:
        store.clear()


@pytest.mark.redis
@pytest.mark.django_db(transaction=True)
async def test_a_dispatch_lets_go_of_its_ticket_however_it_ends(
    redis_url: str, make_tenant: Any, runtime: Any, monkeypatch: Any
) -> None:
    """Served, refused at once or cancelled mid-stream: no ticket stays held, so no lease is renewed for
    a request that has ended."""
    from asgiref.sync import sync_to_async

    from serving.gateway.quota_redis import RedisQuotaStore
    from serving.gateway.quota_store import reset_quota_store
    from tests.serving.gateway.test_dispatch import _hello

    store = RedisQuotaStore(redis_url, key_prefix="test:quota-leases:")
    store.clear()
    reset_quota_store(store)  # the autouse fixture resets it after the test
    acme = await sync_to_async(make_tenant)("acme", max_concurrent_requests=1)
    try:
        served = await _hello(acme, max_tokens=2)
        assert [e async for e in served.events()][-1]["finish_reason"] == "length"
        await served.close()
        assert store._held == {}

        left = await _hello(acme, max_tokens=64)
        assert len(store._held) == 1
        with pytest.raises(GatewayError, match="concurrent"):
            await _hello(acme, max_tokens=2)
        await left.events().__anext__()  # its first event: it runs
        aborting = asyncio.Event()

        async def stuck_send(channel: str, message: dict[str, Any]) -> None:  # the abort never goes out
            aborting.set()
            await asyncio.Event().wait()

        monkeypatch.setattr(runtime.layer, "send", stuck_send)
        closing = asyncio.ensure_future(left.close())
        await aborting.wait()
        closing.cancel()  # the client's second cancellation lands during the abort
        with contextlib.suppress(asyncio.CancelledError):
            await closing
        assert store._held == {}
        assert store.usage([acme.context])[acme.tenant.pk].num_in_flight == 0
    finally:
        store.clear()


@pytest.mark.django_db(transaction=True)
async def test_the_runtime_renews_the_leases_of_its_requests(monkeypatch: Any) -> None:
    from serving import runtime as runtime_module
    from serving.gateway.quota_store import reset_quota_store
    from serving.runtime import get_runtime

    renewed = asyncio.Event()

    class Store(MemoryQuotaStore):
        async def arenew(self) -> None:
            renewed.set()

    monkeypatch.setattr(runtime_module, "LEASE_RENEW_EVERY_S", 0.01)
    reset_quota_store(Store())  # the autouse fixture resets it after the test
    await get_runtime()
    await asyncio.wait_for(renewed.wait(), timeout=5)


def test_a_second_release_of_one_ticket_frees_no_other_requests_slot(store: Any) -> None:
    context = _context(33, requests_per_second=1000, tokens_per_minute=10**6, max_concurrent_requests=2)
    first = store.admit(context, tokens=1)
    store.admit(context, tokens=1)
    store.release(first, used_tokens=1)
    store.release(first, used_tokens=1)  # a caller's mistake, or a retried release
    assert store.usage([context])[33].num_in_flight == 1
    store.admit(context, tokens=1)
    with pytest.raises(GatewayError, match="concurrent"):
        store.admit(context, tokens=1)


def test_in_memory_only_a_ticket_held_is_settled() -> None:
    """A second release, or the release of a ticket never admitted, gives back no tokens: only the one
    admission that charged them does. (On Redis a release settles even a lease that expired, and an
    admission whose reply was lost is given back only if it holds its lease: the next test.)"""
    from serving.gateway.quota import Ticket

    store = MemoryQuotaStore()
    context = _context(40, requests_per_second=1000, tokens_per_minute=600, max_concurrent_requests=5)
    held = store.admit(context, tokens=300)
    store.release(Ticket("never-admitted", context.tenant_id, 200), used_tokens=0)
    store.release(held, used_tokens=100)  # 200 of the 300 back
    store.release(held, used_tokens=0)  # nothing more
    assert store.usage([context])[40].tokens_drawn == pytest.approx(100, abs=2)


@pytest.mark.redis
async def test_a_reply_lost_after_the_one_trip_script_ran_holds_nothing_and_says_the_request_may_be_sent(
    redis_url: str,
) -> None:
    """The connection drops after Redis admitted and sent the request: the caller gets a 503 it knows
    may have reached the replica (InFlightRequest then aborts it there), and the admission is given back."""
    import redis

    from serving.gateway.errors import MaybeSent

    store = _redis_store(redis_url)
    layer = one_trip_layer(redis_url)
    channel = "switchyard.replica.lost-reply"
    context = _context(41, requests_per_second=1000, tokens_per_minute=60, max_concurrent_requests=1)
    client = store._loop_client()
    script = client.admit_and_send

    async def ran_then_dropped(**kwargs: Any) -> Any:
        await script(**kwargs)
        raise redis.ConnectionError("Connection reset by peer")

    client.admit_and_send = ran_then_dropped
    try:
        with pytest.raises(MaybeSent) as failed:
            await store.aadmit_and_send(
                context, tokens=50, layer=layer, channel=channel, message={"type": "s"}
            )
        assert failed.value.status == 503 and failed.value.headers["Retry-After"] == "1"
        usage = store.usage([context])[41]
        assert usage.num_in_flight == 0 and usage.tokens_drawn == pytest.approx(0, abs=1)
        assert await layer.receive(channel) == {"type": "s"}  # it was sent: the caller aborts it
    finally:
        await layer.flush()
        store.clear()


@pytest.mark.redis
async def test_a_reply_lost_after_the_admission_script_ran_holds_no_slot_and_no_tokens(
    redis_url: str,
) -> None:
    """The connection drops after Redis admitted the request (aadmit, the two-key script): the caller
    gets a 503 and no ticket, so the store gives the admission back, lease and tokens, rather than hold
    the tenant's one slot until the lease runs out."""
    import redis

    store = _redis_store(redis_url)
    context = _context(44, requests_per_second=1000, tokens_per_minute=60, max_concurrent_requests=1)
    client = store._loop_client()
    script = client.admit

    async def ran_then_dropped(**kwargs: Any) -> Any:
        await script(**kwargs)
        raise redis.ConnectionError("Connection reset by peer")

    client.admit = ran_then_dropped
    try:
        with pytest.raises(GatewayError) as failed:
            await store.aadmit(context, tokens=50)
        assert failed.value.status == 503 and failed.value.headers["Retry-After"] == "1"
        usage = store.usage([context])[44]
        assert usage.num_in_flight == 0 and usage.tokens_drawn == pytest.approx(0, abs=1)
        client.admit = script
        await store.arelease(await store.aadmit(context, tokens=50), used_tokens=50)  # the slot is free
    finally:
        store.clear()


# --- cancelled during admission ----------------------------------------------------------------------------


def _reply_held_back(client: Any, name: str) -> tuple[asyncio.Event, asyncio.Event]:
    """Makes the loop client's script `name` run in Redis, then hold its reply back until the second
    event is set: a caller cancelled meanwhile was admitted without knowing it. The first event: it ran."""
    ran, let_reply = asyncio.Event(), asyncio.Event()
    script = getattr(client, name)

    async def held_back(**kwargs: Any) -> Any:
        result = await script(**kwargs)
        ran.set()
        await let_reply.wait()
        return result

    setattr(client, name, held_back)
    return ran, let_reply


async def _cancelled_after_the_script_ran(client: Any, name: str, admission: Any) -> None:
    """Runs `admission` (a coroutine) with the loop client's script `name` held back as _reply_held_back
    does, cancels it once the script ran and expects its CancelledError."""
    ran, let_reply = _reply_held_back(client, name)
    task = asyncio.ensure_future(admission)
    await asyncio.wait_for(ran.wait(), timeout=5)
    task.cancel()
    await asyncio.sleep(0)  # one turn of the loop: the task takes its cancellation, the reply held back
    let_reply.set()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.redis
@pytest.mark.parametrize("sends", [False, True], ids=["aadmit", "aadmit_and_send"])
async def test_a_caller_cancelled_after_the_script_ran_gives_the_admission_back(
    redis_url: str, sends: bool
) -> None:
    """The client went away (Django cancels the view) after Redis admitted the request but before the reply
    was read: the caller never got its ticket to release. The store gives it back, all its tokens too; a
    refusal cancelled the same way gives nothing back."""
    store = _redis_store(redis_url)
    layer = one_trip_layer(redis_url)
    channel = "switchyard.replica.cancelled"
    name = "admit_and_send" if sends else "admit"
    # 1 token/s refill: a charge of 50 left in place would still show when the test looks.
    context = _context(34, requests_per_second=1000, tokens_per_minute=60, max_concurrent_requests=1)

    def admission() -> Any:
        if sends:
            return store.aadmit_and_send(
                context, tokens=50, layer=layer, channel=channel, message={"type": "submit"}
            )
        return store.aadmit(context, tokens=50)

    try:
        await _cancelled_after_the_script_ran(store._loop_client(), name, admission())
        usage = store.usage([context])[34]
        assert usage.num_in_flight == 0 and usage.tokens_drawn == pytest.approx(0, abs=1)
        if sends:  # it was sent: the caller (InFlightRequest, which set its replica first) aborts it there
            assert await layer.receive(channel) == {"type": "submit"}

        holder = await store.aadmit(context, tokens=1)  # the one slot is free, and taken again
        # (the script is still wrapped, its reply no longer held back: a second wrapping holds it again)
        await _cancelled_after_the_script_ran(store._loop_client(), name, admission())  # refused
        assert store.usage([context])[34].num_in_flight == 1  # the holder's, still counted
        await store.arelease(holder, used_tokens=1)
        assert store.usage([context])[34].num_in_flight == 0
    finally:
        await layer.flush()
        store.clear()


# --- Retry-After over every limit that binds ---------------------------------------------------------------


def test_retry_after_is_the_longest_wait_among_the_limits_that_bind(store: Any) -> None:
    """2 requests/s and 600 tokens/min, 500 then 50 tokens admitted: 500 more wait on both buckets. The
    request rate's 1 s alone was answered, and the retry then was refused for tokens (44 s more)."""
    context = _context(36, requests_per_second=2, tokens_per_minute=600, max_concurrent_requests=10)
    store.admit(context, tokens=500)
    store.admit(context, tokens=50)
    with pytest.raises(GatewayError) as refused:
        store.admit(context, tokens=500)
    assert refused.value.status == 429
    assert refused.value.retry_after_s == pytest.approx(45.0, abs=0.5)  # 450 tokens at 10 a second
    assert refused.value.headers["Retry-After"] == "45"
    assert refused.value.message.startswith("token rate over quota (600/min)")  # the longest wait first
    assert "request rate" in refused.value.message


def test_concurrency_and_tokens_binding_together_wait_for_the_tokens(store: Any) -> None:
    context = _context(37, requests_per_second=1000, tokens_per_minute=600, max_concurrent_requests=1)
    store.admit(context, tokens=300)
    with pytest.raises(GatewayError) as refused:
        store.admit(context, tokens=500)
    assert refused.value.retry_after_s == pytest.approx(20.0, abs=0.5)  # 200 tokens short, 10 a second
    assert "concurrent" in refused.value.message and "token rate" in refused.value.message


def test_a_zero_concurrency_quota_is_refused_as_a_zero_rate_is_with_a_long_retry_after(store: Any) -> None:
    """No slot will ever free up for a tenant allowed none: Retry-After: 1 had its clients retry every
    second for ever. It is refused as a zero request rate is."""
    no_rate = _context(45, requests_per_second=0, tokens_per_minute=600, max_concurrent_requests=5)
    no_slots = _context(46, requests_per_second=1000, tokens_per_minute=600, max_concurrent_requests=0)
    refusals = []
    for context in (no_rate, no_slots):
        with pytest.raises(GatewayError) as refused:
            store.admit(context, tokens=1)
        refusals.append(refused.value)
    assert [(e.status, e.headers["Retry-After"]) for e in refusals] == [(429, "60")] * 2
    assert "concurrent request quota is zero" in refusals[1].message
    assert store.refusals()[46] == 1


@pytest.mark.parametrize("kind", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def test_a_slow_bucket_and_a_token_debt_outlive_the_idle_expiry_in_both_stores(
    kind: str, request: pytest.FixtureRequest, monkeypatch: Any
) -> None:
    """Redis's tenant hash expired a fixed time after each admission (renewals set that time again) and
    took its buckets with it: a bucket slower to refill than that, or a token debt (a request that used
    more than its estimate, settled at release), came back full. The in-memory store never forgets; both
    must refuse alike. The idle expiry is cut to 1 s here, as 600 s is in production."""
    if kind == "memory":
        store: Any = MemoryQuotaStore()
    else:
        from serving.gateway import quota_redis

        monkeypatch.setattr(quota_redis, "_IDLE_EXPIRY_S", 1)
        store = _redis_store(request.getfixturevalue("redis_url"), lease_s=0.5)  # hash expiry: 2 s
    slow = _context(47, requests_per_second=0.2, tokens_per_minute=10**6, max_concurrent_requests=5)
    indebted = _context(48, requests_per_second=1000, tokens_per_minute=6000, max_concurrent_requests=5)
    try:
        admitted_at = time.monotonic()
        held = await store.aadmit(slow, tokens=1)  # its burst of 1 refills in 5 s
        await store.arenew()  # renewing a lease must not shorten the hash's life
        await store.arelease(held, used_tokens=1)
        indebted_at = time.monotonic()  # the bucket refills from its admission (a release leaves that)
        ticket = await store.aadmit(indebted, tokens=1)  # full again in 0.01 s, as admitted
        await store.arelease(ticket, used_tokens=11_000)  # 5,000 tokens in debt: 50 s to refill
        await asyncio.sleep(2.5)  # past the hash expiry, and past admission's own refill time
        # Bounded by the time that has passed, not by a fixed tolerance: a busy machine adds to it.
        with pytest.raises(GatewayError, match="request rate") as refused:
            await store.aadmit(slow, tokens=1)
        assert 5 - (time.monotonic() - admitted_at) - 0.05 <= refused.value.retry_after_s <= 2.55
        with pytest.raises(GatewayError, match="token rate") as refused:
            await store.aadmit(indebted, tokens=1)
        # 5,001 tokens short at 100/s, less what has refilled since the admission (at least 2.5 s of it)
        assert (
            50.01 - (time.monotonic() - indebted_at) - 0.01 <= refused.value.retry_after_s <= 47.56
        )  # 0.01: Lua keeps ts to 0.1 ms
    finally:
        if kind == "redis":
            store.clear()


@pytest.mark.redis
def test_the_tenant_hash_lives_until_its_slowest_bucket_is_full(redis_url: str) -> None:
    """With the production idle expiry: a tenant allowed a request every 1,000 s keeps its hash that
    long, and a release that leaves a token debt extends it to the debt's refill."""
    store = _redis_store(redis_url)
    slow = _context(49, requests_per_second=0.001, tokens_per_minute=10**6, max_concurrent_requests=5)
    indebted = _context(50, requests_per_second=1000, tokens_per_minute=60, max_concurrent_requests=5)
    try:
        store.release(store.admit(slow, tokens=1), used_tokens=1)
        assert 1000 <= store._redis.ttl(store._key(49)) <= 1002
        store.release(store.admit(indebted, tokens=1), used_tokens=1000)  # 940 below zero, 1/s: 1,000 s
        assert 999 <= store._redis.ttl(store._key(50)) <= 1002
    finally:
        store.clear()


async def test_room_for_several_admits_one_only_when_all_would_be_admitted(
    store: Any, request: pytest.FixtureRequest
) -> None:
    """The first choice of an OpenAI n=3 is admitted only with room for three (each limit), charged as
    one; refused, Retry-After is the wait for all three. On Redis, also when admission sends too."""
    is_redis = not isinstance(store, MemoryQuotaStore)
    layer = one_trip_layer(request.getfixturevalue("redis_url")) if is_redis else None
    try:
        for tenant_id, sends in [(38, False), *([(39, True)] if is_redis else [])]:
            context = _context(
                tenant_id, requests_per_second=3, tokens_per_minute=600, max_concurrent_requests=3
            )

            async def admit(room_for: int, context: Any = context, sends: bool = sends) -> Any:
                if sends:
                    return await store.aadmit_and_send(
                        context,
                        tokens=100,
                        room_for=room_for,
                        layer=layer,
                        channel="replica.room",
                        message={},
                    )
                return await store.aadmit(context, tokens=100, room_for=room_for)

            admitted_at = time.monotonic()
            held = await admit(1)  # 1 of 3 slots, 2 of 3 requests/s and 500 of 600 tokens left
            with pytest.raises(GatewayError) as refused:
                await admit(3)
            assert "concurrent" in refused.value.message and "request rate" in refused.value.message
            assert "token rate" not in refused.value.message  # 500 >= 3 x 100
            await store.arelease(held, used_tokens=100)  # the slot back; 500 tokens, ~2 requests left
            with pytest.raises(GatewayError) as refused:
                await admit(3)
            # a third of a second for the third request, less what has refilled since `held`
            since = time.monotonic() - admitted_at
            assert 1 / 3 - since - 0.01 <= refused.value.retry_after_s <= 1 / 3 + 0.01
            await asyncio.sleep(0.4)
            admitted = await admit(3)  # charged as one: two more of 100 still fit
            await store.arelease(await admit(1), used_tokens=0)
            await store.arelease(admitted, used_tokens=0)
    finally:
        if layer is not None:
            await layer.flush()


# --- a request no wait would admit -------------------------------------------------------------------------


async def test_a_request_over_the_whole_token_quota_is_a_400_and_counts_nothing(
    store: Any, request: Any
) -> None:
    """No wait would admit it, and clients retry a 429 (the openai one does): a 400 that says what to change,
    from every way in, before anything is counted."""
    context = _context(38, requests_per_second=1000, tokens_per_minute=600, max_concurrent_requests=1)
    if isinstance(store, MemoryQuotaStore):
        from channels.layers import InMemoryChannelLayer

        layer: Any = InMemoryChannelLayer()
    else:
        layer = one_trip_layer(request.getfixturevalue("redis_url"))
    attempts = [
        lambda: asyncio.to_thread(store.admit, context, tokens=601),
        lambda: store.aadmit(context, tokens=601),
        lambda: store.aadmit_and_send(context, tokens=601, layer=layer, channel="replica.big", message={}),
    ]
    for attempt in attempts:
        with pytest.raises(GatewayError) as refused:
            await attempt()
        error = refused.value
        assert error.status == 400 and error.headers == {}
        assert "601" in error.message and "600" in error.message and "max_tokens" in error.message
        assert error_body(error.status, error.message)["error"]["type"] == "invalid_request_error"
    assert not (store.refusals() or {}).get(38)  # not a refusal over quota
    usage = store.usage([context])[38]
    assert (usage.num_in_flight, usage.requests_drawn, usage.tokens_drawn) == (0, 0, 0)
    await store.arelease(await store.aadmit(context, tokens=600), used_tokens=600)  # the whole quota fits
    if not isinstance(store, MemoryQuotaStore):
        await layer.flush()


@pytest.mark.django_db(transaction=True)
async def test_an_inference_request_over_the_whole_token_quota_is_a_400(
    make_tenant, registered_model
) -> None:
    import json

    from asgiref.sync import sync_to_async
    from django.test import AsyncClient

    small = await sync_to_async(make_tenant)("small", tokens_per_minute=50)
    response = await AsyncClient().post(
        "/v1/models/demo-chat/infer",
        data=json.dumps({"input": "hello", "max_tokens": 100}),
        content_type="application/json",
        headers=small.auth,
    )
    assert response.status_code == 400 and "Retry-After" not in response
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "50 tokens/min" in error["message"] and "max_tokens" in error["message"]


@pytest.mark.redis
def test_the_tenant_hash_holds_only_fields_every_gateway_version_knows(redis_url: str) -> None:
    """Gateways count a tenant's requests in flight as the hash's fields less those they know (rt, tt,
    ts, lx): a field one version added would read, in an older gateway of the same fleet (a rolling
    upgrade), as a request in flight, and a tenant allowed one at a time would get only 429s there."""
    store = _redis_store(redis_url)
    context = _context(51, requests_per_second=1000, tokens_per_minute=60, max_concurrent_requests=1)
    try:
        ticket = store.admit(context, tokens=1)
        fields = {name.decode() for name in store._redis.hkeys(store._key(51))}
        assert fields == {"rt", "tt", "ts", "lx", f"l:{ticket.ticket_id}"}
        store.release(ticket, used_tokens=1000)  # a debt: the release still knows the tenant's rate
        assert {name.decode() for name in store._redis.hkeys(store._key(51))} == {"rt", "tt", "ts", "lx"}
        assert 999 <= store._redis.ttl(store._key(51)) <= 1002  # 940 below zero at 1/s, past the 600 s
    finally:
        store.clear()
