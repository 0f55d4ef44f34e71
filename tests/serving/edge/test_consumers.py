"""WebSocket streaming through Channels' communicator, against an in-process replica."""

import json

import pytest
from channels.testing import WebsocketCommunicator
from django.utils import timezone

from config.asgi import application

pytestmark = pytest.mark.django_db(transaction=True)
PATH = "/v1/models/demo-chat/stream"


@pytest.fixture
async def acme(make_tenant, runtime):
    from asgiref.sync import sync_to_async

    return await sync_to_async(make_tenant)("acme")


async def _connect(headers: list[tuple[bytes, bytes]] | None = None) -> WebsocketCommunicator:
    communicator = WebsocketCommunicator(application, PATH, headers=headers or [])
    connected, _ = await communicator.connect(timeout=10)
    assert connected
    return communicator


async def test_header_auth_then_one_message_per_token_and_a_done_message(acme) -> None:
    ws = await _connect([(b"authorization", f"Bearer {acme.key}".encode())])
    await ws.send_json_to({"type": "infer", "input": "hello", "max_tokens": 5, "temperature": 0})
    messages = [await ws.receive_json_from(timeout=10) for _ in range(6)]
    assert [m["type"] for m in messages] == ["token"] * 5 + ["done"]
    assert [m["index"] for m in messages[:5]] == list(range(5))
    assert messages[-1]["finish_reason"] == "length"
    assert messages[-1]["version"] == "v1"
    assert messages[-1]["usage"]["completion_tokens"] == 5
    await ws.disconnect(timeout=10)


async def test_first_message_auth(acme) -> None:
    ws = await _connect()
    await ws.send_json_to({"type": "infer", "input": "hello"})
    assert (await ws.receive_json_from(timeout=10))["error"]["type"] == "authentication_error"
    await ws.send_json_to({"type": "auth", "api_key": acme.key})
    await ws.send_json_to({"type": "infer", "input": "hello", "max_tokens": 2})
    messages = [await ws.receive_json_from(timeout=10) for _ in range(3)]
    assert messages[-1]["type"] == "done"
    await ws.disconnect(timeout=10)


async def test_a_key_revoked_while_its_socket_is_open_closes_it_at_the_next_request(acme) -> None:
    from asgiref.sync import sync_to_async

    from registry.models import ApiKey
    from serving.gateway.auth import clear_auth_cache

    ws = await _connect([(b"authorization", f"Bearer {acme.key}".encode())])
    await ws.send_json_to({"type": "infer", "input": "hello", "max_tokens": 2})
    assert [(await ws.receive_json_from(timeout=10))["type"] for _ in range(3)][-1] == "done"
    await sync_to_async(lambda: ApiKey.objects.update(revoked_at=timezone.now()))()
    clear_auth_cache()  # what the gateway's 5-s cache does by itself
    await ws.send_json_to({"type": "infer", "input": "hello", "max_tokens": 2})
    assert (await ws.receive_json_from(timeout=10))["error"]["type"] == "authentication_error"
    assert (await ws.receive_output(timeout=5))["code"] == 4401  # as a bad key at the handshake


async def test_a_bad_key_gets_an_error_and_the_socket_closes(registered_model) -> None:
    ws = await _connect([(b"authorization", b"Bearer sy-wrong")])
    assert (await ws.receive_json_from(timeout=10))["error"]["type"] == "authentication_error"
    assert (await ws.receive_output(timeout=10))["code"] == 4401


async def test_bad_requests_get_the_json_error_and_the_socket_stays_usable(acme) -> None:
    ws = await _connect([(b"authorization", f"Bearer {acme.key}".encode())])
    await ws.send_json_to({"type": "infer", "input": "hi", "max_tokens": 0})
    assert (await ws.receive_json_from(timeout=10))["error"]["type"] == "invalid_request_error"
    # refused by the replica (a token id past the vocabulary): the error names the version that refused it
    await ws.send_json_to({"type": "infer", "input": "hi", "max_tokens": 1, "logit_bias": {"99999999": 1}})
    refused = await ws.receive_json_from(timeout=10)
    assert refused["error"]["type"] == "invalid_request_error" and refused["version"] == "v1", refused
    await ws.send_json_to({"type": "dance"})
    assert "message type" in (await ws.receive_json_from(timeout=10))["error"]["message"]
    await ws.send_json_to({"type": "infer", "input": "hi", "max_tokens": 1})
    assert [(await ws.receive_json_from(timeout=10))["type"] for _ in range(2)] == ["token", "done"]
    await ws.disconnect(timeout=10)


