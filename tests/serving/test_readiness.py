"""GET /readyz: ready once the database answers and no replica of this process is still loading."""

from __future__ import annotations

import httpx
import pytest

from serving.runtime import ReplicaHandle

pytestmark = pytest.mark.django_db(transaction=True)


def _handle(model: str, state: str) -> ReplicaHandle:
    return ReplicaHandle(
        replica_id=f"{model}-{state}",
        model_name=model,
        version="v1",
        channel_name=f"switchyard.replica.{model}.v1.x",
        state=state,
        load=0,
        kv_cache_usage=0.0,
        is_ready=state == "ready",
        is_local=True,
    )


@pytest.mark.parametrize(
    ("states", "ready"),
    [
        ({"chat": "ready", "embed": "loading"}, False),  # the chat model would answer 503 meanwhile
        ({"chat": "ready", "embed": "ready"}, True),
        ({"chat": "ready", "embed": "failed"}, True),  # a failed load does not hold the rest back
        ({"chat": "failed"}, False),
        ({}, False),
    ],
)
async def test_ready_only_when_no_replica_is_still_loading(
    monkeypatch, settings, states: dict, ready: bool
) -> None:
    from config.asgi import application
    from serving import api

    class Runtime:
        async def all_replicas(self) -> list[ReplicaHandle]:
            return [_handle(model, state) for model, state in states.items()]

    async def get_runtime() -> Runtime:
        return Runtime()

    monkeypatch.setattr(api, "get_runtime", get_runtime)
    settings.ALLOWED_HOSTS = ["localhost"]
    transport = httpx.ASGITransport(app=application)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
        response = await client.get("/readyz")
    assert response.status_code == (200 if ready else 503)
    assert response.json()["ready"] is ready
