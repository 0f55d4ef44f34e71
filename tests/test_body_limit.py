"""Request bodies over MAX_REQUEST_BYTES are refused before anything reads them (config/body_limit.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from config.body_limit import body_limited


async def _run(app: Any, headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> list[dict[str, Any]]:
    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await body_limited(app, 10)({"type": "http", "headers": headers}, receive, send)
    return sent


def _status_and_error(sent: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    return sent[0]["status"], json.loads(sent[1]["body"])["error"]


async def test_a_declared_length_over_the_limit_is_a_413_before_the_app_runs() -> None:
    called = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        called.append(scope)

    sent = await _run(app, [(b"content-length", b"11")], [b"x" * 11])
    assert not called
    status, error = _status_and_error(sent)
    assert status == 413 and error["type"] == "request_too_large" and "10 bytes" in error["message"]
    assert _status_and_error(await _run(app, [(b"content-length", b"-1")], [b""]))[0] == 413
    assert not called


async def test_a_chunked_body_is_cut_off_once_it_passes_the_limit() -> None:
    """No Content-Length: the app reads a disconnect where the limit is passed, and what it would send
    after the 413 goes nowhere."""
    read: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            read.append(message)
            if message["type"] == "http.disconnect" or not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    sent = await _run(app, [], [b"x" * 6, b"x" * 6, b"x" * 6])
    assert [m["type"] for m in read] == ["http.request", "http.disconnect"]
    assert len(sent) == 2 and _status_and_error(sent)[0] == 413

    read.clear()
    sent = await _run(app, [(b"content-length", b"10")], [b"x" * 5, b"x" * 5])  # at the limit: served
    assert sent[0]["status"] == 200 and len(read) == 2


@pytest.mark.django_db
async def test_the_application_refuses_a_big_body_without_a_key() -> None:
    from django.conf import settings

    from tests.serving.conftest import asgi_client

    big = b"{" + b" " * settings.MAX_REQUEST_BYTES + b"}"
    async with asgi_client() as client:
        for path in ("/v1/completions", "/v1/deployments", "/admin/login/"):
            response = await client.post(path, content=big, headers={"content-type": "application/json"})
            assert response.status_code == 413, path
            assert response.json()["error"]["type"] == "request_too_large"
