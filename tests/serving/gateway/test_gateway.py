"""Quota admission: token buckets and the concurrency cap, in memory and in real Redis."""

import pytest

from registry.selectors import TenantContext
from serving.gateway.errors import GatewayError
from serving.gateway.quota_memory import MemoryQuotaStore
from tests.serving.conftest import one_trip_layer, record_commands


def _context(tenant_id: int = 1, **overrides: object) -> TenantContext:
    fields: dict[str, object] = {
        "tenant_id": tenant_id,
        "tenant_name": f"t{tenant_id}",
        "cache_group": f"tenant:{tenant_id}",
        "requests_per_second": 2.0,
        "tokens_per_minute": 600,
        "max_concurrent_requests": 3,
        "allowed_model_names": frozenset(),
        "may_pin": False,
        "may_deploy": False,
    }
    fields.update(overrides)
    return TenantContext(**fields)  # type: ignore[arg-type]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_request_bucket_allows_its_burst_then_refuses_with_a_retry_after_and_refills() -> None:
    clock = FakeClock()
    store = MemoryQuotaStore(clock)
    context = _context(max_concurrent_requests=100)
    tickets = [store.admit(context, tokens=1) for _ in range(2)]
    with pytest.raises(GatewayError) as excinfo:
        store.admit(context, tokens=1)
    assert excinfo.value.status == 429
    assert excinfo.value.headers["Retry-After"] == "1"
    clock.now += 0.5  # 2/s refills one request in half a second
    store.admit(context, tokens=1)
    assert len(tickets) == 2


def test_token_bucket_charges_the_estimate_and_settles_the_difference() -> None:
    clock = FakeClock()
    store = MemoryQuotaStore(clock)
    context = _context(requests_per_second=100, tokens_per_minute=600)
    ticket = store.admit(context, tokens=500)
    with pytest.raises(GatewayError, match="token rate") as excinfo:
        store.admit(context, tokens=200)
    assert excinfo.value.retry_after_s == pytest.approx(10.0)  # 100 missing tokens at 10 tokens/s
    store.release(ticket, used_tokens=100)  # it used far less than charged: 400 come back
    store.admit(context, tokens=200)


def test_concurrency_cap_counts_in_flight_requests_only() -> None:
    store = MemoryQuotaStore(FakeClock())
    context = _context(requests_per_second=100, max_concurrent_requests=2)
    first = store.admit(context, tokens=1)
    store.admit(context, tokens=1)
    with pytest.raises(GatewayError, match="concurrent"):
        store.admit(context, tokens=1)
    store.release(first, used_tokens=1)
    store.admit(context, tokens=1)


def test_tenants_have_separate_buckets() -> None:
    store = MemoryQuotaStore(FakeClock())
    greedy, other = _context(1, requests_per_second=1), _context(2, requests_per_second=1)
    store.admit(greedy, tokens=1)
    with pytest.raises(GatewayError):
        store.admit(greedy, tokens=1)
    store.admit(other, tokens=1)


@pytest.mark.redis
def test_redis_store_is_shared_and_atomic_across_gateway_processes(redis_url: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from serving.gateway.quota_redis import RedisQuotaStore

    a, b = (
        RedisQuotaStore(redis_url, key_prefix="test:quota:"),
        RedisQuotaStore(redis_url, key_prefix="test:quota:"),
    )
    a.clear()
    context = _context(7, requests_per_second=0.001, tokens_per_minute=10**6, max_concurrent_requests=10**6)
    # Burst of max(1, rps) = 1: exactly one of 40 concurrent admissions over two stores may pass.
    stores = [a, b] * 20

    def attempt(store: RedisQuotaStore) -> bool:
        try:
            store.admit(context, tokens=1)
            return True
        except GatewayError as exc:
            assert exc.status == 429 and int(exc.headers["Retry-After"]) > 1
            return False

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(attempt, stores))
    assert results.count(True) == 1
    a.clear()


@pytest.mark.redis
def test_redis_store_concurrency_and_settlement(redis_url: str) -> None:
    from serving.gateway.quota_redis import RedisQuotaStore

    store = RedisQuotaStore(redis_url, key_prefix="test:quota2:")
    store.clear()
    context = _context(8, requests_per_second=1000, tokens_per_minute=600, max_concurrent_requests=1)
    ticket = store.admit(context, tokens=500)
    with pytest.raises(GatewayError, match="concurrent"):
        store.admit(context, tokens=1)
    store.release(ticket, used_tokens=50)
    store.admit(context, tokens=500)  # 450 came back at settlement
    store.clear()


