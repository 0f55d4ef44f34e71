"""A client that stops reading its stream. The server's send() then waits (uvicorn's does while the
client's socket is full), events pile up in the gateway, and past settings.STREAM_MAX_BACKLOG_EVENTS the
stream is cut off and its sequence aborted. The ASGI client below stops reading after a few messages, as
such a client looks to the application; daphne's send() never waits, so behind it the backlog would grow
in the server's write buffer, out of the application's sight (why `serve` runs uvicorn)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

pytestmark = pytest.mark.django_db(transaction=True)

READ_BEFORE_STALLING = 2
BACKLOG = 32
MAX_TOKENS = 1500
# Every stream runs to MAX_TOKENS: a stream that met the random demo model's EOS before its client
# stalled would never back up.
LONG = {"max_tokens": MAX_TOKENS, "ignore_eos": True}
STREAM_MESSAGES = ("http.response.body", "websocket.send")


class StalledClient:
    """An ASGI client that sends `incoming`, reads READ_BEFORE_STALLING messages of the stream, then stops
    reading (its send() blocks) until `resume()`; it never disconnects."""

    def __init__(self, incoming: list[dict[str, Any]]) -> None:
        self.incoming = incoming
        self.sent: list[dict[str, Any]] = []
        self.stalled = asyncio.Event()
        self._reading = asyncio.Event()
        self.closed = asyncio.Event()

    def resume(self) -> None:
        self._reading.set()

    async def receive(self) -> dict[str, Any]:
        if self.incoming:
            return self.incoming.pop(0)
        await asyncio.Event().wait()  # nothing more, and no disconnect
        raise AssertionError("unreachable")

    async def send(self, message: dict[str, Any]) -> None:
        read = sum(1 for m in self.sent if m["type"] in STREAM_MESSAGES)
        # A WebSocket cut off before the client stopped reading (the event loop starved on a busy machine
        # while the replica made BACKLOG events) stalls at its error: the cut-off is what is under test.
        cut_off = message["type"] == "websocket.send" and '"slow_reader"' in message.get("text", "")
        if message["type"] in STREAM_MESSAGES and (read >= READ_BEFORE_STALLING or cut_off):
            self.stalled.set()
            await self._reading.wait()
        self.sent.append(message)
        if message["type"] == "websocket.close":
            self.closed.set()


def _scope(kind: str, path: str, key: str) -> dict[str, Any]:
    return {
        "type": kind,
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http" if kind == "http" else "ws",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"localhost"),
            (b"authorization", f"Bearer {key}".encode()),
            (b"content-type", b"application/json"),
        ],
        "subprotocols": [],
        "client": ("127.0.0.1", 40000),
        "server": ("localhost", 80),
    }


async def _replica_is_empty(runtime: Any) -> None:
    (replica,) = runtime.replicas.values()
    await replica.wait_idle()
    stats = replica.engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)


async def _stalled_http_stream(path: str, body: dict[str, Any], key: str) -> list[bytes]:
    """The body chunks a client that stops reading got, once the response ended by itself: without the
    cut-off it would wait on the client for ever. The server then drops the connection unfinished."""
    from config.asgi import application

    client = StalledClient([{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}])
    async with asyncio.timeout(60):
        await application(_scope("http", path, key), client.receive, client.send)
    assert client.stalled.is_set()
    chunks = [m for m in client.sent if m["type"] == "http.response.body"]
    assert all(m.get("more_body") for m in chunks)
    return [m["body"] for m in chunks]


@pytest.fixture(autouse=True)
def _short_backlog(settings):  # type: ignore[no-untyped-def]
    settings.ALLOWED_HOSTS = ["localhost"]
    # Small, but more than a replica of the demo model makes while the reader sends the client its
    # first READ_BEFORE_STALLING messages: at 4, and once at 16, on a busy machine a reader that had not
    # yet stalled was cut off (CI runs of 2026-12-06), which is the race, not the behaviour, under test.
    settings.STREAM_MAX_BACKLOG_EVENTS = BACKLOG


async def test_an_sse_stream_whose_client_stops_reading_is_cut_off_and_its_sequence_aborted(
    acme, runtime
) -> None:
    body = {"input": "hello", **LONG, "stream": True, "temperature": 0}
    chunks = await _stalled_http_stream("/v1/models/demo-chat/infer", body, acme.key)
    assert not any(b"finish_reason" in chunk for chunk in chunks)
    await _replica_is_empty(runtime)


async def test_events_that_pile_up_before_anything_reads_them_are_no_slow_reader(acme, runtime) -> None:
    """Before its response begins (the view returning, an OpenAI `n`'s other choices being dispatched)
    nobody reads a request's events; a replica fast enough to pass the cap meanwhile must not have it
    cut off for a client that has not yet been sent a byte."""
    from tests.serving.gateway.test_dispatch import _hello

    (replica,) = runtime.replicas.values()
    handle = await _hello(acme, max_tokens=3 * BACKLOG)  # 3 times the cap
    try:
        await replica.wait_idle()  # all 12 generated, none read
        events = [event async for event in handle.events()]
    finally:
        await handle.close()
    assert [e["index"] for e in events if "token" in e] == list(range(3 * BACKLOG))
    assert events[-1]["finish_reason"] == "length"


async def test_a_websocket_client_that_stops_reading_is_cut_off_and_told_why_when_it_reads_again(
    acme, runtime
) -> None:
    from config.asgi import application
    from serving.edge.websocket import CLOSE_SLOW_READER

    infer = {"type": "infer", "input": "hello", **LONG, "temperature": 0}
    client = StalledClient(
        [{"type": "websocket.connect"}, {"type": "websocket.receive", "text": json.dumps(infer)}]
    )
    scope = _scope("websocket", "/v1/models/demo-chat/stream", acme.key)
    connection = asyncio.create_task(application(scope, client.receive, client.send))
    try:
        async with asyncio.timeout(60):
            await client.stalled.wait()
            await _replica_is_empty(runtime)  # aborted while the client still reads nothing
            client.resume()
            await client.closed.wait()
    finally:
        connection.cancel()
    messages = [json.loads(m["text"]) for m in client.sent if m["type"] == "websocket.send"]
    assert [m["type"] for m in messages[:-1]] == ["token"] * (len(messages) - 1)
    assert len(messages) - 1 < MAX_TOKENS
    assert messages[-1] == {
        "type": "error",
        "finish_reason": "error",
        "version": "v1",
        "error": {"type": "slow_reader", "message": "the client fell too far behind the stream"},
    }
    assert client.sent[-1] == {"type": "websocket.close", "code": CLOSE_SLOW_READER}


async def test_an_openai_stream_of_several_choices_whose_client_stops_reading_is_cut_off_too(
    acme, runtime
) -> None:
    """n = 3: the gateway reads each choice's next event only once its last went out, so all three back
    up behind the stalled client; the cut-off then ends the response, as for one choice, and aborts all
    three sequences on the replica."""
    (replica,) = runtime.replicas.values()
    aborted_before = replica.metrics.snapshot().totals.counters.get("aborted", 0)
    body = {"model": "demo-chat", "prompt": "hello", **LONG, "stream": True, "n": 3}
    chunks = await _stalled_http_stream("/v1/completions", body, acme.key)
    assert not any(b'finish_reason":"length' in chunk or b"[DONE]" in chunk for chunk in chunks)
    await _replica_is_empty(runtime)
    assert replica.metrics.snapshot().totals.counters.get("aborted", 0) - aborted_before == 3


class LeavingAtResponseStart:
    """An ASGI client that sends its request, then goes away while the response's start is being sent
    to it: the view has returned its stream, whose body never starts."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.incoming = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
        self.response_starting = asyncio.Event()
        self.status = 0

    async def receive(self) -> dict[str, Any]:
        if self.incoming:
            return self.incoming.pop(0)
        await self.response_starting.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        assert message["type"] == "http.response.start", message
        self.status = message["status"]
        self.response_starting.set()
        await asyncio.Event().wait()  # the socket is gone: this send never completes


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/models/demo-chat/infer", {"input": "hello"}),
        ("/v1/completions", {"model": "demo-chat", "prompt": "hello", "n": 2}),
    ],
)
async def test_a_client_gone_before_the_first_chunk_gives_its_quota_back(
    make_tenant, runtime, settings, path, body
) -> None:
    """Its stream's body never starts, so nothing in it closes the requests: the handler does. A short
    one (fewer events than the slow-reader cap) would otherwise hold its concurrency slots for ever."""
    from asgiref.sync import sync_to_async

    from config.asgi import application

    settings.ALLOWED_HOSTS = ["localhost"]
    one_at_a_time = await sync_to_async(make_tenant)("single", max_concurrent_requests=body.get("n", 1))
    client = LeavingAtResponseStart({**body, "max_tokens": 2, "stream": True})
    async with asyncio.timeout(60):
        await application(_scope("http", path, one_at_a_time.key), client.receive, client.send)
    await _replica_is_empty(runtime)
    again = LeavingAtResponseStart({**body, "max_tokens": 2, "stream": True})
    async with asyncio.timeout(60):  # admitted, so its response starts (and it leaves as well)
        await application(_scope("http", path, one_at_a_time.key), again.receive, again.send)
    assert again.status == 200


