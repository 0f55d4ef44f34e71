"""vLLM's sampling fields at the edge: taken on /infer and the OpenAI endpoints (they were 400s), each bad
value a 400 naming it before anything is queued; and a prompt with max_tokens past the model's context is
a 400 naming both, as vLLM answers it, not an output cut short."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import AsyncClient

pytestmark = pytest.mark.django_db(transaction=True)

FIELDS = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 3, "ignore_eos": True}


async def _post(path: str, body: dict[str, Any], auth: dict[str, str]) -> Any:
    return await AsyncClient().post(path, body, content_type="application/json", headers=auth)


async def test_the_fields_are_served_on_infer_completions_and_chat(acme) -> None:  # type: ignore[no-untyped-def]
    infer = await _post("/v1/models/demo-chat/infer", {"input": "hi", "max_tokens": 4, **FIELDS}, acme.auth)
    assert infer.status_code == 200, infer.content
    assert infer.json()["usage"]["completion_tokens"] == 4  # ignore_eos: to max_tokens
    completion = await _post(
        "/v1/completions", {"model": "demo-chat", "prompt": "hi", "max_tokens": 4, **FIELDS}, acme.auth
    )
    assert completion.status_code == 200, completion.content
    chat = await _post(
        "/v1/chat/completions",
        {"model": "demo-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **FIELDS},
        acme.auth,
    )
    assert chat.status_code == 200, chat.content
    assert chat.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", 1.5),
        ("top_k", -2),
        ("min_p", 2),
        ("repetition_penalty", 0),
        ("min_tokens", -1),
        ("ignore_eos", 1),
    ],
)
async def test_a_bad_value_is_a_400_naming_the_field(acme, runtime, field: str, value: Any) -> None:  # type: ignore[no-untyped-def]
    response = await _post("/v1/models/demo-chat/infer", {"input": "hi", field: value}, acme.auth)
    assert response.status_code == 400 and field in response.json()["error"]["message"]
    assert runtime.replicas[("demo-chat", "v1")].load == 0  # nothing reached the replica


async def test_min_tokens_past_max_tokens_is_a_400(acme) -> None:  # type: ignore[no-untyped-def]
    response = await _post(
        "/v1/models/demo-chat/infer", {"input": "hi", "max_tokens": 2, "min_tokens": 3}, acme.auth
    )
    assert response.status_code == 400 and "min_tokens (3)" in response.json()["error"]["message"]


async def test_a_prompt_with_max_tokens_past_the_context_is_a_400_naming_both(acme) -> None:  # type: ignore[no-untyped-def]
    response = await _post("/v1/models/demo-chat/infer", {"input": "hi there", "max_tokens": 2048}, acme.auth)
    assert response.status_code == 400, response.content
    message = response.json()["error"]["message"]
    assert "context is 2048 tokens" in message and "max_tokens 2048" in message
    fits = await _post("/v1/models/demo-chat/infer", {"input": "hi there", "max_tokens": 8}, acme.auth)
    assert fits.status_code == 200


async def test_min_tokens_holds_a_stop_string_back_through_the_api(acme) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "demo-chat", "prompt": "hi", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    free = await _post("/v1/completions", body, acme.auth)
    stop = free.json()["choices"][0]["text"][:1]  # said by the first token or so, well before the sixth
    assert stop, free.content
    early = await _post("/v1/completions", {**body, "stop": [stop]}, acme.auth)
    assert early.json()["choices"][0]["text"] == ""
    held = await _post("/v1/completions", {**body, "stop": [stop], "min_tokens": 6}, acme.auth)
    assert held.status_code == 200, held.content
    assert held.json()["usage"]["completion_tokens"] >= 6 and held.json()["choices"][0]["text"].startswith(
        stop
    )