async def test_a_wrongly_typed_version_pin_is_a_json_error_not_a_crash(acme) -> None:
    ws = await _connect([(b"authorization", f"Bearer {acme.key}".encode())])
    await ws.send_json_to({"type": "infer", "input": "hi", "max_tokens": 1, "version_pin": 5})
    error = await ws.receive_json_from(timeout=10)
    assert error["error"] == {"type": "invalid_request_error", "message": "version_pin must be a string"}
    # A string reaches the gateway's pin check (acme may not pin), and the socket stays usable.
    await ws.send_json_to({"type": "infer", "input": "hi", "max_tokens": 1, "version_pin": "v1"})
    assert "may not pin" in (await ws.receive_json_from(timeout=10))["error"]["message"]
    await ws.send_json_to({"type": "infer", "input": "hi", "max_tokens": 1})
    assert [(await ws.receive_json_from(timeout=10))["type"] for _ in range(2)] == ["token", "done"]
    await ws.disconnect(timeout=10)


async def test_a_blank_version_pin_in_a_message_leaves_the_handshakes_pin_in_force(acme) -> None:
    """ " " names no version, as "" does: the pin the socket was opened with applies (acme may not pin)."""
    ws = await _connect([(b"authorization", f"Bearer {acme.key}".encode()), (b"x-version-pin", b"v1")])
    for blank in ("", " "):
        await ws.send_json_to({"type": "infer", "input": "hi", "max_tokens": 1, "version_pin": blank})
        assert "may not pin" in (await ws.receive_json_from(timeout=10))["error"]["message"], repr(blank)
    await ws.disconnect(timeout=10)


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        ({"text_data": "{not json"}, 1007),
        ({"text_data": "[" * 5000 + "]" * 5000}, 1007),
        ({"bytes_data": b'{"type": "infer"}'}, 1003),
        ({"text_data": '{"type": "auth", "api_key": "\\ud800"}'}, 1007),
    ],
    ids=["text that is not JSON", "JSON nested too deeply", "a binary frame", "a lone surrogate escaped"],
)
async def test_a_frame_that_is_not_a_json_text_message_gets_an_error_and_a_close_code(
    acme, frame: dict[str, object], code: int
) -> None:
    ws = await _connect([(b"authorization", f"Bearer {acme.key}".encode())])
    await ws.send_to(**frame)
    assert (await ws.receive_json_from(timeout=10))["error"]["type"] == "invalid_request_error"
    assert await ws.receive_output(timeout=10) == {"type": "websocket.close", "code": code}


async def test_a_message_over_the_request_size_limit_gets_an_error_and_1009(acme, settings) -> None:
    settings.MAX_REQUEST_BYTES = 1000
    ws = await _connect([(b"authorization", f"Bearer {acme.key}".encode())])
    # 330 characters of three bytes each, in about 360: a count of characters would let it through
    await ws.send_to(text_data=json.dumps({"type": "infer", "input": "\u20ac" * 330}, ensure_ascii=False))
    error = await ws.receive_json_from(timeout=10)
    assert error["error"] == {"type": "request_too_large", "message": "message over 1000 bytes"}
    assert await ws.receive_output(timeout=10) == {"type": "websocket.close", "code": 1009}


async def test_a_handshake_from_another_sites_page_is_refused_and_clients_without_an_origin_are_not(
    acme,
) -> None:
    auth = (b"authorization", f"Bearer {acme.key}".encode())
    foreign = WebsocketCommunicator(application, PATH, headers=[(b"origin", b"http://evil.example"), auth])
    connected, _ = await foreign.connect(timeout=10)
    assert not connected
    for headers in ([(b"origin", b"http://localhost:8000"), auth], [auth]):  # this site's page; a script
        ws = await _connect(headers)
        await ws.send_json_to({"type": "infer", "input": "hi", "max_tokens": 1})
        assert [(await ws.receive_json_from(timeout=10))["type"] for _ in range(2)] == ["token", "done"]
        await ws.disconnect(timeout=10)


async def test_cancel_stops_the_generation_and_frees_the_replica(acme, runtime) -> None:
    ws = await _connect([(b"authorization", f"Bearer {acme.key}".encode())])
    await ws.send_json_to({"type": "infer", "input": "hello", "max_tokens": 2000, "temperature": 0})
    assert (await ws.receive_json_from(timeout=10))["type"] == "token"
    await ws.send_json_to({"type": "cancel"})
    message = await ws.receive_json_from(timeout=10)
    while message["type"] == "token":
        message = await ws.receive_json_from(timeout=10)
    assert message == {
        "type": "done",
        "version": "v1",
        "finish_reason": "abort",
        "usage": {"completion_tokens": message["usage"]["completion_tokens"]},
    }
    assert message["usage"]["completion_tokens"] < 2000
    (replica,) = runtime.replicas.values()
    await replica.wait_idle()
    assert replica.load == 0
    await ws.disconnect(timeout=10)


