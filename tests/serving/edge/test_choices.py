"""OpenAI's `n`: several choices of one request, each a sequence of its own on the replica."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient

pytestmark = pytest.mark.django_db(transaction=True)


async def _complete(tenant, **body: object):  # type: ignore[no-untyped-def]
    return await AsyncClient().post(
        "/v1/completions",
        data=json.dumps({"model": "demo-chat", "prompt": "hello", "max_tokens": 4, **body}),
        content_type="application/json",
        headers=tenant.auth,
    )


def _in_flight(tenant) -> int:  # type: ignore[no-untyped-def]
    from serving.gateway.quota_store import quota_store

    return quota_store().usage([tenant.context])[tenant.context.tenant_id].num_in_flight


def _requests_served(runtime) -> dict[str, int]:  # type: ignore[no-untyped-def]
    return {
        version: int(replica.metrics.snapshot().totals.counters.get("requests", 0))
        for (_, version), replica in runtime.replicas.items()
    }


async def test_every_choice_goes_to_the_version_the_first_was_routed_to(
    make_tenant, registered_model, demo_model_dir
) -> None:
    """Under a 50/50 split, one request's four choices are served by one version, never mixed."""
    from registry.services import alias_set, model_version_register, routing_table_set
    from serving.runtime import get_runtime

    def split() -> None:
        v2 = model_version_register(name="demo-chat", version="v2", source_dir=demo_model_dir, created_by="t")
        alias_set(model=v2.model, name="canary", version=v2, actor="test")  # the alias gives it a replica
        routing_table_set(model=v2.model, weights={"v1": 50, "v2": 50})

    await sync_to_async(split)()
    runtime = await get_runtime()
    assert await runtime.wait_ready()
    assert ("demo-chat", "v2") in runtime.replicas
    acme = await sync_to_async(make_tenant)("acme", requests_per_second=1000)  # each choice counts one
    seen: set[str] = set()
    # Until both versions have served, so the split's own draw cannot fail the test: eight fixed requests
    # all went to one version once in CI (1 in 128). Forty all alike is 1 in 2**39.
    for _ in range(40):
        if seen == {"v1", "v2"}:
            break
        before = _requests_served(runtime)
        response = await _complete(acme, n=4, temperature=1.0)
        assert response.status_code == 200, response.content
        version = response.headers["X-Served-Version"]
        after = _requests_served(runtime)
        assert {v: after[v] - before[v] for v in after} == {"v1": 0, "v2": 0, version: 4}
        seen.add(version)
    assert seen == {"v1", "v2"}  # the split itself still draws, per request


async def test_more_choices_than_the_tenant_may_ever_run_at_once_is_a_400_before_any_is_dispatched(
    make_tenant, runtime
) -> None:
    pair = await sync_to_async(make_tenant)("pair", max_concurrent_requests=2)
    slow = await sync_to_async(make_tenant)("slow", requests_per_second=2.5)
    (replica,) = runtime.replicas.values()
    submitted_before = replica.metrics.snapshot().totals.counters.get("requests", 0)
    for tenant, n, at_once in ((pair, 3, 2), (slow, 3, 2)):
        refused = await _complete(tenant, n=n, temperature=0)
        assert refused.status_code == 400, refused.content
        assert f"admits at once ({at_once}" in refused.json()["error"]["message"]
    assert replica.metrics.snapshot().totals.counters.get("requests", 0) == submitted_before
    assert (await _complete(slow, n=2, temperature=0)).status_code == 200


async def test_a_choice_refused_by_the_quota_is_a_429_that_leaves_the_others_nothing_running(
    make_tenant, runtime
) -> None:
    """Another request of the tenant's holds one of its three slots: the third choice finds none."""
    from serving.gateway.quota_store import quota_store

    trio = await sync_to_async(make_tenant)("trio", max_concurrent_requests=3)
    other_request = quota_store().admit(trio.context, tokens=1)
    (replica,) = runtime.replicas.values()
    submitted_before = replica.metrics.snapshot().totals.counters.get("requests", 0)
    refused = await _complete(trio, n=3, temperature=0)
    assert refused.status_code == 429, refused.content
    assert refused.json()["error"]["type"] == "rate_limit_error"
    await replica.wait_idle()
    # Refused before any choice reached the replica: no generation is thrown away with the 429.
    assert replica.metrics.snapshot().totals.counters.get("requests", 0) == submitted_before
    stats = replica.engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert _in_flight(trio) == 1  # the refused request's two slots were given back, the other's kept
    quota_store().release(other_request, used_tokens=1)


