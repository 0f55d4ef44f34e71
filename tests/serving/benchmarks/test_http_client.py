"""bench serve's own HTTP/1.1 client against a scripted server: each response framing it must read,
events split across chunks, and connections reused only when the last response was read to its end."""

from __future__ import annotations

import asyncio

import pytest

from serving.benchmarks.http_client import HttpClient, HttpProtocolError
from tests.serving.benchmarks.scripted_http import CLOSE, SSE_HEAD, ScriptedServer, chunk


async def test_events_split_across_chunks_arrive_whole_in_order_and_the_connection_is_reused() -> None:
    stream = [
        SSE_HEAD,
        chunk(b'data: {"token": "a"}\n\ndata: {"tok'),
        chunk(b'en": "b"}\n'),
        chunk(b'\n: a comment\n\ndata: {"finish_reason": "length"}\n\n'),
        b"0\r\n\r\n",
    ]
    refusal = [b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 9\r\nretry-after: 1\r\n\r\n", b"slow down"]
    async with ScriptedServer([stream, refusal]).running() as server, HttpClient(server.url) as client:
        async with client.post("/v1/infer", {"input": "hi"}, {"Authorization": "Bearer k"}) as response:
            assert response.status == 200
            events = [data async for data, _ in response.sse_data()]
        assert events == [b'{"token": "a"}', b'{"token": "b"}', b'{"finish_reason": "length"}']
        async with client.post("/v1/infer", {"input": "again"}) as response:
            assert (response.status, response.headers["retry-after"]) == (429, "1")
            assert await response.read() == b"slow down"
        assert server.num_connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /v1/infer HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer k\r\n" in first and first.endswith(b'{"input":"hi"}')


async def test_events_in_every_line_ending_and_field_form_arrive_and_one_left_open_is_dropped() -> None:
    stream = [
        SSE_HEAD,
        chunk(b'data: {"i": 1}\r\n\r\n'),  # CRLF line endings
        chunk(b'data:{"i": 2}\r'),  # no space after "data:", a CRLF split across two reads
        chunk(b"\n\r\n"),
        chunk(b': a comment\ndata: {"i":\ndata: 3}\nid: 7\n\n'),  # two data lines, a comment, an id
        chunk(b'data: {"i": 4}\r\rdata: {"i": 5}\r\r'),  # CR line endings
        chunk(b'data: {"i": 6'),  # cut: no blank line before the body ends
        b"0\r\n\r\n",
    ]
    # A body the connection's end delimits, whose last event has one line end and no blank line.
    open_ended = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n", b'data: {"i": 7}\n']
    async with ScriptedServer([stream, open_ended]).running() as server, HttpClient(server.url) as client:
        async with client.post("/", {}) as response:
            events = [data async for data, _ in response.sse_data()]
        assert events == [b'{"i": 1}', b'{"i": 2}', b'{"i":\n3}', b'{"i": 4}', b'{"i": 5}']
        async with client.post("/", {}) as response:
            assert [data async for data, _ in response.sse_data()] == []


async def test_each_event_is_timed_when_its_bytes_were_read_not_when_it_was_consumed() -> None:
    two_events = b'data: {"i": 1}\n\ndata: {"i": 2}\n\n'
    stream = [SSE_HEAD, chunk(two_events), b"0\r\n\r\n"]
    timed = []
    async with (
        ScriptedServer([stream]).running() as server,
        HttpClient(server.url) as client,
        client.post("/", {}) as response,
    ):
        async for data, read_at in response.sse_data():
            timed.append((data, read_at))
            await asyncio.sleep(0.02)  # a slow consumer: the second event waits, already read
    assert [data for data, _ in timed] == [b'{"i": 1}', b'{"i": 2}']
    assert timed[0][1] == timed[1][1]  # one read brought both


async def test_chunk_extensions_and_trailers_are_read_past() -> None:
    event = b'data: {"i": 1}\n\n'
    with_extension = b"%x;name=value\r\n%s\r\n" % (len(event), event)
    stream = [SSE_HEAD, with_extension, b"0\r\nx-trailer: yes\r\n\r\n"]
    ok = [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]
    async with ScriptedServer([stream, ok]).running() as server, HttpClient(server.url) as client:
        async with client.post("/", {}) as response:
            assert [data async for data, _ in response.sse_data()] == [b'{"i": 1}']
        async with client.post("/", {}) as response:  # the trailers did not stay on the connection
            assert await response.read() == b"ok"
    assert server.num_connections == 1


async def test_a_kept_alive_connection_closed_under_a_request_is_retried_once_on_a_new_one() -> None:
    ok = [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]
    async with ScriptedServer([ok, CLOSE, ok]).running() as server, HttpClient(server.url) as client:
        for _ in range(2):
            async with client.post("/", {}) as response:
                assert await response.read() == b"ok"
    assert server.num_connections == 2


async def test_a_new_connection_closed_without_an_answer_is_an_error() -> None:
    async with ScriptedServer([CLOSE]).running() as server, HttpClient(server.url) as client:
        with pytest.raises(asyncio.IncompleteReadError):
            async with client.post("/", {}):
                pass


@pytest.mark.parametrize(
    "bad",
    [
        [SSE_HEAD, b"zz\r\n"],  # not a chunk size
        [SSE_HEAD, b"2\r\nabcd\r\n"],  # a chunk longer than its size
        [b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n"],
    ],
    ids=["chunk-size", "chunk-length", "content-length"],
)
async def test_a_malformed_body_is_a_protocol_error(bad: list[bytes]) -> None:
    async with ScriptedServer([bad]).running() as server, HttpClient(server.url) as client:
        with pytest.raises(HttpProtocolError):
            async with client.post("/", {}) as response:
                await response.read()


@pytest.mark.parametrize(
    "reply",
    [
        [b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"],
        [b"HTTP/1.1 200 OK\r\n\r\n", b"o", b"k"],  # no framing: the body ends with the connection
    ],
    ids=["connection-close", "close-delimited"],
)
async def test_a_connection_the_server_closes_is_not_reused(reply: list[bytes]) -> None:
    async with ScriptedServer([reply, reply]).running() as server, HttpClient(server.url) as client:
        for _ in range(2):
            async with client.post("/", {}) as response:
                assert await response.read() == b"ok"
    assert server.num_connections == 2


async def test_a_stream_left_before_its_end_closes_its_connection() -> None:
    stream = [
        SSE_HEAD,
        chunk(b'data: {"token": "a"}\n\n'),
        chunk(b'data: {"token": "b"}\n\n'),
        b"0\r\n\r\n",
    ]
    ok = [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]
    async with ScriptedServer([stream, ok]).running() as server, HttpClient(server.url) as client:
        async with client.post("/", {}) as response:
            async for _ in response.sse_data():
                break  # the rest of the stream is still unread on that connection
        async with client.post("/", {}) as response:
            assert await response.read() == b"ok"
    assert server.num_connections == 2


async def test_a_response_that_is_not_http_is_an_error() -> None:
    async with (
        ScriptedServer([[b"SSH-2.0-OpenSSH\r\n\r\n"]]).running() as server,
        HttpClient(server.url) as client,
    ):
        with pytest.raises(HttpProtocolError):
            async with client.post("/", {}):
                pass


def test_only_http_urls_are_taken() -> None:
    with pytest.raises(ValueError, match="not an http"):
        HttpClient("ftp://example.com")
