"""Requests that fail where no replica can count them reach their version's metrics through the gateway,
where the rollout judge reads them."""

from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from tests.serving.gateway.test_dispatch import _a_replica_chosen_first, _hello, one_token_then

pytestmark = pytest.mark.django_db(transaction=True)


async def _window(version: str = "v1"):  # type: ignore[no-untyped-def]
    """demo-chat's version window over the last minute, once this gateway's counts are written."""
    from serving.runtime import get_runtime
    from serving.telemetry.metrics_reads import version_window

    await (await get_runtime()).flush_failures()
    now = timezone.now()
    return await sync_to_async(version_window)(
        model_name="demo-chat",
        version=version,
        start=now - timedelta(minutes=1),
        end=now + timedelta(seconds=5),
    )


async def _counters(version: str = "v1") -> dict[str, int]:
    from serving.models import MetricWindow

    rows = await sync_to_async(list)(
        MetricWindow.objects.filter(version__version=version, replica_id__startswith="gateway-").values_list(
            "counters", flat=True
        )
    )
    totals: dict[str, int] = {}
    for counters in rows:
        for name, value in counters.items():
            totals[name] = totals.get(name, 0) + value
    return totals


async def test_a_stream_whose_replica_dies_after_its_first_token_counts_as_the_versions_error(
    make_tenant, runtime, monkeypatch
) -> None:
    acme = await sync_to_async(make_tenant)("acme")
    handle = await _hello(acme, max_tokens=4)
    one_token_then(handle, monkeypatch, "replica_lost", "it stopped", gave_up=True)
    try:
        events = [event async for event in handle.events()]
    finally:
        await handle.close()
    assert events[-1]["error"]["type"] == "replica_lost"
    window = await _window()
    assert window.num_errors == 1  # (the replica, alive here, may yet count the abort)
    assert await _counters() == {
        "requests": 1,
        "errors": 1,
        "errors.replica_lost": 1,
        "finish.error": 1,
        "prompt_tokens": 0,
        "output_tokens": 0,
    }


async def test_a_request_whose_replica_dies_and_whose_retry_finds_none_is_counted_once(
    make_tenant, runtime, monkeypatch
) -> None:
    from serving.gateway import in_flight
    from serving.gateway.breaker import breaker
    from serving.gateway.errors import GatewayError

    acme = await sync_to_async(make_tenant)("acme")
    dead, _ = await _a_replica_chosen_first(runtime, monkeypatch, "dead-replica", is_alive=False)

    async def only_the_dead_one(model_name: str, version: str):  # type: ignore[no-untyped-def]
        return [dead]

    monkeypatch.setattr(runtime, "candidates", only_the_dead_one)
    monkeypatch.setattr(in_flight, "choose_replica", lambda replicas, rng: replicas[0] if replicas else None)
    try:
        with pytest.raises(GatewayError) as failed:
            await _hello(acme, max_tokens=2)
    finally:
        breaker.record_success("dead-replica")  # leave no state for other tests
    assert failed.value.status == 503
    window = await _window()
    assert (window.num_requests, window.num_errors) == (1, 1)
    assert (await _counters()).get("errors.replica_lost") == 1  # the cause, not the retry's "no replica"


async def test_a_retry_that_succeeds_counts_nothing_at_the_gateway(make_tenant, runtime, monkeypatch) -> None:
    from serving.gateway.breaker import breaker

    acme = await sync_to_async(make_tenant)("acme")
    await _a_replica_chosen_first(runtime, monkeypatch, "dead-replica", is_alive=False)
    try:
        handle = await _hello(acme, max_tokens=2)
        events = [event async for event in handle.events()]
        await handle.close()
    finally:
        breaker.record_success("dead-replica")
    assert handle.num_retries == 1 and events[-1]["finish_reason"] == "length"
    await _window()
    assert await _counters() == {}