class StalledClientThatCancels(StalledClient):
    """A StalledClient that also sends a cancel once told to (its reader stopped, its writer not)."""

    def __init__(self, incoming: list[dict[str, Any]]) -> None:
        super().__init__(incoming)
        self.send_cancel = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        if self.incoming:
            return self.incoming.pop(0)
        await self.send_cancel.wait()
        self.send_cancel = asyncio.Event()  # one cancel
        return {"type": "websocket.receive", "text": json.dumps({"type": "cancel"})}


async def test_a_cancel_after_a_slow_reader_cut_off_still_gets_the_cut_offs_message_and_close(
    acme, runtime, monkeypatch
) -> None:
    """The cut-off has cancelled the generation, which waits to send its last message: a cancel then
    must not cancel it again, or the client gets no final message and the socket never closes."""
    from config.asgi import application
    from serving.edge.websocket import CLOSE_SLOW_READER, InferenceStreamConsumer

    cancelling = asyncio.Event()
    cancel = InferenceStreamConsumer._cancel

    async def watched_cancel(self: InferenceStreamConsumer) -> None:
        cancelling.set()  # nothing yields between this and the cancel's own decision
        await cancel(self)

    monkeypatch.setattr(InferenceStreamConsumer, "_cancel", watched_cancel)
    infer = {"type": "infer", "input": "hello", **LONG, "temperature": 0}
    client = StalledClientThatCancels(
        [{"type": "websocket.connect"}, {"type": "websocket.receive", "text": json.dumps(infer)}]
    )
    scope = _scope("websocket", "/v1/models/demo-chat/stream", acme.key)
    connection = asyncio.create_task(application(scope, client.receive, client.send))
    try:
        async with asyncio.timeout(30):
            await client.stalled.wait()
            await _replica_is_empty(runtime)  # cut off and aborted
            client.send_cancel.set()
            await cancelling.wait()
            client.resume()
            await client.closed.wait()
    finally:
        connection.cancel()
    messages = [json.loads(m["text"]) for m in client.sent if m["type"] == "websocket.send"]
    assert messages[-1]["error"]["type"] == "slow_reader"
    assert client.sent[-1] == {"type": "websocket.close", "code": CLOSE_SLOW_READER}
