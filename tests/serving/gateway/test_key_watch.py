"""A key revoked while its streams run ends them (serving/gateway/key_watch.py): the SSE stream's last
event is an authentication_error, the WebSocket gets that error and close 4401, within KEY_RECHECK_S and
a query, and the sequences are aborted on the replica (its blocks free)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import AsyncClient

from config.asgi import application
from registry.services import api_key_revoke
from serving.gateway import key_watch as key_watch_module

pytestmark = pytest.mark.django_db(transaction=True)

RECHECK_S = 0.2


@pytest.fixture(autouse=True)
def _quick_recheck(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(key_watch_module, "KEY_RECHECK_S", RECHECK_S)


async def test_a_revoked_keys_sse_stream_ends_with_an_authentication_error(acme, runtime) -> None:
    response = await AsyncClient().post(
        "/v1/models/demo-chat/infer",
        {"input": "once upon a time", "max_tokens": 1900, "stream": True},
        content_type="application/json",
        headers=acme.auth,
    )
    assert response.status_code == 200
    body = response.streaming_content.__aiter__()
    first = json.loads((await body.__anext__()).decode()[6:])
    assert "token" in first
    revoked_at = time.monotonic()
    await sync_to_async(api_key_revoke)(key=acme.key)
    events = [json.loads(chunk.decode()[6:]) async for chunk in body]
    assert time.monotonic() - revoked_at < 5  # the bound; the recheck here is 0.2 s
    assert events[-1]["finish_reason"] == "error"
    assert events[-1]["error"] == {"type": "authentication_error", "message": "the API key was revoked"}
    (replica,) = runtime.replicas.values()
    await asyncio.wait_for(replica.wait_idle(), timeout=10)  # aborted there, not run to 1900 tokens
    assert replica.engine.stats().kv_cache_usage == 0.0


async def test_a_revoked_keys_websocket_gets_the_error_and_close_4401(acme, runtime) -> None:
    socket = WebsocketCommunicator(
        application,
        "/v1/models/demo-chat/stream",
        headers=[(b"authorization", f"Bearer {acme.key}".encode())],
    )
    connected, _ = await socket.connect(timeout=10)
    assert connected
    await socket.send_json_to({"type": "infer", "input": "once upon a time", "max_tokens": 1900})
    assert (await socket.receive_json_from(timeout=10))["type"] == "token"
    await sync_to_async(api_key_revoke)(key=acme.key)
    message = await socket.receive_json_from(timeout=10)
    while message["type"] == "token":
        message = await socket.receive_json_from(timeout=10)
    assert message["error"]["type"] == "authentication_error"
    assert await socket.receive_output(timeout=10) == {"type": "websocket.close", "code": 4401}
    await socket.disconnect()


async def test_a_database_that_cannot_be_read_revokes_nothing(acme, runtime, monkeypatch) -> None:
    from serving.gateway.key_watch import KeyWatch

    class Stream:
        is_finished = False
        ended = False

        def end_revoked(self) -> None:
            self.ended = True

    def unreadable(hashes):  # type: ignore[no-untyped-def]
        raise ConnectionError("the database is down")

    monkeypatch.setattr(key_watch_module, "live_api_key_hashes", unreadable)
    watch, stream = KeyWatch(), Stream()
    watch.watch(acme.context.api_key_hash or "hash", stream)
    assert await watch.recheck() == 0 and not stream.ended
