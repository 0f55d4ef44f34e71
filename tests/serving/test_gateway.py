"""Quota admission: token buckets and the concurrency cap, in memory and in real Redis."""

import pytest

from registry.selectors import TenantContext
from serving.gateway import GatewayError, MemoryQuotaStore


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
    assert excinfo.value.headers == {"Retry-After": "1"}
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

    from serving.quota_redis import RedisQuotaStore

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
    from serving.quota_redis import RedisQuotaStore

    store = RedisQuotaStore(redis_url, key_prefix="test:quota2:")
    store.clear()
    context = _context(8, requests_per_second=1000, tokens_per_minute=600, max_concurrent_requests=1)
    ticket = store.admit(context, tokens=500)
    with pytest.raises(GatewayError, match="concurrent"):
        store.admit(context, tokens=1)
    store.release(ticket, used_tokens=50)
    store.admit(context, tokens=500)  # 450 came back at settlement
    store.clear()