async def test_cancel_reaches_a_request_still_waiting_to_be_dispatched(acme, monkeypatch) -> None:
    """A dispatch can wait (for a replica to start, to accept); the socket's cancel cuts it short rather
    than being read only once a replica has the request."""
    import asyncio

    from serving.edge import websocket as consumers

    real_dispatch, waiting, cancelled = consumers.dispatch, asyncio.Event(), asyncio.Event()

    async def waits_for_a_replica(**request):  # type: ignore[no-untyped-def]
        waiting.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    monkeypatch.setattr(consumers, "dispatch", waits_for_a_replica)
    ws = await _connect([(b"authorization", f"Bearer {acme.key}".encode())])
    await ws.send_json_to({"type": "infer", "input": "hello", "max_tokens": 2})
    async with asyncio.timeout(10):
        await waiting.wait()
    await ws.send_json_to({"type": "infer", "input": "hello", "max_tokens": 2})
    assert (await ws.receive_json_from(timeout=10))["error"]["type"] == "conflict_error"  # one at a time
    await ws.send_json_to({"type": "cancel"})
    done = await ws.receive_json_from(timeout=10)
    assert (done["type"], done["finish_reason"]) == ("done", "abort") and cancelled.is_set()
    monkeypatch.setattr(consumers, "dispatch", real_dispatch)
    await ws.send_json_to({"type": "infer", "input": "hello", "max_tokens": 2})
    assert [(await ws.receive_json_from(timeout=10))["type"] for _ in range(3)] == ["token", "token", "done"]
    await ws.disconnect(timeout=10)


async def test_a_dispatch_that_fails_unexpectedly_answers_503_and_the_socket_serves_on(
    acme, monkeypatch
) -> None:
    """It fails in the generation's task, where no one else would see it: the client gets the error."""
    from serving.edge import websocket as consumers

    real_dispatch = consumers.dispatch

    async def redis_is_down(**request):  # type: ignore[no-untyped-def]
        raise ConnectionError("Redis is down")

    monkeypatch.setattr(consumers, "dispatch", redis_is_down)
    ws = await _connect([(b"authorization", f"Bearer {acme.key}".encode())])
    await ws.send_json_to({"type": "infer", "input": "hello", "max_tokens": 2})
    error = await ws.receive_json_from(timeout=10)
    assert (error["type"], error["error"]["type"]) == ("error", "service_unavailable")
    monkeypatch.setattr(consumers, "dispatch", real_dispatch)
    await ws.send_json_to({"type": "infer", "input": "hello", "max_tokens": 2})
    assert [(await ws.receive_json_from(timeout=10))["type"] for _ in range(3)] == ["token", "token", "done"]
    await ws.disconnect(timeout=10)


async def test_a_refusal_says_when_to_retry_as_the_http_retry_after_does(
    make_tenant, runtime, monkeypatch
) -> None:
    """A 429 or a 503 over HTTP carries Retry-After; over a WebSocket the error message carries
    `retry_after`, the same whole seconds (rounded up, at least 1). An error with no wait has none."""
    from asgiref.sync import sync_to_async

    from serving.edge import websocket as consumers
    from serving.gateway.errors import GatewayError

    slow = await sync_to_async(make_tenant)("slow", requests_per_second=0.01)  # one request per 100 s
    ws = await _connect([(b"authorization", f"Bearer {slow.key}".encode())])
    await ws.send_json_to({"type": "infer", "input": "hi", "max_tokens": 1})
    assert [(await ws.receive_json_from(timeout=10))["type"] for _ in range(2)] == ["token", "done"]
    await ws.send_json_to({"type": "infer", "input": "hi", "max_tokens": 1})
    refused = await ws.receive_json_from(timeout=10)
    assert (refused["type"], refused["error"]["type"]) == ("error", "rate_limit_error")
    assert isinstance(refused["retry_after"], int) and 95 <= refused["retry_after"] <= 100

    real_dispatch = consumers.dispatch
    for wait, expected, expected_ms in [(2.2, 3, 2200), (0.3, 1, 300)]:

        async def unavailable(wait: float = wait, **request):  # type: ignore[no-untyped-def]
            raise GatewayError(503, "no ready replica", retry_after_s=wait)

        monkeypatch.setattr(consumers, "dispatch", unavailable)
        await ws.send_json_to({"type": "infer", "input": "hi", "max_tokens": 1})
        error = await ws.receive_json_from(timeout=10)
        assert error["error"]["type"] == "service_unavailable" and error["retry_after"] == expected
        assert error["retry_after_ms"] == expected_ms
        assert GatewayError(503, "", retry_after_s=wait).headers == {
            "Retry-After": str(expected),
            "retry-after-ms": str(expected_ms),
        }
    monkeypatch.setattr(consumers, "dispatch", real_dispatch)
    await ws.send_json_to({"type": "infer", "input": "hi", "max_tokens": 0})
    assert "retry_after" not in await ws.receive_json_from(timeout=10)  # a 400: retrying will not help
    await ws.disconnect(timeout=10)


