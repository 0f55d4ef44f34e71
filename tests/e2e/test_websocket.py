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


def test_the_real_server_answers_a_message_over_the_size_limit_with_an_error_and_1009(
    platform_server,
) -> None:
    from django.conf import settings
    from websockets.exceptions import ConnectionClosedError

    url = platform_server.url.replace("http://", "ws://") + "/v1/models/demo-chat/stream"
    headers = {"Authorization": f"Bearer {platform_server.key}"}
    over = json.dumps({"type": "infer", "input": "x" * settings.MAX_REQUEST_BYTES})
    with ws_client.connect(url, additional_headers=headers, max_size=None) as ws:
        ws.send(over)
        assert json.loads(ws.recv(timeout=10))["error"]["type"] == "request_too_large"
        with pytest.raises(ConnectionClosedError):
            ws.recv(timeout=10)
        assert ws.protocol.close_rcvd.code == 1009
    # far over: the server closes without buffering it, and so without a message
    with ws_client.connect(url, additional_headers=headers, max_size=None) as ws:
        ws.send("x" * (5 * settings.MAX_REQUEST_BYTES))
        with pytest.raises(ConnectionClosedError):
            ws.recv(timeout=10)
        assert ws.protocol.close_rcvd.code == 1009


def _staff_session_cookie(server) -> str:  # type: ignore[no-untyped-def]
    import re

    import httpx

    created = server.manage(
        "shell",
        "-c",
        "from django.contrib.auth.models import User; "
        "User.objects.create_superuser('ws-admin', 'ws@example.com', 'ws-e2e-password')",
    )
    assert created.returncode == 0, created.stderr
    with httpx.Client(base_url=server.url, timeout=10) as client:
        form = client.get("/admin/login/").text
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form)
        assert token is not None
        client.post(
            "/admin/login/?next=/admin/",
            data={"username": "ws-admin", "password": "ws-e2e-password", "csrfmiddlewaretoken": token[1]},
        )
        return client.cookies["sessionid"]


def test_the_real_server_refuses_a_dashboard_handshake_from_another_site(platform_server) -> None:
    """A staff member's browser on another site must not open the dashboard's feed with their cookie."""
    from websockets.exceptions import InvalidStatus

    url = platform_server.url.replace("http://", "ws://") + "/dashboard/ws/overview/"
    cookie = {"Cookie": f"sessionid={_staff_session_cookie(platform_server)}"}
    with ws_client.connect(url, origin=platform_server.url, additional_headers=cookie, open_timeout=10):
        pass  # the same site's page is let in
    with pytest.raises(InvalidStatus) as refused:
        ws_client.connect(url, origin="http://evil.example", additional_headers=cookie, open_timeout=10)
    assert refused.value.response.status_code == 403


def test_a_browser_without_a_staff_session_gets_the_feeds_final_close_code(platform_server) -> None:
    """Refused before the handshake, the server answered HTTP 403 and a browser saw only 1006, which the
    page retried for ever; 4403 tells it to stop and say why."""
    from websockets.exceptions import ConnectionClosed

    url = platform_server.url.replace("http://", "ws://") + "/dashboard/ws/overview/"
    with (
        ws_client.connect(url, origin=platform_server.url, open_timeout=10) as ws,
        pytest.raises(ConnectionClosed) as closed,
    ):
        ws.recv(timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4403


def test_a_key_put_in_a_websocket_url_is_not_written_to_the_servers_log(platform_server) -> None:
    """No key is read from a query string, but uvicorn logs every handshake's path with its query at
    INFO: a client that tried `?api_key=` had its key written in the clear."""
    from pathlib import Path

    url = (
        platform_server.url.replace("http://", "ws://") + "/v1/models/demo-chat/stream?api_key=sy-leaked-key"
    )
    with ws_client.connect(url, origin=platform_server.url, open_timeout=10):
        pass
    log = (Path(platform_server.env["SWITCHYARD_STATE_DIR"]) / "server.log").read_text(errors="replace")
    assert '"WebSocket /v1/models/demo-chat/stream?…"' in log  # the handshake is still logged
    assert "sy-leaked-key" not in log
