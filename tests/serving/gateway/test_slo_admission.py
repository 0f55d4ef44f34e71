"""SLO-aware admission through the in-process data plane: a tenant with a TTFT objective is routed to a
replica forecast to meet it, or refused at once; one without waits its turn as ever."""

import asyncio
import dataclasses
import re

import pytest

from tests.serving.conftest import asgi_client

pytestmark = pytest.mark.django_db(transaction=True)

PARAMS = {"max_tokens": 24, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop": []}
PROMPT = "Once upon a time there was a little train that carried letters and parcels. " * 6


@pytest.fixture(autouse=True)
def _fresh_forecast_metrics():  # type: ignore[no-untyped-def]
    from serving.telemetry import ttft_forecasts

    ttft_forecasts.clear()
    yield
    ttft_forecasts.clear()


@pytest.fixture
def small_batch(settings):  # type: ignore[no-untyped-def]
    """Replicas that run 4 sequences at once: a flood of 8 keeps 4 waiting, their prompts unprefilled."""
    settings.REPLICA_MAX_NUM_SEQS = 4


async def _tenant(make_tenant, name: str, *, ttft_objective_ms: int | None = None):  # type: ignore[no-untyped-def]
    """A tenant with room for a flood, and its TTFT objective as the registry has it."""
    from asgiref.sync import sync_to_async

    from registry.models import Quota
    from registry.selectors import tenant_context

    def make():  # type: ignore[no-untyped-def]
        made = make_tenant(
            name, requests_per_second=1000.0, tokens_per_minute=10**7, max_concurrent_requests=100
        )
        Quota.objects.filter(tenant=made.tenant).update(ttft_objective_ms=ttft_objective_ms)
        return dataclasses.replace(made, context=tenant_context(tenant=made.tenant))

    return await sync_to_async(make)()


def _dispatch(tenant, *, text: str = "hello", max_tokens: int = 8, **params):  # type: ignore[no-untyped-def]
    from serving.gateway import dispatch as dispatch_module

    return dispatch_module.dispatch(
        context=tenant.context,
        path_model="demo-chat",
        pin=None,
        params={**PARAMS, "max_tokens": max_tokens, **params},
        text=text,
    )


def _submissions_sent(runtime, monkeypatch) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    """The submissions sent to replicas from now on: (tenant, channel)."""
    sent: list[tuple[str, str]] = []
    send = runtime.layer.send

    async def watched_send(channel: str, message: dict) -> None:  # type: ignore[type-arg]
        if channel.startswith("switchyard.replica.") and "tenant" in message:
            sent.append((message["tenant"], channel))
        await send(channel, message)

    monkeypatch.setattr(runtime.layer, "send", watched_send)
    return sent


async def _until_queued_ahead(runtime) -> None:  # type: ignore[no-untyped-def]
    """Until the replica reports prompt tokens queued and a measured prefill rate (its next step's
    account, which no event announces)."""
    async with asyncio.timeout(10):
        while True:
            (replica,) = await runtime.candidates("demo-chat", "v1")
            if replica.queued_prompt_tokens > 0 and replica.prefill_tokens_per_s > 0:
                return
            await asyncio.sleep(0.01)


async def test_a_tight_objective_is_refused_at_once_during_a_flood_and_a_tenant_without_one_is_served(
    small_batch, make_tenant, runtime, monkeypatch, settings
) -> None:
    from prometheus_client.exposition import generate_latest

    from serving.gateway.in_flight import close_all
    from serving.gateway.quota_store import quota_store
    from serving.telemetry.prometheus import registry

    settings.ALLOWED_HOSTS = ["localhost"]
    flooder = await _tenant(make_tenant, "flooder")
    hurried = await _tenant(make_tenant, "hurried", ttft_objective_ms=1)
    patient = await _tenant(make_tenant, "patient")
    sent = _submissions_sent(runtime, monkeypatch)
    flood = [await _dispatch(flooder, text=PROMPT, max_tokens=64) for _ in range(8)]
    try:
        await _until_queued_ahead(runtime)
        started = asyncio.get_running_loop().time()
        async with asgi_client() as client:
            refused = await client.post(
                "/v1/completions",
                json={"model": "demo-chat", "prompt": "hello", "max_tokens": 8},
                headers=hurried.auth,
            )
        assert asyncio.get_running_loop().time() - started < 1.0  # at once, not at a timeout
        assert refused.status_code == 429
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert "TTFT objective 1 ms" in refused.json()["error"]["message"]
        assert int(refused.headers["Retry-After"]) >= 1
        # The same wait to the millisecond, as the openai clients read it first, never longer.
        assert 1 <= int(refused.headers["retry-after-ms"]) <= 1000 * int(refused.headers["Retry-After"])
        assert "hurried" not in {tenant for tenant, _ in sent}  # nothing reached the replica
        usage = quota_store().usage([hurried.context])[hurried.context.tenant_id]
        assert usage.num_in_flight == 0  # what admission took is given back

        served = await _dispatch(patient)
        try:
            events = [event async for event in served.events()]
        finally:
            await served.close()
        assert events[-1]["finish_reason"] in ("stop", "length")
        assert any("token" in event for event in events)
    finally:
        await close_all(flood)
    metrics = generate_latest(registry).decode()
    assert 'switchyard_slo_refusals_total{model="demo-chat",version="v1"} 1.0' in metrics
    # The patient request's first token was set against the forecast for its replica (the flood's
    # requests were never read).
    labels = r'direction="(late|early)",model="demo-chat",version="v1"'
    counts = re.findall(r"switchyard_ttft_forecast_error_seconds_count\{" + labels + r"\} 1\.0", metrics)
    assert len(counts) == 1


async def test_a_replica_forecast_to_miss_is_skipped_for_one_that_meets_the_objective(
    make_tenant, runtime, monkeypatch
) -> None:
    """The router's choice among the replicas left: a second replica of demo-chat:v1, chosen whenever it
    is offered, is forecast to miss a 2 s objective (a minute of prompt queued ahead): the tenant with
    the objective is served by the real one, and a tenant without one is sent to the busy one."""
    from serving.gateway import in_flight

    hurried = await _tenant(make_tenant, "hurried", ttft_objective_ms=2000)
    patient = await _tenant(make_tenant, "patient")
    (real,) = await runtime.candidates("demo-chat", "v1")
    busy = dataclasses.replace(
        real,
        replica_id="busy",
        channel_name="switchyard.replica.busy",  # nothing reads it
        queued_prompt_tokens=600_000,
        prefill_tokens_per_s=10_000.0,
    )
    real_candidates = runtime.candidates

    async def candidates(model_name: str, version: str, **kwargs: object):  # type: ignore[no-untyped-def]
        return [busy, *await real_candidates(model_name, version, **kwargs)]

    monkeypatch.setattr(runtime, "candidates", candidates)
    monkeypatch.setattr(in_flight, "choose_replica", lambda replicas, rng: replicas[0] if replicas else None)
    sent = _submissions_sent(runtime, monkeypatch)

    served = await _dispatch(hurried)
    try:
        assert served.replica is not None and served.replica.replica_id == real.replica_id
        assert [e async for e in served.events()][-1]["finish_reason"] in ("stop", "length")
    finally:
        await served.close()

    # Without an objective, routing is as before: the router's pick, the busy one, which never answers
    # (it is no replica): the request is retried on the real one.
    unhurried = await _dispatch(patient)
    await unhurried.close()
    assert unhurried.num_retries == 1
    assert sent == [
        ("hurried", real.channel_name),
        ("patient", busy.channel_name),
        ("patient", real.channel_name),
    ]


async def test_a_request_waiting_past_the_replicas_queue_timeout_gets_a_503_to_retry(
    small_batch, make_tenant, runtime, settings
) -> None:
    """A replica whose seats are all taken ends a request that waited past its queue timeout with
    `queue_timeout`, which a client that is not streaming gets as a 503 with Retry-After, rather than
    waiting on in silence."""
    from serving.gateway.in_flight import close_all

    settings.ALLOWED_HOSTS = ["localhost"]
    settings.REPLICA_QUEUE_TIMEOUT_S = 0.5
    flooder = await _tenant(make_tenant, "flooder")
    # Every seat, held to the end: greedy on the random model reaches its EOS early, which freed the
    # seats before the waiting request timed out (a flaky test).
    flood = [await _dispatch(flooder, text=PROMPT, max_tokens=1000, ignore_eos=True) for _ in range(4)]
    streams = [request.events() for request in flood]
    try:
        # Seated, each: a flood still waiting when a slow machine's first step ends would time out itself.
        for request, stream in zip(flood, streams, strict=True):
            await anext(stream)
            request.set_reader(None)  # this test's own task: not to be cut off as a slow reader
        started = asyncio.get_running_loop().time()
        async with asgi_client() as client:
            waited = await client.post(
                "/v1/models/demo-chat/infer", json={"input": "hello", "max_tokens": 4}, headers=flooder.auth
            )
        assert waited.status_code == 503, waited.text
        assert "queue" in waited.json()["error"]["message"] and waited.headers["Retry-After"]
        assert asyncio.get_running_loop().time() - started < 0.5 + 5  # the timeout and a check, not 60 s
    finally:
        for stream in streams:
            await stream.aclose()
        await close_all(flood)
