"""Helpers the serving tests share: a submissions layer on the test Redis, a record of the commands a
redis.asyncio client issues, the demo encoder models registered, an HTTP client on the ASGI app, and an
`openai` client on it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from asgiref.sync import sync_to_async

from serving.transport.channel_layers import OneTripRedisChannelLayer


def one_trip_layer(redis_url: str, **config: object) -> OneTripRedisChannelLayer:
    """The submissions layer on the test Redis, under a prefix of its own."""
    return OneTripRedisChannelLayer(
        hosts=[{"address": redis_url, "socket_timeout": None}],
        prefix=f"test-{uuid.uuid4().hex[:8]}",
        serializer_format="json",
        **config,
    )


def record_commands(client: Any) -> list[tuple[Any, ...]]:
    """The commands (name first, then their arguments) a redis.asyncio client issues from now on; the
    client still runs them."""
    commands: list[tuple[Any, ...]] = []
    execute = client.execute_command

    async def recorded(*args: Any, **options: Any) -> Any:
        commands.append((str(args[0]).upper(), *args[1:]))
        return await execute(*args, **options)

    client.execute_command = recorded
    return commands


def _register(name: str, kind: str, source_dir: Any) -> Any:
    from registry.services import model_version_register

    return model_version_register(
        name=name, version="v1", source_dir=source_dir, kind=kind, created_by="test"
    )


@pytest.fixture
def registered_embedding_model(db: None, demo_embedding_model_dir):  # type: ignore[no-untyped-def]
    from registry.models import Model

    return _register("demo-embed", Model.Kind.EMBEDDING, demo_embedding_model_dir)


@pytest.fixture
def registered_classifier(db: None, demo_classifier_model_dir):  # type: ignore[no-untyped-def]
    from registry.models import Model

    return _register("demo-classify", Model.Kind.CLASSIFIER, demo_classifier_model_dir)


def asgi_client() -> httpx.AsyncClient:
    """A real HTTP client on the whole ASGI application (routing, the inference handler, middleware)."""
    from config.asgi import application

    return httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://localhost")


# Not named `client`: that would shadow pytest-django's test client for every serving test.
@pytest.fixture
async def openai_client(runtime: Any, make_tenant: Any, settings: Any) -> AsyncIterator[openai.AsyncOpenAI]:
    """The `openai` client on the whole application (this loop's runtime started) as tenant acme, its
    quotas out of the way of tests that send many requests at once."""
    settings.ALLOWED_HOSTS = ["localhost"]
    acme = await sync_to_async(make_tenant)(
        "acme", requests_per_second=1000, max_concurrent_requests=200, tokens_per_minute=10**8
    )
    async with asgi_client() as http:
        yield openai_on(http, acme.key)


def openai_on(http: httpx.AsyncClient, api_key: str) -> openai.AsyncOpenAI:
    """The `openai` client over an HTTP client on the ASGI app (asgi_client), without retries: a test
    sees each answer as the server gave it."""
    return openai.AsyncOpenAI(
        base_url="http://localhost/v1",
        api_key=api_key,
        # openai takes an httpx client too, though its newer type hints name only httpx2's.
        http_client=http,  # type: ignore[arg-type]
        max_retries=0,
    )


async def serve_encoders(settings: Any) -> Any:
    """The in-process runtime with every registered model served, ready; encoders batch up to 4 inputs
    with a long delay, so that concurrent requests of a test always find company."""
    from serving.runtime import get_runtime

    settings.ALLOWED_HOSTS = ["localhost"]
    settings.REPLICA_EMBED_MAX_BATCH_SIZE = 4
    settings.REPLICA_EMBED_MAX_WAIT_S = 0.5
    runtime = await get_runtime()
    assert await runtime.wait_ready()
    return runtime


def replica_of(runtime: Any, model_name: str) -> Any:
    (replica,) = [r for r in runtime.replicas.values() if r.ref.model_name == model_name]
    return replica


@pytest.fixture
def acme(make_tenant, registered_model, runtime):  # type: ignore[no-untyped-def]
    """Tenant `acme`, with the demo model registered and this loop's runtime started."""
    return make_tenant("acme")
