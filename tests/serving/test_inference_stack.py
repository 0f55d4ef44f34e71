"""The inference endpoints run behind a lean middleware stack (config/inference.py): security headers
and the host check stay, the browser middleware (and its per-request thread hops) go. Requests go
through the real ASGI application, as daphne would send them."""

from __future__ import annotations

import httpx
import pytest
from asgiref.sync import sync_to_async

pytestmark = pytest.mark.django_db(transaction=True)


def _client() -> httpx.AsyncClient:
    from config.asgi import application

    return httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://localhost")


async def test_an_over_quota_inference_request_is_refused_with_security_headers_and_no_cookies(
    make_tenant, registered_model, settings
) -> None:
    settings.ALLOWED_HOSTS = ["localhost"]
    flooder = await sync_to_async(make_tenant)("flooder", requests_per_second=0.001)
    async with _client() as client:
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
    async with _client() as client:
        response = await client.post("/v1/completions", json={"prompt": "hi"}, headers=acme.auth)
    assert response.status_code == 400


async def test_other_paths_keep_the_full_stack(settings) -> None:
    settings.ALLOWED_HOSTS = ["localhost"]
    async with _client() as client:
        response = await client.get("/dashboard/")
    assert response.status_code == 302  # to the login page: sessions and auth ran
    assert response.headers["X-Frame-Options"] == "DENY"


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

    async with _client() as client:
        await client.post(
            "/v1/models/demo-chat/infer", json={"input": "hi", "max_tokens": 2}, headers=flooder.auth
        )  # warm-up
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
