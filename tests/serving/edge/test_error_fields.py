"""OpenAI's `param` and `code` on the inference endpoints' HTTP errors: the field a 400 is about, and the
codes clients branch on (model_not_found, context_length_exceeded, rate_limit_exceeded); null where
nothing more is known."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import AsyncClient

pytestmark = pytest.mark.django_db(transaction=True)


async def _error(path: str, body: dict[str, Any], auth: dict[str, str]) -> dict[str, Any]:
    response = await AsyncClient().post(path, body, content_type="application/json", headers=auth)
    assert response.status_code >= 400
    return dict(response.json()["error"])


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/models/demo-chat/infer", {"input": "hi", "temperature": 9}, "temperature"),
        ("/v1/completions", {"model": "demo-chat", "prompt": "hi", "min_p": -1}, "min_p"),
        ("/v1/chat/completions", {"model": "demo-chat", "messages": [], "max_tokens": 2}, "messages"),
        (
            "/v1/chat/completions",
            {"model": "demo-chat", "messages": [{"role": "user", "content": "hi"}], "response_format": {}},
            "response_format",
        ),
        ("/v1/models/demo-chat/infer", {"input": "hi", "surprise": 1}, None),  # names no one field
    ],
)
async def test_a_400_names_the_field_it_is_about(
    acme, path: str, body: dict[str, Any], param: str | None
) -> None:  # type: ignore[no-untyped-def]
    error = await _error(path, body, acme.auth)
    assert error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, None)


async def test_the_codes_openai_clients_branch_on(acme) -> None:  # type: ignore[no-untyped-def]
    missing = await _error("/v1/completions", {"model": "nope", "prompt": "hi"}, acme.auth)
    assert missing["code"] == "model_not_found"
    too_long = await _error(
        "/v1/completions", {"model": "demo-chat", "prompt": "hi", "max_tokens": 2048}, acme.auth
    )
    assert (too_long["code"], too_long["param"]) == ("context_length_exceeded", None)
