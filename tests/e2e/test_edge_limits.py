"""The edge's limits against a real server (docs/reliability.md, "The edge"): answers a client gets at the
HTTP and WebSocket edge before any model work, each the documented JSON error or close code, with no
traceback in the server's log. A platform of its own, with short deadlines and a low failure limit, so
that neither these waits nor the throttled address reach the other tests' server."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets.sync.client as ws_client
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.e2e.conftest import LiveServer, embedded_env, seeded, serving

pytestmark = pytest.mark.live_server_process

HEADER_TIMEOUT_S = 1.0
WS_AUTH_DEADLINE_S = 1.0
FAILURE_LIMIT = 3
MAX_CONNECTIONS = 8


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    state = tmp_path_factory.mktemp("edge")
    env = embedded_env(
        state,
        SWITCHYARD_EDGE_HEADER_TIMEOUT_S=str(HEADER_TIMEOUT_S),
        SWITCHYARD_WS_AUTH_DEADLINE_S=str(WS_AUTH_DEADLINE_S),
        SWITCHYARD_AUTH_FAILURE_LIMIT=str(FAILURE_LIMIT),
        SWITCHYARD_EDGE_MAX_CONNECTIONS=str(MAX_CONNECTIONS),
    )
    with serving(state, env, seeded(env)) as server:
        yield server
        log = Path(state / "server.log").read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]


def _raw(server: LiveServer, request: bytes, *, timeout_s: float = 10) -> bytes:
    """Send raw bytes and read until the server closes the connection."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        with contextlib.suppress(OSError):  # the server answered, and shut its side, mid-send
            sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return received


def _status_and_body(response: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


def test_too_many_headers_get_431_unread(edge: LiveServer) -> None:
    headers = b"".join(b"X-Filler-%d: x\r\n" % i for i in range(200))
    status, body = _status_and_body(_raw(edge, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n"))
    assert status == 431 and body["error"]["type"] == "request_headers_too_large"  # type: ignore[index]


def test_a_huge_header_gets_431_without_the_server_reading_it_all(edge: LiveServer) -> None:
    huge = b"X-Huge: " + b"a" * (8 * 1024 * 1024) + b"\r\n"
    status, _ = _status_and_body(_raw(edge, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + huge + b"\r\n"))
    assert status == 431
    assert httpx.get(f"{edge.url}/healthz").status_code == 200  # and it serves on


def test_headers_that_never_finish_get_408_within_the_deadline(edge: LiveServer) -> None:
    started = time.monotonic()
    status, body = _status_and_body(_raw(edge, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: "))
    assert status == 408 and body["error"]["type"] == "request_timeout"  # type: ignore[index]
    assert time.monotonic() - started < HEADER_TIMEOUT_S + 2


def test_past_the_connection_cap_requests_and_websockets_get_a_503_until_connections_end(
    edge: LiveServer,
) -> None:
    host, port = edge.url.removeprefix("http://").split(":")
    holders = [socket.create_connection((host, int(port)), timeout=10) for _ in range(MAX_CONNECTIONS)]
    try:
        # The holders send nothing: each is a connection the server holds until its header deadline.
        response = _raw(edge, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        status, body = _status_and_body(response)
        assert status == 503 and body["error"]["type"] == "service_unavailable"  # type: ignore[index]
        assert b"retry-after: 1" in response.lower()
        with pytest.raises(InvalidStatus) as refused:
            ws_client.connect(edge.url.replace("http", "ws") + "/v1/models/demo-chat/stream", open_timeout=10)
        assert refused.value.response.status_code == 503
    finally:
        for holder in holders:
            holder.close()
    # Once they are gone, the server serves again.
    assert httpx.get(f"{edge.url}/healthz").status_code == 200


def test_a_static_path_outside_the_root_is_a_404(edge: LiveServer) -> None:
    response = _raw(edge, b"GET /static/%2e%2e/%2e%2e/config/settings.py HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert response.startswith(b"HTTP/1.1 404")
    assert b"SECRET_KEY" not in response


@pytest.mark.parametrize(
    "path", ["/nope", "/v1/models/demo-chat/stream/extra", "/v1/models/..%2f..%2fetc/stream"]
)
def test_a_websocket_on_an_unknown_path_is_refused_with_a_404(edge: LiveServer, path: str) -> None:
    with pytest.raises(InvalidStatus) as refused:
        ws_client.connect(edge.url.replace("http://", "ws://") + path, open_timeout=10)
    assert refused.value.response.status_code == 404
    assert json.loads(refused.value.response.body)["error"]["type"] == "not_found_error"


def test_a_websocket_that_never_authenticates_is_closed_4401(edge: LiveServer) -> None:
    url = edge.url.replace("http://", "ws://") + "/v1/models/demo-chat/stream"
    started = time.monotonic()
    with ws_client.connect(url, open_timeout=10) as ws:
        error = json.loads(ws.recv(timeout=WS_AUTH_DEADLINE_S + 5))
        assert error["error"]["type"] == "authentication_error"
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=5)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401
    assert time.monotonic() - started < WS_AUTH_DEADLINE_S + 3


def test_failed_keys_are_throttled_and_then_the_right_key_is_refused_too(edge: LiveServer) -> None:
    """Last in this module: from here on its address is throttled for a minute."""
    url = f"{edge.url}/v1/completions"
    body = {"model": "demo-chat", "prompt": "hi", "max_tokens": 1}
    for i in range(FAILURE_LIMIT):
        wrong = httpx.post(url, json=body, headers={"Authorization": f"Bearer sy-wrong{i}"})
        assert wrong.status_code == 401
    refused = httpx.post(url, json=body, headers={"Authorization": f"Bearer {edge.key}"})
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
    assert 0 < int(refused.headers["Retry-After"]) <= 60
