"""The connection cap with streams in flight (docs/reliability.md, "The edge"): a server that holds
SWITCHYARD_EDGE_MAX_CONNECTIONS connections, each running a stream, answers the next request with the 503
and `Retry-After: 1` that serving/edge/http_limits.py documents, leaves the streams it holds untouched,
and serves again once they have ended. tests/e2e/test_edge_limits.py holds idle sockets against the cap;
these are requests a client is being served on, SSE and WebSocket, the cap's other half (`self.tasks`)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import websockets.sync.client as ws_client

from tests.e2e.conftest import LiveServer, embedded_env, seeded, serving

pytestmark = pytest.mark.live_server_process

MAX_CONNECTIONS = 4
NUM_SSE = MAX_CONNECTIONS - 1  # and one WebSocket: an upgraded connection counts as well
STREAM_TOKENS = 200
INFER = "/v1/models/demo-chat/infer"


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    state = tmp_path_factory.mktemp("cap")
    env = embedded_env(state, SWITCHYARD_EDGE_MAX_CONNECTIONS=str(MAX_CONNECTIONS))
    with serving(state, env, seeded(env)) as server:
        yield server
        log = Path(state / "server.log").read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]


def _sse_events(lines: Iterator[str], *, until_first: bool) -> list[dict]:
    events = []
    for line in lines:
        if line.startswith("data: "):
            events.append(json.loads(line[6:]))
            if until_first:
                break
    return events


def test_streams_at_the_cap_get_the_next_request_a_503_and_then_it_is_served(capped: LiveServer) -> None:
    key = capped.tenant_key("capped", max_concurrent=MAX_CONNECTIONS + 2)
    auth = {"Authorization": f"Bearer {key}"}
    body = {"input": "hello", "max_tokens": STREAM_TOKENS, "stream": True}
    with ExitStack() as held:
        # The cap's worth of streams, each on its own connection and each past its first token.
        streams = []
        for _ in range(NUM_SSE):
            client = held.enter_context(httpx.Client(base_url=capped.url, headers=auth, timeout=60))
            response = held.enter_context(client.stream("POST", INFER, json=body))
            assert response.status_code == 200
            lines = response.iter_lines()
            streams.append((lines, _sse_events(lines, until_first=True)))
        ws_url = capped.url.replace("http://", "ws://") + "/v1/models/demo-chat/stream"
        ws = held.enter_context(ws_client.connect(ws_url, additional_headers=auth, open_timeout=10))
        ws.send(json.dumps({"type": "infer", "input": "hello", "max_tokens": STREAM_TOKENS}))
        ws_messages = [json.loads(ws.recv(timeout=30))]
        assert ws_messages[0]["type"] == "token", ws_messages

        # One more: refused before it reaches the app, with the documented error and Retry-After.
        refused = httpx.post(f"{capped.url}{INFER}", json={"input": "hello", "max_tokens": 2}, headers=auth)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["type"] == "service_unavailable"
        assert refused.headers["Retry-After"] == "1"

        # The held streams were not disturbed: each gets every token and ends normally.
        for lines, events in streams:
            events += _sse_events(lines, until_first=False)
            assert [e["index"] for e in events if "token" in e] == list(range(STREAM_TOKENS))
            assert events[-1]["finish_reason"] == "length"
        while ws_messages[-1]["type"] == "token":
            ws_messages.append(json.loads(ws.recv(timeout=30)))
        assert [m["type"] for m in ws_messages] == ["token"] * STREAM_TOKENS + ["done"]
    closed_at = time.monotonic()

    # Their connections closed, the server serves again. The closes reach its event loop as the new
    # connection does, in either order: a client that honours the one Retry-After is served.
    served = httpx.post(f"{capped.url}{INFER}", json={"input": "hello", "max_tokens": 2}, headers=auth)
    if served.status_code == 503:
        time.sleep(int(served.headers["Retry-After"]))
        served = httpx.post(f"{capped.url}{INFER}", json={"input": "hello", "max_tokens": 2}, headers=auth)
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["completion_tokens"] == 2
    assert time.monotonic() - closed_at < 1 + 5