async def test_the_next_infer_sent_as_soon_as_done_arrives_is_served_not_refused(acme, monkeypatch) -> None:
    """The done message goes out before its request is closed (its quota given back: a Redis round trip
    in production, slowed here): a client that answers it at once is served, not told a generation is
    still running."""
    import asyncio

    from serving.gateway.quota_store import quota_store

    store = quota_store()
    release = store.arelease

    async def slow_release(ticket, *, used_tokens):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.2)
        await release(ticket, used_tokens=used_tokens)

    monkeypatch.setattr(store, "arelease", slow_release)
    ws = await _connect([(b"authorization", f"Bearer {acme.key}".encode())])
    for _ in range(2):
        await ws.send_json_to({"type": "infer", "input": "hello", "max_tokens": 2})
        messages = [await ws.receive_json_from(timeout=10) for _ in range(3)]
        assert [m["type"] for m in messages] == ["token", "token", "done"], messages
    await ws.disconnect(timeout=10)


async def test_a_stream_that_fails_unexpectedly_ends_with_an_error_message(acme, monkeypatch) -> None:
    """Something other than a gateway error escapes the stream (a bug): the client is told, rather
    than left waiting on an open socket for a message that never comes."""
    from serving.gateway.in_flight import InFlightRequest

    async def broken_events(self):  # type: ignore[no-untyped-def]
        yield {"token": "Once", "index": 0}
        raise RuntimeError("a bug")

    monkeypatch.setattr(InFlightRequest, "events", broken_events)
    ws = await _connect([(b"authorization", f"Bearer {acme.key}".encode())])
    await ws.send_json_to({"type": "infer", "input": "hello", "max_tokens": 2})
    assert (await ws.receive_json_from(timeout=10))["type"] == "token"
    final = await ws.receive_json_from(timeout=10)
    assert (final["type"], final["finish_reason"], final["error"]["type"]) == (
        "error",
        "error",
        "internal_error",
    )
    await ws.disconnect(timeout=10)


async def test_a_key_that_cannot_be_checked_now_closes_with_try_again_later_not_unauthenticated(
    registered_model, monkeypatch
) -> None:
    """The database down and the key not seen lately: a 503 with its wait, and close code 1013, which
    tells a client to come back; 4401 would tell it its key is bad."""
    from serving.edge import websocket as consumers
    from serving.gateway.errors import GatewayError

    async def database_down(authorization: str, **_: object):  # type: ignore[no-untyped-def]
        raise GatewayError(503, "the API key could not be checked right now", retry_after_s=2)

    monkeypatch.setattr(consumers, "authenticate", database_down)
    ws = await _connect([(b"authorization", b"Bearer sy-whatever")])
    error = await ws.receive_json_from(timeout=10)
    assert error["error"]["type"] == "service_unavailable" and error["retry_after"] == 2
    assert (await ws.receive_output(timeout=10))["code"] == consumers.CLOSE_TRY_AGAIN_LATER


async def test_a_consumer_that_fails_mid_generation_does_not_leave_it_running(
    acme, runtime, monkeypatch
) -> None:
    """A handler that raises (as a send does to a socket the client has just dropped) ends the consumer
    before disconnect() could run: its generation is cancelled all the same, freeing its blocks, rather
    than run to max_tokens for nobody."""
    from serving.edge import websocket as consumers

    async def broken(self, content, **kwargs) -> None:  # type: ignore[no-untyped-def]
        raise RuntimeError("Unexpected ASGI message 'websocket.send', after sending 'websocket.close'")

    (replica,) = runtime.replicas.values()
    steps_before = replica.engine.stats().num_steps
    ws = await _connect([(b"authorization", f"Bearer {acme.key}".encode())])
    await ws.send_json_to({"type": "infer", "input": "hello", "max_tokens": 2000, "temperature": 0})
    assert (await ws.receive_json_from(timeout=10))["type"] == "token"
    monkeypatch.setattr(consumers.InferenceStreamConsumer, "receive_json", broken)
    await ws.send_json_to({"type": "infer", "input": "again"})
    with pytest.raises(RuntimeError):
        await ws.wait(timeout=10)
    await replica.wait_idle()
    assert replica.load == 0
    assert replica.engine.stats().num_steps - steps_before < 2000  # aborted, not run out
