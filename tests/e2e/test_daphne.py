"""daphne serves the whole platform (docs/architecture.md, "One start path for uvicorn and daphne"): a
plain `daphne config.asgi:application` loads the embedded replicas and ticks the periodic loops before
any request, streams SSE, WebSocket and the `openai` client, and on SIGTERM stops listening, drains the
streams in flight, ends those still open with a final event, and exits; `manage.py serve --server
daphne` is the same server."""

from __future__ import annotations

import json
import signal
import socket
import sqlite3
from pathlib import Path

import httpx
import openai
import pytest
import websockets.sync.client as ws_client

from tests.e2e.conftest import embedded_env, seeded, serving
from tests.e2e.test_shutdown import DRAIN_S, sigterm_drains_two_streams

pytestmark = pytest.mark.live_server_process

DAPHNE = ("-m", "daphne", "config.asgi:application")


def _autoscaler_ticks(state: Path) -> int:
    """How many times the embedded autoscaler has written its target for a version (the most of any)."""
    with sqlite3.connect(state / "switchyard.sqlite3") as db:
        rows = db.execute("SELECT recommendations FROM rollouts_scaletarget").fetchall()
    return max((len(json.loads(recommendations)) for (recommendations,) in rows), default=0)


def test_plain_daphne_serves_streams_ticks_and_drains_on_sigterm(tmp_path: Path) -> None:
    env = embedded_env(
        tmp_path, SWITCHYARD_SHUTDOWN_DRAIN_S=str(DRAIN_S), SWITCHYARD_AUTOSCALER_INTERVAL_S="0.5"
    )
    key = seeded(env)
    with serving(tmp_path, env, key, command=DAPHNE) as server:
        # Ready without a request: the replicas loaded at the start, not on a first request.
        assert server.replicas() and all(r["state"] == "ready" for r in server.replicas())
        # The periodic loops run in this process: the autoscaler's ticks land, a new one each 0.5 s.
        server.wait_until(lambda: _autoscaler_ticks(tmp_path) >= 2, timeout_s=30)

        auth = {"Authorization": f"Bearer {key}"}
        with httpx.stream(
            "POST",
            f"{server.url}/v1/models/demo-chat/infer",
            json={"input": "hello", "max_tokens": 6, "stream": True},
            headers=auth,
            timeout=30,
        ) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
        assert [e["index"] for e in events if "token" in e] == list(range(6))
        assert events[-1]["finish_reason"] == "length"

        ws_url = server.url.replace("http://", "ws://") + "/v1/models/demo-chat/stream"
        with ws_client.connect(ws_url, additional_headers=auth) as ws:
            ws.send(json.dumps({"type": "infer", "input": "hello", "max_tokens": 4}))
            messages = [json.loads(ws.recv(timeout=10)) for _ in range(5)]
        assert [m["type"] for m in messages] == ["token"] * 4 + ["done"]

        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
        stream = client.chat.completions.create(
            model="demo-chat",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5

        # As uvicorn's stop does, but daphne exits 0 once it has.
        sigterm_drains_two_streams(server, key, exit_code=0)


def test_serve_with_daphne_is_the_same_server(tmp_path: Path) -> None:
    env = embedded_env(tmp_path)
    key = seeded(env)
    with serving(tmp_path, env, key, command=("manage.py", "serve", "--server", "daphne")) as server:
        response = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": "demo-chat", "prompt": "hello", "max_tokens": 3},
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=15) == 0  # nothing in flight: it stops at once
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert "(daphne)" in log and "Traceback" not in log


def test_under_daphne_a_reader_that_stops_is_not_cut_off_but_holds_no_kv_past_its_generation(
    tmp_path: Path,
) -> None:
    # uvicorn's send() waits while a client is not reading, so a stream sees a slow reader's backlog and
    # cuts it off (slow_reader). daphne's never waits: it buffers what the client has not read. What
    # holds instead: the generation runs to its end and frees its sequence, and the buffered body (at
    # most max_tokens events) is whole when the client reads again.
    env = embedded_env(tmp_path)
    key = seeded(env)
    with serving(tmp_path, env, key, command=DAPHNE) as server:
        host, port = server.url.removeprefix("http://").split(":")
        body = json.dumps({"input": "once upon a time", "max_tokens": 1500, "stream": True}).encode()
        request = (
            f"POST /v1/models/demo-chat/infer HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode() + body
        with socket.create_connection((host, int(port))) as reader:
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that stops reading
            reader.sendall(request)
            server.wait_until(lambda: any(r["load"] for r in server.replicas()), timeout_s=30)
            # Not read from: the replica still finishes the sequence and holds nothing for it.
            server.wait_until(lambda: not any(r["load"] for r in server.replicas()), timeout_s=120)
            received = b""
            reader.settimeout(30)
            while chunk := reader.recv(65536):
                received += chunk
    events = [json.loads(line[6:]) for line in received.decode().splitlines() if line.startswith("data: ")]
    assert [e["index"] for e in events if "token" in e] == list(range(1500))
    assert events[-1]["finish_reason"] == "length"