async def test_no_ready_replica_counts_for_a_version_with_traffic_not_for_a_pin_to_one_without(
    make_tenant, runtime, monkeypatch, demo_model_dir, settings
) -> None:
    from django.test import AsyncClient

    from registry.services import model_version_register

    settings.REPLICA_MAX_PINNED = 0  # no replica started for a pin (tests/serving/runtime/test_pins.py)
    await sync_to_async(model_version_register)(name="demo-chat", version="v2", source_dir=demo_model_dir)
    pinner = await sync_to_async(make_tenant)("pinner", may_pin=True)
    client = AsyncClient()

    async def post(headers: dict[str, str]):  # type: ignore[no-untyped-def]
        return await client.post(
            "/v1/models/demo-chat/infer", {"input": "hi"}, content_type="application/json", headers=headers
        )

    pinned = await post({**pinner.auth, "X-Version-Pin": "v2"})  # v2 has no traffic, so no replica
    assert pinned.status_code == 503
    assert await _counters("v2") == {}

    async def none_ready(model_name: str, version: str):  # type: ignore[no-untyped-def]
        return []

    monkeypatch.setattr(runtime, "candidates", none_ready)  # v1's replicas all gone (crashed, say)
    for _ in range(2):
        refused = await post(pinner.auth)
        assert refused.status_code == 503 and refused.json()["error"]["message"].startswith(
            "no ready replica"
        )
    window = await _window("v1")
    assert (window.num_requests, window.num_errors) == (2, 2)
    assert (await _counters("v1")).get("errors.no_ready_replica") == 2


async def test_what_the_client_did_is_not_the_versions_error(make_tenant, runtime, monkeypatch) -> None:
    """Over quota, or gone before the end: nothing the version did."""
    from serving.gateway.errors import GatewayError

    burst_of_one = await sync_to_async(make_tenant)("burst", requests_per_second=0.001)
    handle = await _hello(burst_of_one, max_tokens=8)
    async for event in handle.events():
        if "token" in event:
            break
    await handle.close()  # the client left mid-stream

    async def none_ready(model_name: str, version: str):  # type: ignore[no-untyped-def]
        return []

    monkeypatch.setattr(runtime, "candidates", none_ready)
    with pytest.raises(GatewayError) as refused:
        await _hello(burst_of_one, max_tokens=2)
    assert refused.value.status == 429  # over quota is the answer before "no ready replica"
    await _window()
    assert await _counters() == {}


async def test_a_request_queued_behind_a_full_batch_longer_than_the_inactivity_timeout_is_served(
    make_tenant, registered_model, settings, monkeypatch
) -> None:
    """One sequence at a time, two requests of ~2.4 s each: the second waits in the replica's queue longer
    than the gateway's inactivity timeout (1.5 s here, 60 s by default). The replica's keepalives tell
    the gateway it still holds the request: it is served, not given up as lost, and the replica is not
    blamed for it."""
    import asyncio
    import json

    from django.test import AsyncClient

    from serving.gateway import in_flight
    from serving.gateway.breaker import breaker
    from serving.replica import model_loop
    from serving.runtime import get_runtime

    settings.REPLICA_MAX_NUM_SEQS = 1
    # 15 keepalives to a timeout: a stall of the loaded machine must not pass for a lost request.
    monkeypatch.setattr(in_flight, "INACTIVITY_TIMEOUT_S", 1.5)
    monkeypatch.setattr(model_loop, "KEEPALIVE_S", 0.1)
    runtime = await get_runtime()
    assert await runtime.wait_ready()
    (served,) = runtime.replicas.values()
    served.armed_faults.step_delay_s = 0.08  # 30 tokens: ~2.4 s a request
    tenant = await sync_to_async(make_tenant)("acme")
    body = {"input": "hello", "max_tokens": 30, "temperature": 0}

    async def infer() -> object:
        return await AsyncClient().post(
            "/v1/models/demo-chat/infer",
            data=json.dumps(body),
            content_type="application/json",
            headers=tenant.auth,
        )

    responses = await asyncio.gather(infer(), infer())
    for response in responses:
        assert response.status_code == 200, response.content
        assert response.json()["usage"]["completion_tokens"] == 30
    state = breaker._states.get(served.replica_id)
    assert state is None or state.num_failures == 0
    assert (await _counters()).get("errors", 0) == 0