@pytest.mark.redis
def test_redis_store_admits_from_the_event_loop_with_the_same_counters(redis_url: str) -> None:
    """The gateway admits with aadmit/arelease (asyncio client, no thread hop); they decide on the same
    hash as the sync methods, atomically across stores."""
    import asyncio

    from serving.gateway.quota_redis import RedisQuotaStore

    a, b = (RedisQuotaStore(redis_url, key_prefix="test:quota4:") for _ in range(2))
    a.clear()
    burst_of_one = _context(
        11, requests_per_second=0.001, tokens_per_minute=10**6, max_concurrent_requests=10**6
    )
    one_at_a_time = _context(12, requests_per_second=1000, tokens_per_minute=600, max_concurrent_requests=1)

    async def attempt(store: RedisQuotaStore) -> bool:
        try:
            await store.aadmit(burst_of_one, tokens=1)
            return True
        except GatewayError as exc:
            assert exc.status == 429 and "request rate" in exc.message
            return False

    async def scenario() -> list[bool]:
        results = await asyncio.gather(*(attempt(store) for store in [a, b] * 20))
        ticket = await a.aadmit(one_at_a_time, tokens=500)
        with pytest.raises(GatewayError, match="concurrent"):
            b.admit(one_at_a_time, tokens=1)  # the sync path sees the async admission
        await b.arelease(ticket, used_tokens=50)
        await a.aadmit(one_at_a_time, tokens=500)  # 450 came back at settlement
        return results

    assert asyncio.run(scenario()).count(True) == 1
    assert a.refusals()[11] == 39
    a.clear()


def test_redis_store_unreachable_from_the_event_loop_is_a_503() -> None:
    import asyncio

    from serving.gateway.quota_redis import RedisQuotaStore

    store = RedisQuotaStore("redis://127.0.0.1:1/15")  # nothing listens on port 1
    with pytest.raises(GatewayError) as raised:
        asyncio.run(store.aadmit(_context(), tokens=1))
    assert raised.value.status == 503 and "quota store unavailable" in raised.value.message


# --- usage against quota (the dashboard's tenants page) -------------------------------------------------


def test_usage_of_a_tenant_never_admitted_is_full_buckets_and_nothing_in_flight() -> None:
    store = MemoryQuotaStore(FakeClock())
    context = _context(5, requests_per_second=0.5, tokens_per_minute=600, max_concurrent_requests=3)
    (usage,) = store.usage([context]).values()
    assert (usage.num_in_flight, usage.max_concurrent_requests) == (0, 3)
    assert (usage.request_bucket_level, usage.request_bucket_size) == (1.0, 1.0)  # burst: max(1, rps)
    assert (usage.token_bucket_level, usage.token_bucket_size) == (600.0, 600)
    assert usage.requests_drawn == 0.0 and usage.tokens_drawn == 0.0


def test_usage_follows_admission_refill_and_settlement() -> None:
    clock = FakeClock()
    store = MemoryQuotaStore(clock)
    context = _context(requests_per_second=2, tokens_per_minute=600, max_concurrent_requests=3)
    ticket = store.admit(context, tokens=500)
    store.admit(context, tokens=50)
    usage = store.usage([context])[context.tenant_id]
    assert usage.num_in_flight == 2
    assert usage.requests_drawn == pytest.approx(2.0) and usage.tokens_drawn == pytest.approx(550.0)

    clock.now += 3.0  # 10 tokens/s and 2 requests/s refill
    usage = store.usage([context])[context.tenant_id]
    assert usage.token_bucket_level == pytest.approx(80.0)
    assert usage.request_bucket_level == pytest.approx(2.0)  # capped at the burst
    store.release(ticket, used_tokens=100)  # 400 of the 500 charged come back
    usage = store.usage([context])[context.tenant_id]
    assert usage.num_in_flight == 1 and usage.token_bucket_level == pytest.approx(480.0)
    # Admission sees what usage showed: 480 tokens left, so 481 are refused and 480 admitted.
    with pytest.raises(GatewayError, match="token rate"):
        store.admit(context, tokens=481)
    store.admit(context, tokens=480)
    assert store.usage([context])[context.tenant_id].tokens_drawn == pytest.approx(600.0)


