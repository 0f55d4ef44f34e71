"""A data plane that cannot start (its Redis unreachable when the server starts): every API answers
the documented JSON 503 with Retry-After, and the next request tries the start again."""

from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import sync_to_async

from tests.serving.conftest import asgi_client

pytestmark = pytest.mark.django_db(transaction=True)


async def test_a_data_plane_that_cannot_start_answers_503_not_500(
    make_tenant, registered_model, monkeypatch, settings
) -> None:
    from serving import runtime as runtime_module
    from serving.transport.channel_layers import StepPubSubChannelLayer

    # A real client of a Redis nothing listens for: its SUBSCRIBE (the gateway's inbox) is refused.
    unreachable = StepPubSubChannelLayer(hosts=["redis://127.0.0.1:1"])
    monkeypatch.setattr(runtime_module, "reply_layer", lambda: unreachable)
    settings.EMBEDDED_REPLICAS = False
    settings.ALLOWED_HOSTS = ["localhost"]
    acme = await sync_to_async(make_tenant)("acme")
    async with asgi_client() as client:
        responses = [
            await client.post("/v1/models/demo-chat/infer", json={"input": "hi"}, headers=acme.auth),
            await client.post(
                "/v1/completions", json={"model": "demo-chat", "prompt": "hi"}, headers=acme.auth
            ),
            await client.post(
                "/v1/chat/completions",
                json={"model": "demo-chat", "messages": [{"role": "user", "content": "hi"}]},
                headers=acme.auth,
            ),
        ]
        ready = await client.get("/readyz")
    for response in responses:
        assert response.status_code == 503, (response.request.url, response.text)
        assert response.json()["error"]["type"] == "service_unavailable"
        assert response.headers["Retry-After"] == "1"
    # Still ready, as with the directory unreadable: every gateway shares the Redis it cannot reach.
    assert ready.status_code == 200
    assert ready.json()["replica_directory"] is False
    assert asyncio.get_running_loop() not in runtime_module._runtimes  # not registered half-started