async def test_choices_over_the_token_bucket_wait_as_long_as_all_of_them_need(make_tenant, runtime) -> None:
    """Three choices of 150 tokens with 160 left at 10 a second: the 429's Retry-After is the wait for
    450 (29 s), not for the one choice that found the bucket short once the first was charged (14 s),
    after which the retry would be refused again; and no choice reached the replica."""
    import math

    from serving.gateway.quota_store import quota_store

    tenant = await sync_to_async(make_tenant)("bucket", tokens_per_minute=600, requests_per_second=100)
    drained = quota_store().admit(tenant.context, tokens=440)
    quota_store().release(drained, used_tokens=440)  # 160 of 600 left
    (replica,) = runtime.replicas.values()
    submitted_before = replica.metrics.snapshot().totals.counters.get("requests", 0)
    refused = await _complete(tenant, n=3, max_tokens=149, temperature=0)  # "hello": 1 token more
    assert refused.status_code == 429, refused.content
    assert int(refused.headers["Retry-After"]) >= math.ceil((3 * 150 - 160) / 10) - 1
    assert replica.metrics.snapshot().totals.counters.get("requests", 0) == submitted_before


async def test_choices_that_could_never_fit_the_token_quota_together_are_a_400(make_tenant, runtime) -> None:
    """Each choice is charged ~5 tokens ("hello", 4 tokens at most): three are over 12 a minute. Without
    max_tokens, each choice is charged its share of the minute, so they fit."""
    small = await sync_to_async(make_tenant)("small", tokens_per_minute=12)
    refused = await _complete(small, n=3, temperature=0)
    assert refused.status_code == 400, refused.content
    assert "can never be admitted together" in refused.json()["error"]["message"]
    assert (await _complete(small, n=2, temperature=0)).status_code == 200
    roomy = await sync_to_async(make_tenant)("roomy", tokens_per_minute=8000)
    chat = await AsyncClient().post(
        "/v1/chat/completions",
        data=json.dumps({"model": "demo-chat", "messages": [{"role": "user", "content": "hi"}], "n": 2}),
        content_type="application/json",
        headers=roomy.auth,
    )
    assert chat.status_code == 200, chat.content  # each charged under 4,000, not 4,096 + the prompt


async def test_a_client_that_leaves_while_its_choices_are_dispatched_leaves_nothing_behind(
    make_tenant, runtime, monkeypatch
) -> None:
    """The third choice waits (as for a replica to start) when the client goes away: the two already on
    the replica are aborted and their quota slots given back."""
    import asyncio

    from serving.gateway import dispatch as gateway_dispatch

    pair = await sync_to_async(make_tenant)("pair", max_concurrent_requests=3)
    dispatch, calls, third_waits = gateway_dispatch.dispatch, [], asyncio.Event()

    async def third_waits_for_ever(**request):  # type: ignore[no-untyped-def]
        calls.append(request)
        if len(calls) == 3:
            third_waits.set()
            await asyncio.Event().wait()
        return await dispatch(**request)

    monkeypatch.setattr(gateway_dispatch, "dispatch", third_waits_for_ever)
    (replica,) = runtime.replicas.values()
    aborted_before = replica.metrics.snapshot().totals.counters.get("aborted", 0)
    leaving = asyncio.create_task(_complete(pair, n=3, max_tokens=1000, temperature=0))
    async with asyncio.timeout(30):
        await third_waits.wait()
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    monkeypatch.setattr(gateway_dispatch, "dispatch", dispatch)
    await replica.wait_idle()
    stats = replica.engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert replica.metrics.snapshot().totals.counters.get("aborted", 0) - aborted_before == 2
    assert _in_flight(pair) == 0  # both slots given back