@pytest.mark.redis
def test_redis_usage_is_what_every_gateway_admitted(redis_url: str) -> None:
    import redis

    from serving.gateway.quota_redis import RedisQuotaStore

    a, b, reader = (RedisQuotaStore(redis_url, key_prefix="test:quota3:") for _ in range(3))
    a.clear()
    # Refill too slow to move a figure past the tolerance while the test runs (burst 1, 1 token/s).
    first = _context(9, requests_per_second=0.001, tokens_per_minute=60, max_concurrent_requests=4)
    second = _context(11, requests_per_second=0.001, tokens_per_minute=60, max_concurrent_requests=4)
    idle = _context(10, requests_per_second=3, tokens_per_minute=900, max_concurrent_requests=2)
    ticket = a.admit(first, tokens=40)
    b.admit(second, tokens=5)

    usage = reader.usage([first, second, idle])  # a gateway that admitted nothing sees both
    assert (usage[9].num_in_flight, usage[9].max_concurrent_requests) == (1, 4)
    assert usage[9].token_bucket_size == 60 and usage[9].tokens_drawn == pytest.approx(40.0, abs=0.5)
    assert usage[9].request_bucket_size == 1.0 and usage[9].request_bucket_level == pytest.approx(
        0.0, abs=0.01
    )
    assert usage[11].num_in_flight == 1 and usage[11].tokens_drawn == pytest.approx(5.0, abs=0.5)
    assert (usage[10].num_in_flight, usage[10].token_bucket_level, usage[10].request_bucket_level) == (
        0,
        900.0,
        3.0,
    )

    raw = redis.Redis.from_url(redis_url)
    stamp = raw.hget("test:quota3:9", "ts")
    reader.usage([first, idle])
    assert raw.hget("test:quota3:9", "ts") == stamp  # reading writes nothing
    assert not raw.exists("test:quota3:10")

    a.release(ticket, used_tokens=10)  # 30 of the 40 charged come back
    after = reader.usage([first])[9]
    assert after.num_in_flight == 0 and after.tokens_drawn == pytest.approx(10.0, abs=0.5)
    a.clear()


def test_redis_usage_is_empty_when_redis_cannot_be_read() -> None:
    from serving.gateway.quota_redis import RedisQuotaStore

    store = RedisQuotaStore("redis://127.0.0.1:1/15")  # nothing listens on port 1
    assert store.usage([_context()]) == {}


# --- admission and submission together ------------------------------------------------------------------


@pytest.mark.redis
async def test_admission_and_submission_are_one_round_trip_on_one_redis(redis_url: str) -> None:
    """Both were a round trip each on every request's time to first token; on one Redis the admission
    script sends the request too: one command, the message on the replica's channel, the tenant charged."""
    from serving.gateway.quota_redis import RedisQuotaStore

    store = RedisQuotaStore(redis_url, key_prefix="test:quota5:")
    store.clear()
    layer = one_trip_layer(redis_url)
    context = _context(21, max_concurrent_requests=5)
    try:
        # The first use of the script on a fresh Redis loads it (SCRIPT LOAD and a retry); count after.
        warm_up = await store.aadmit_and_send(
            context, tokens=0, layer=layer, channel="switchyard.replica.w", message={}
        )
        await store.arelease(warm_up, used_tokens=0)
        store_commands = record_commands(store._loop_client().redis)
        layer_commands = record_commands(layer.connection(0))
        ticket = await store.aadmit_and_send(
            context, tokens=40, layer=layer, channel="switchyard.replica.x", message={"type": "submit"}
        )
        assert ([c[0] for c in store_commands], layer_commands) == (["EVALSHA"], [])
        assert await layer.receive("switchyard.replica.x") == {"type": "submit"}
        usage = store.usage([context])[21]
        assert usage.num_in_flight == 1 and usage.tokens_drawn == pytest.approx(40, abs=1)  # it refills
        await store.arelease(ticket, used_tokens=40)
    finally:
        await layer.flush()
        store.clear()


