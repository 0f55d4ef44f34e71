"""OpenAI's `service_tier` on every generative endpoint (serving/gateway/service_tiers.py): granted up to
the tenant's quota, echoed as OpenAI does, refused above it with nothing dispatched; and the tenant's
caps inside a replica travel with the request to the replica's scheduler."""

from __future__ import annotations

import json
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator

from config.asgi import application
from tests.serving.conftest import asgi_client

pytestmark = pytest.mark.django_db(transaction=True)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_the_tier_asked_is_served_and_echoed_on_chat_completions_and_infer(
    runtime: Any, make_tenant: Any, settings: Any
) -> None:
    settings.ALLOWED_HOSTS = ["localhost"]
    tenant = await sync_to_async(make_tenant)("gold", max_service_tier="priority")
    async with asgi_client() as client:
        chat = await client.post(
            "/v1/chat/completions",
            json={
                "model": "demo-chat",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
                "service_tier": "priority",
            },
            headers=_auth(tenant.key),
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["service_tier"] == "priority"
        streamed = await client.post(
            "/v1/completions",
            json={"model": "demo-chat", "prompt": "hi", "max_tokens": 3, "stream": True}
            | {"service_tier": "flex"},
            headers=_auth(tenant.key),
        )
        chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        assert chunks and {chunk["service_tier"] for chunk in chunks} == {"flex"}
        infer = await client.post(
            "/v1/models/demo-chat/infer", json={"input": "hi", "max_tokens": 2}, headers=_auth(tenant.key)
        )
        assert infer.json()["service_tier"] == "default"  # none asked: the default tier
        assert infer.headers["X-Service-Tier"] == "default"


async def test_a_tier_above_the_quota_is_a_403_and_nothing_is_dispatched(
    runtime: Any, make_tenant: Any, settings: Any
) -> None:
    settings.ALLOWED_HOSTS = ["localhost"]
    tenant = await sync_to_async(make_tenant)("basic")  # highest tier: default
    replica = next(iter(runtime.replicas.values()))
    steps_before = replica.engine.scheduler.num_steps
    async with asgi_client() as client:
        refused = await client.post(
            "/v1/chat/completions",
            json={
                "model": "demo-chat",
                "messages": [{"role": "user", "content": "hi"}],
                "service_tier": "priority",
            },
            headers=_auth(tenant.key),
        )
        bad = await client.post(
            "/v1/models/demo-chat/infer",
            json={"input": "hi", "service_tier": "gold"},
            headers=_auth(tenant.key),
        )
    assert refused.status_code == 403
    assert refused.json()["error"]["type"] == "permission_error"
    assert "highest tier is 'default'" in refused.json()["error"]["message"]
    assert bad.status_code == 400 and "service_tier" in bad.json()["error"]["message"]
    assert replica.engine.scheduler.num_steps == steps_before  # no replica saw either


async def test_a_flex_only_tenant_asking_auto_is_served_at_flex(
    runtime: Any, make_tenant: Any, settings: Any
) -> None:
    settings.ALLOWED_HOSTS = ["localhost"]
    tenant = await sync_to_async(make_tenant)("batch", max_service_tier="flex")
    async with asgi_client() as client:
        response = await client.post(
            "/v1/completions",
            json={"model": "demo-chat", "prompt": "hi", "max_tokens": 2, "service_tier": "auto"},
            headers=_auth(tenant.key),
        )
    assert response.status_code == 200 and response.json()["service_tier"] == "flex"


async def test_the_tenants_tier_and_caps_reach_the_replicas_scheduler(
    runtime: Any, make_tenant: Any, settings: Any
) -> None:
    settings.ALLOWED_HOSTS = ["localhost"]
    caps = {"max_service_tier": "priority", "max_running_sequences": 2, "kv_share": 0.5}
    tenant = await sync_to_async(make_tenant)("capped", **caps)
    replica = next(iter(runtime.replicas.values()))
    scheduler = replica.engine.scheduler
    async with asgi_client() as client:
        response = await client.post(
            "/v1/models/demo-chat/infer",
            json={"input": "hi", "max_tokens": 2, "service_tier": "priority"},
            headers=_auth(tenant.key),
        )
    assert response.status_code == 200, response.text
    admission = scheduler._admission  # the caps the replica now applies to this tenant
    tenant_id = tenant.context.tenant_name
    assert admission.running_cap(tenant_id) == 2
    assert admission.block_cap(tenant_id) == int(0.5 * scheduler.kv_cache.num_blocks)


async def test_the_websocket_takes_a_tier_and_echoes_it_when_done(runtime: Any, make_tenant: Any) -> None:
    tenant = await sync_to_async(make_tenant)("ws", max_service_tier="priority")
    ws = WebsocketCommunicator(application, "/v1/models/demo-chat/stream", headers=[])
    assert (await ws.connect(timeout=10))[0]
    await ws.send_json_to({"type": "auth", "api_key": tenant.key})
    await ws.send_json_to({"type": "infer", "input": "hi", "max_tokens": 2, "service_tier": "priority"})
    messages = [await ws.receive_json_from(timeout=10) for _ in range(3)]
    assert messages[-1]["type"] == "done" and messages[-1]["service_tier"] == "priority"
    await ws.send_json_to({"type": "infer", "input": "hi", "service_tier": "fast"})
    assert (await ws.receive_json_from(timeout=10))["error"]["type"] == "invalid_request_error"
    await ws.disconnect()
