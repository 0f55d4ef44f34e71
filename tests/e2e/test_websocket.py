"""A real WebSocket client against the live server."""

import json

import pytest
import websockets.sync.client as ws_client

pytestmark = pytest.mark.live_server_process


def test_a_real_websocket_client_streams_and_cancels(platform_server) -> None:
    url = platform_server.url.replace("http://", "ws://") + "/v1/models/demo-chat/stream"
    with ws_client.connect(url, additional_headers={"Authorization": f"Bearer {platform_server.key}"}) as ws:
        ws.send(json.dumps({"type": "infer", "input": "hello", "max_tokens": 4, "temperature": 0}))
        messages = [json.loads(ws.recv(timeout=10)) for _ in range(5)]
        assert [m["type"] for m in messages] == ["token"] * 4 + ["done"]

        ws.send(json.dumps({"type": "infer", "input": "hello", "max_tokens": 1500}))
        first = json.loads(ws.recv(timeout=10))
        assert first["type"] == "token", first
        ws.send(json.dumps({"type": "cancel"}))
        message = json.loads(ws.recv(timeout=10))
        while message["type"] == "token":
            message = json.loads(ws.recv(timeout=10))
        assert message["finish_reason"] == "abort"