@pytest.mark.redis
async def test_a_refused_request_is_never_sent_and_a_full_channel_admits_nothing(redis_url: str) -> None:
    import redis
    from channels.exceptions import ChannelFull

    from serving.gateway.quota_redis import RedisQuotaStore

    store = RedisQuotaStore(redis_url, key_prefix="test:quota6:")
    store.clear()
    layer = one_trip_layer(redis_url, capacity=1)
    over = _context(22, max_concurrent_requests=0)
    context = _context(23)
    channel = "switchyard.replica.y"
    try:
        with pytest.raises(GatewayError, match="concurrent") as refused:
            await store.aadmit_and_send(over, tokens=1, layer=layer, channel=channel, message={})
        assert refused.value.status == 429 and store.refusals()[22] == 1
        assert redis.Redis.from_url(redis_url).exists(layer.prefix + channel) == 0

        await layer.send(channel, {"type": "submit", "n": 0})  # the channel is now full
        with pytest.raises(ChannelFull):
            await store.aadmit_and_send(context, tokens=1, layer=layer, channel=channel, message={"n": 1})
        usage = store.usage([context])[23]
        assert (usage.num_in_flight, usage.requests_drawn) == (0, 0)
    finally:
        await layer.flush()
        store.clear()


@pytest.mark.redis
async def test_over_quota_with_its_replicas_queue_full_is_a_429_not_a_full_channel(redis_url: str) -> None:
    """The quota decides first: a tenant over quota is refused (429, counted, and its next attempts admit
    alone) whatever its replica's queue holds; only a request the quota admits can find the queue full."""
    from channels.exceptions import ChannelFull

    from serving.gateway.quota_redis import RedisQuotaStore

    store = RedisQuotaStore(redis_url, key_prefix="test:quota8:")
    store.clear()
    layer = one_trip_layer(redis_url, capacity=1)
    over = _context(27, requests_per_second=1000, max_concurrent_requests=1)
    other = _context(28, requests_per_second=1000, max_concurrent_requests=1)
    channel = "switchyard.replica.full"
    try:
        holder = await store.aadmit(over, tokens=1)  # its one slot taken
        await layer.send(channel, {"type": "submit", "n": 0})  # the channel is now full
        assert store.sends_with_admission(over)
        with pytest.raises(GatewayError, match="concurrent") as refused:
            await store.aadmit_and_send(over, tokens=1, layer=layer, channel=channel, message={"n": 1})
        assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "1"
        assert store.refusals()[27] == 1 and not store.sends_with_admission(over)
        assert store.usage([over])[27].num_in_flight == 1  # the holder's

        with pytest.raises(ChannelFull):  # admitted by its quota, but the queue is full: nothing charged
            await store.aadmit_and_send(other, tokens=1, layer=layer, channel=channel, message={"n": 2})
        usage = store.usage([other])[28]
        assert (usage.num_in_flight, usage.requests_drawn, usage.tokens_drawn) == (0, 0, 0)
        assert not store.refusals().get(28)
        assert await layer.receive(channel) == {"type": "submit", "n": 0}  # nothing else was sent
        await store.arelease(holder, used_tokens=1)
    finally:
        await layer.flush()
        store.clear()


async def test_without_a_shared_redis_a_send_that_fails_gives_the_admission_back() -> None:
    """The in-memory store (and a Redis store whose layer is on another server) admits, then sends."""
    from channels.exceptions import ChannelFull
    from channels.layers import InMemoryChannelLayer

    store = MemoryQuotaStore(FakeClock())
    layer = InMemoryChannelLayer(capacity=1)
    context = _context(24, max_concurrent_requests=1)
    await layer.send("replica.z", {"type": "queued"})  # the channel is full
    with pytest.raises(ChannelFull):
        await store.aadmit_and_send(
            context, tokens=10, layer=layer, channel="replica.z", message={"type": "a"}
        )
    usage = store.usage([context])[24]
    assert (usage.num_in_flight, usage.tokens_drawn) == (0, 0)  # the one concurrent slot is free again
    assert await layer.receive("replica.z") == {"type": "queued"}
    await store.aadmit_and_send(context, tokens=10, layer=layer, channel="replica.z", message={"type": "a"})
    assert await layer.receive("replica.z") == {"type": "a"}