async def test_a_channel_layer_that_cannot_send_is_a_503_to_retry_not_a_500(
    make_tenant, runtime, monkeypatch
) -> None:
    import json

    from django.test import AsyncClient

    from serving.gateway.quota_store import quota_store
    from serving.transport.protocol import SUBMIT

    acme = await sync_to_async(make_tenant)("acme")
    send = runtime.layer.send

    async def refused(channel: str, message: dict) -> None:  # type: ignore[type-arg]
        if message.get("type") == SUBMIT:
            raise ConnectionError("Connection refused")
        await send(channel, message)

    monkeypatch.setattr(runtime.layer, "send", refused)
    response = await AsyncClient().post(
        "/v1/models/demo-chat/infer",
        data=json.dumps({"input": "hello", "max_tokens": 2}),
        content_type="application/json",
        headers=acme.auth,
    )
    assert response.status_code == 503, response.content
    assert response.headers["Retry-After"] == "1"
    assert response.json()["error"]["type"] == "service_unavailable"
    assert quota_store().usage([acme.context])[acme.context.tenant_id].num_in_flight == 0


async def test_a_retry_that_cannot_read_the_replica_directory_ends_the_stream_with_an_error_event(
    make_tenant, runtime, monkeypatch
) -> None:
    """Accepted, then its replica is lost before the first token; the retry's read of the replicas fails
    (Redis down): the stream still ends with one final error event, not an exception that cuts it off
    without one."""
    from serving.gateway.breaker import breaker
    from tests.serving.gateway.test_dispatch import _run_scripted

    acme = await sync_to_async(make_tenant)("acme")
    (replica,) = await runtime.candidates("demo-chat", "v1")
    lost = {"finish_reason": "error", "error": {"type": "replica_lost", "message": "gone"}}
    candidates = runtime.candidates
    calls = []

    async def unreadable_after_the_first(model_name: str, version: str):  # type: ignore[no-untyped-def]
        calls.append(version)
        if len(calls) > 1:
            raise ConnectionError("Connection refused")
        return await candidates(model_name, version)

    monkeypatch.setattr(runtime, "candidates", unreadable_after_the_first)
    try:
        _, events = await _run_scripted(acme, monkeypatch, [{"accepted": True}, lost], max_tokens=2)
    finally:
        breaker.record_success(replica.replica_id)
    assert len(calls) == 2  # the retry was tried
    assert [e.get("finish_reason") for e in events] == ["error"]
    assert events[0]["error"]["type"] == "replica_unavailable"


async def test_a_retry_that_may_have_reached_its_replica_is_aborted_there(
    make_tenant, runtime, monkeypatch
) -> None:
    """Accepted, then lost before the first token; the retry's send fails once the message may be on
    the other replica's channel (the connection dropped mid-send): the stream ends in an error, and that
    try is aborted on its replica, which would otherwise run it to its end for no one."""
    import dataclasses

    from serving.gateway import in_flight
    from serving.gateway.breaker import breaker
    from serving.transport.protocol import ABORT, SUBMIT
    from tests.serving.gateway.test_dispatch import _run_scripted

    acme = await sync_to_async(make_tenant)("acme")
    (first,) = await runtime.candidates("demo-chat", "v1")
    other = dataclasses.replace(first, replica_id="other-replica", channel_name="switchyard.replica.other")
    candidates = runtime.candidates

    async def with_the_other(model_name: str, version: str):  # type: ignore[no-untyped-def]
        return [*await candidates(model_name, version), other]

    send, aborts = runtime.layer.send, []

    async def dropped_mid_send(channel: str, message: dict) -> None:  # type: ignore[type-arg]
        if message.get("type") == ABORT:
            aborts.append((channel, message["request_id"]))
        if channel == other.channel_name and message.get("type") == SUBMIT:
            raise ConnectionError("Connection reset by peer")
        await send(channel, message)

    monkeypatch.setattr(runtime, "candidates", with_the_other)
    monkeypatch.setattr(runtime.layer, "send", dropped_mid_send)
    # The first try on the real replica, the retry (which leaves that one out) on the other.
    monkeypatch.setattr(in_flight, "choose_replica", lambda replicas, rng: replicas[0] if replicas else None)
    lost = {"finish_reason": "error", "error": {"type": "replica_lost", "message": "gone"}}
    try:
        handle, events = await _run_scripted(acme, monkeypatch, [{"accepted": True}, lost], max_tokens=2)
    finally:
        breaker.record_success(first.replica_id)
    assert [e.get("finish_reason") for e in events] == ["error"]
    assert (other.channel_name, handle._wire_id) in aborts
