"""The inference endpoints run behind a lean middleware stack (config/inference.py): security headers
and the host check stay, the browser middleware (and its per-request thread hops) go. Requests go
through the real ASGI application, as a server (uvicorn) would send them."""

from __future__ import annotations

import httpx
import pytest
from asgiref.sync import sync_to_async

from tests.serving.conftest import asgi_client

pytestmark = pytest.mark.django_db(transaction=True)


async def test_an_over_quota_inference_request_is_refused_with_security_headers_and_no_cookies(
    make_tenant, registered_model, settings
) -> None:
    settings.ALLOWED_HOSTS = ["localhost"]
    flooder = await sync_to_async(make_tenant)("flooder", requests_per_second=0.001)
    async with asgi_client() as client:
        statuses = []
        for _ in range(3):
            response = await client.post(
                "/v1/models/demo-chat/infer", json={"input": "hi", "max_tokens": 2}, headers=flooder.auth
            )
            statuses.append(response.status_code)
    assert statuses[1:] == [429, 429]  # the burst of one request admits the first
    assert response.json()["error"]["type"] == "rate_limit_error"
    assert "Retry-After" in response.headers
    assert response.headers["X-Content-Type-Options"] == "nosniff"  # SecurityMiddleware's header
    assert "Set-Cookie" not in response.headers
    assert "X-Frame-Options" not in response.headers  # the browser stack did not run


async def test_an_inference_request_for_an_unknown_host_is_refused(make_tenant, settings) -> None:
    settings.ALLOWED_HOSTS = ["api.example"]
    acme = await sync_to_async(make_tenant)("acme")
    async with asgi_client() as client:
        response = await client.post("/v1/completions", json={"prompt": "hi"}, headers=acme.auth)
    assert response.status_code == 400


async def test_other_paths_keep_the_full_stack(settings) -> None:
    settings.ALLOWED_HOSTS = ["localhost"]
    async with asgi_client() as client:
        response = await client.get("/dashboard/")
    assert response.status_code == 302  # to the login page: sessions and auth ran
    assert response.headers["X-Frame-Options"] == "DENY"


async def test_every_answer_under_v1_is_the_json_error_shape_unknown_paths_and_failures_too(
    make_tenant, registered_model, settings, monkeypatch
) -> None:
    from serving.edge import infer_api as api

    settings.ALLOWED_HOSTS = ["localhost"]
    acme = await sync_to_async(make_tenant)("acme")

    async def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug with a secret in its message")

    async with asgi_client() as client:
        unknown = await client.get("/v1/no-such-endpoint", headers=acme.auth)
        page = await client.get("/dashboard/no-such-page")
        monkeypatch.setattr(api, "model_snapshot", broken)  # a bug in the inference path
        failed = await client.post("/v1/models/demo-chat/infer", json={"input": "hi"}, headers=acme.auth)
    assert unknown.status_code == 404
    assert unknown.json() == {
        "error": {"type": "not_found_error", "message": "no such endpoint: GET /v1/no-such-endpoint"}
    }
    assert page.status_code in (302, 404) and not page.headers["content-type"].startswith("application/json")
    assert failed.status_code == 500
    assert failed.json()["error"]["type"] == "internal_error" and "secret" not in failed.text


async def test_refusals_do_not_start_a_thread_per_request(make_tenant, registered_model, settings) -> None:
    """Django's ASGIHandler runs each request's sync signal receivers on a thread pool of the request's
    own (a thread started and joined per request); the inference handler shares one thread instead."""
    import threading

    settings.ALLOWED_HOSTS = ["localhost"]
    flooder = await sync_to_async(make_tenant)("flooder", requests_per_second=0.001)
    started = []
    original_start = threading.Thread.start

    def counting_start(thread: threading.Thread) -> None:
        started.append(thread.name)
        original_start(thread)

    async with asgi_client() as client:
        await client.post(
            "/v1/models/demo-chat/infer", json={"input": "hi", "max_tokens": 2}, headers=flooder.auth
        )  # warm-up
        # The first request starts the runtime, which loads the replica in the background: its threads
        # are the process starting, not the refusals', and they came during the count now and then.
        from serving.runtime import get_runtime

        assert await (await get_runtime()).wait_ready()
        threading.Thread.start = counting_start  # type: ignore[method-assign]
        try:
            for _ in range(20):
                response = await client.post(
                    "/v1/models/demo-chat/infer", json={"input": "hi", "max_tokens": 2}, headers=flooder.auth
                )
                assert response.status_code == 429
        finally:
            threading.Thread.start = original_start  # type: ignore[method-assign]
    assert len(started) < 5, started


async def test_keys_still_authenticate_after_the_database_dropped_the_gateways_connections(
    make_tenant, settings, monkeypatch
) -> None:
    """The gateway reads keys and routing tables on worker threads, each with its own connection. When
        the server drops them (a restart, a failover, an idle timeout), the next read must reconnect rather
        than fail on the dead connection, on that request and on every later one; while none can be opened,
    a key the gateway has not seen lately gets a 503 with Retry-After, never a 500, and one it has seen
    still passes."""
    from django.db import connection

    from serving.gateway import auth as gateway

    if connection.vendor != "postgresql":
        pytest.skip("needs a database server that can drop its clients' connections (the Postgres pass)")
    settings.ALLOWED_HOSTS = ["localhost"]

    def drop_other_connections() -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )

    def set_allow_connections(allow: bool) -> None:
        import psycopg

        db = connection.settings_dict
        # Postgres refuses this from a session of the database itself: say it from the maintenance one.
        with psycopg.connect(
            dbname="postgres", user=db["USER"], host=db["HOST"], port=db["PORT"] or 5432, autocommit=True
        ) as admin:
            admin.execute(f'ALTER DATABASE "{db["NAME"]}" ALLOW_CONNECTIONS {allow}')

    async def infer_unknown_model(tenant_name: str) -> httpx.Response:
        tenant = await sync_to_async(make_tenant)(tenant_name)  # a new key: never in the auth cache
        return await client.post("/v1/models/no-such-model/infer", json={"input": "hi"}, headers=tenant.auth)

    async with asgi_client() as client:
        for i in range(3):  # the worker threads open their connections
            assert (await infer_unknown_model(f"before-{i}")).status_code == 404
        await sync_to_async(drop_other_connections)()
        statuses = [(await infer_unknown_model(f"after-{i}")).status_code for i in range(3)]
        assert statuses == [404, 404, 404]  # authenticated, then "model not found": the database answered

        # While the server takes no connections at all, an unseen key cannot be checked: a 503 to retry.
        # A key seen before passes on its last check, past the cache's few seconds: the request gets
        # as far as routing, whose last good word on this model is that there is none.
        seen = await sync_to_async(make_tenant)("seen")
        assert (
            await client.post("/v1/models/no-such-model/infer", json={}, headers=seen.auth)
        ).status_code == 404
        monkeypatch.setattr(gateway, "_AUTH_CACHE_TTL_S", 0.0)
        await sync_to_async(set_allow_connections)(False)
        try:
            await sync_to_async(drop_other_connections)()
            refused = await infer_unknown_model("during")
            known = await client.post("/v1/models/no-such-model/infer", json={}, headers=seen.auth)
        finally:
            await sync_to_async(set_allow_connections)(True)
        assert refused.status_code == 503
        assert refused.json()["error"]["message"] == "the API key could not be checked right now"
        assert refused.headers["Retry-After"] == "1"
        assert (
            known.status_code == 404 and known.json()["error"]["message"] == "model 'no-such-model' not found"
        )
        assert (await infer_unknown_model("back")).status_code == 404
