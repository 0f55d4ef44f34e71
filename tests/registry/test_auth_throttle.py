"""Failed sign-ins are throttled (registry/auth_throttle.py): past the limit the next attempts get a 429
with Retry-After, the right key or password included, on every way in: the inference API, a WebSocket,
the control plane's API and the staff login."""

from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import AsyncClient, Client

from registry.auth_throttle import FailureThrottle, api_key_attempt

LIMIT = 3


@pytest.fixture(autouse=True)
def _low_limit(settings) -> None:  # type: ignore[no-untyped-def]
    settings.AUTH_FAILURE_LIMIT = LIMIT
    settings.AUTH_FAILURE_WINDOW_S = 60


def test_a_key_is_let_through_again_once_its_oldest_failure_leaves_the_window() -> None:
    now = [0.0]
    throttle = FailureThrottle(clock=lambda: now[0])
    attempt = api_key_attempt("10.0.0.1", "sy-abcdefgh")
    for t in (0.0, 10.0, 20.0):
        now[0] = t
        assert throttle.retry_after_s(attempt) is None
        throttle.record(attempt)
    now[0] = 30.0
    assert throttle.retry_after_s(attempt) == pytest.approx(30.0)  # the failure at 0 leaves at 60
    assert throttle.retry_after_s(api_key_attempt("10.0.0.2", "sy-abcdefgh")) == pytest.approx(
        30.0
    )  # the prefix
    assert throttle.retry_after_s(api_key_attempt("10.0.0.2", "sy-zzzzzzzz")) is None
    now[0] = 60.0
    assert throttle.retry_after_s(attempt) is None


@pytest.mark.django_db(transaction=True)
async def test_the_inference_api_refuses_even_the_right_key_after_failures(make_tenant) -> None:
    tenant_with_key = await sync_to_async(make_tenant)("acme")
    client = AsyncClient()
    body = {"input": "hello", "max_tokens": 1}
    for i in range(LIMIT):
        wrong = await client.post(
            "/v1/models/demo-chat/infer",
            body,
            content_type="application/json",
            headers={"Authorization": f"Bearer sy-bad{i}"},
        )
        assert wrong.status_code == 401
    right = await client.post(
        "/v1/models/demo-chat/infer",
        body,
        content_type="application/json",
        headers={"Authorization": f"Bearer {tenant_with_key.key}"},
    )
    assert right.status_code == 429 and right.json()["error"]["type"] == "rate_limit_error"
    assert 0 < int(right.headers["Retry-After"]) <= 60


@pytest.mark.django_db(transaction=True)
async def test_a_websocket_auth_after_failures_is_refused(make_tenant) -> None:
    from config.asgi import application

    tenant_with_key = await sync_to_async(make_tenant)("acme")
    for i in range(LIMIT + 1):
        key = f"sy-bad{i}" if i < LIMIT else tenant_with_key.key
        socket = WebsocketCommunicator(application, "/v1/models/demo-chat/stream")
        # The communicator names no client; set before the application's task first runs (it reads the
        # scope then), as a server would: attempts count under the address.
        socket.scope["client"] = ("10.1.2.3", 50000)
        connected, _ = await socket.connect()
        assert connected
        await socket.send_json_to({"type": "auth", "api_key": key})
        error = await socket.receive_json_from(timeout=10)
        closed = await socket.receive_output(timeout=10)
        await socket.disconnect()
        expected = "authentication_error" if i < LIMIT else "rate_limit_error"
        assert error["error"]["type"] == expected
        assert closed == {"type": "websocket.close", "code": 4401 if i < LIMIT else 1013}


@pytest.mark.django_db
def test_the_control_plane_api_refuses_even_the_right_key_after_failures(make_tenant) -> None:
    tenant_with_key = make_tenant("acme")
    client = Client()
    for i in range(LIMIT):
        assert client.get("/v1/models", headers={"Authorization": f"Bearer sy-bad{i}"}).status_code == 401
    refused = client.get("/v1/models", headers={"Authorization": f"Bearer {tenant_with_key.key}"})
    assert refused.status_code == 429 and "Retry-After" in refused.headers


@pytest.mark.django_db
def test_the_staff_login_refuses_even_the_right_password_after_failures(django_user_model) -> None:
    django_user_model.objects.create_superuser("root", "root@example.com", "right-password")
    client = Client()
    for _ in range(LIMIT):
        wrong = client.post("/admin/login/", {"username": "root", "password": "wrong"})
        assert wrong.status_code == 200 and not wrong.wsgi_request.user.is_authenticated
    refused = client.post("/admin/login/", {"username": "root", "password": "right-password"})
    assert refused.status_code == 429 and "Retry-After" in refused.headers
    assert "_auth_user_id" not in client.session


@pytest.mark.redis
def test_with_redis_a_fleet_lets_through_the_limit_and_one_more_per_gateway_not_the_limit_each(
    settings, redis_url: str
) -> None:  # type: ignore[no-untyped-def]
    """Two gateways' throttles (two processes' memories) on one Redis: failures spread over both count
    together, and each refuses from its next failure once the fleet has seen the limit."""
    settings.REDIS_URL = redis_url
    first, second = FailureThrottle(), FailureThrottle()
    first.clear()
    attempt = api_key_attempt("10.0.0.9", "sy-sprayed0")
    let_through = 0
    for gateway in [first, second] * 10:  # a client alternating between two gateways
        if gateway.retry_after_s(attempt) is None:
            let_through += 1
            gateway.record(attempt)
    # LIMIT (3) spread over both, then one more on the gateway that had not yet heard the fleet's count.
    assert let_through == LIMIT + 1  # counted apart, each gateway would have let LIMIT through: 6
    wait = first.retry_after_s(attempt)
    assert wait is not None and 55 < wait <= 60
    assert second.retry_after_s(api_key_attempt("10.0.0.10", "sy-sprayed0")) is not None  # the prefix
    first.clear()  # the fleet's counts go too


def test_with_redis_unreachable_failures_are_still_counted_in_the_process(settings) -> None:  # type: ignore[no-untyped-def]
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    throttle = FailureThrottle()
    attempt = api_key_attempt("10.0.0.11", "sy-offline0")
    for _ in range(LIMIT):
        assert throttle.retry_after_s(attempt) is None
        throttle.record(attempt)
    assert throttle.retry_after_s(attempt) is not None