@pytest.mark.redis
async def test_a_tenant_just_refused_is_admitted_alone_so_refusals_carry_no_prompt(redis_url: str) -> None:
    """Under a flood of 429s the combined script would ship every refused prompt to Redis: after a
    refusal the tenant's next attempts admit alone (the two-key script), until one is admitted."""
    from serving.gateway.quota_redis import RedisQuotaStore

    store = RedisQuotaStore(redis_url, key_prefix="test:quota7:")
    store.clear()
    layer = one_trip_layer(redis_url)
    one_at_a_time = _context(25, requests_per_second=1000, max_concurrent_requests=1)
    big = {"type": "submit", "input": "x" * 100_000}
    warm_up = _context(26)  # a fresh Redis loads each script on its first use: a retry to count
    await store.arelease(await store.aadmit(warm_up, tokens=1), used_tokens=1)
    ticket = await store.aadmit_and_send(warm_up, tokens=1, layer=layer, channel="replica.u", message={})
    await store.arelease(ticket, used_tokens=1)
    commands = record_commands(store._loop_client().redis)

    async def attempt() -> object:
        return await store.aadmit_and_send(
            one_at_a_time, tokens=1, layer=layer, channel="switchyard.replica.v", message=big
        )

    try:
        first = await attempt()
        for _ in range(3):
            with pytest.raises(GatewayError, match="concurrent"):
                await attempt()
        await store.arelease(first, used_tokens=1)  # type: ignore[arg-type]
        await store.arelease(await attempt(), used_tokens=1)  # type: ignore[arg-type]  # admitted alone
        await attempt()  # and the next goes in one round trip again
        # The number of keys of each script the store ran (3 carries the message), the releases (1) left out.
        scripts = [int(c[2]) for c in commands if c[0] in ("EVALSHA", "EVAL") and int(c[2]) != 1]
        assert scripts == [3, 3, 2, 2, 2, 3]
    finally:
        await layer.flush()
        store.clear()


@pytest.mark.django_db
@pytest.mark.parametrize("key", ["\x00", "sy-\x00abc", "sy-abcdefgh\x00"])
def test_a_key_with_a_nul_is_a_bad_key_not_a_database_outage(make_tenant, key: str) -> None:
    """Postgres refuses a NUL in a query: read as an outage, a WebSocket client sending one in its auth
    message was told to come back later (1013) instead of that its key is wrong (4401)."""
    from serving.gateway import auth as gateway

    make_tenant("acme")
    with pytest.raises(GatewayError) as refused:
        gateway.authenticate(f"Bearer {key}")
    assert refused.value.status == 401


@pytest.mark.django_db
def test_while_the_database_is_down_keys_seen_in_the_last_hour_still_pass(
    make_tenant, monkeypatch, settings
) -> None:
    """The data plane keeps serving the tenants it knows through a control-plane outage; a key it has not
    seen lately cannot be checked and gets a 503 to retry (the Postgres pass runs the real outage in
    tests/serving/edge/test_inference_stack.py)."""
    from django.db import OperationalError

    from serving.gateway import auth as gateway

    seen, unseen = make_tenant("seen"), make_tenant("unseen")
    assert gateway.authenticate(seen.auth["Authorization"]).tenant_name == "seen"
    monkeypatch.setattr(gateway, "_AUTH_CACHE_TTL_S", 0.0)  # past its few seconds: the database is asked

    def database_down(raw_key: str) -> None:
        raise OperationalError("connection refused")

    monkeypatch.setattr(gateway, "tenant_context_for_api_key", database_down)
    assert gateway.authenticate(seen.auth["Authorization"]).tenant_name == "seen"
    with pytest.raises(GatewayError) as unknown:
        gateway.authenticate(unseen.auth["Authorization"])
    assert unknown.value.status == 503 and unknown.value.retry_after_s == 1
    settings.AUTH_STALE_S = 0.0  # an hour later, or the fallback turned off
    with pytest.raises(GatewayError) as too_old:
        gateway.authenticate(seen.auth["Authorization"])
    assert too_old.value.status == 503


@pytest.mark.django_db
def test_a_key_refused_once_is_not_brought_back_by_an_outage(make_tenant, monkeypatch) -> None:
    from django.db import OperationalError

    from registry.services import api_key_revoke
    from serving.gateway import auth as gateway

    revoked = make_tenant("revoked")
    assert gateway.authenticate(revoked.auth["Authorization"]).tenant_name == "revoked"
    monkeypatch.setattr(gateway, "_AUTH_CACHE_TTL_S", 0.0)
    api_key_revoke(key=revoked.key)
    with pytest.raises(GatewayError) as refused:
        gateway.authenticate(revoked.auth["Authorization"])
    assert refused.value.status == 401

    def database_down(raw_key: str) -> None:
        raise OperationalError("connection refused")

    monkeypatch.setattr(gateway, "tenant_context_for_api_key", database_down)
    with pytest.raises(GatewayError) as during:
        gateway.authenticate(revoked.auth["Authorization"])
    assert during.value.status == 503
