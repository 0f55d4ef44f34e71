"""POST /v1/chat/completions as OpenAI's clients send it today: no max_tokens, content as a list of text
parts, the "developer" role."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from tests.serving.conftest import asgi_client

pytestmark = pytest.mark.django_db(transaction=True)


async def _chat(client: Any, auth: dict[str, str], messages: list[dict[str, Any]], **fields: Any) -> Any:
    body = {"model": "demo-chat", "messages": messages, "temperature": 0, **fields}
    return await client.post("/v1/chat/completions", json=body, headers=auth)


async def test_without_max_tokens_a_chat_runs_to_the_end_of_the_answer_not_to_16_tokens(
    runtime: Any, make_tenant: Any, settings: Any
) -> None:
    settings.ALLOWED_HOSTS = ["localhost"]
    settings.MAX_TOKENS_LIMIT = 40  # the ceiling of "to the end of the context", kept short for the test
    acme = await sync_to_async(make_tenant)("acme")
    # a budget under the ceiling: admission charges what the budget allows, not a refusal every time
    frugal = await sync_to_async(make_tenant)("frugal", tokens_per_minute=30)
    async with asgi_client() as client:
        response = await _chat(client, acme.auth, [{"role": "user", "content": "hello"}])
        within_budget = await _chat(client, frugal.auth, [{"role": "user", "content": "hello"}])
    assert response.status_code == 200, response.text
    body = response.json()
    # The random demo model never ends its answer: it stops at the ceiling, where 16 was the old default.
    assert body["usage"]["completion_tokens"] == 40 and body["choices"][0]["finish_reason"] == "length"
    assert within_budget.status_code == 200, within_budget.text


async def test_without_max_tokens_a_chat_runs_as_far_as_a_small_kv_cache_holds_not_refused(
    registered_model: Any, make_tenant: Any, settings: Any
) -> None:
    """A KV pool smaller than the context (a big model on a small device) used to refuse every chat
    that named no length: "needs up to N KV blocks"."""
    from serving.runtime import get_runtime

    settings.ALLOWED_HOSTS = ["localhost"]
    settings.MAX_TOKENS_LIMIT = 4096
    settings.REPLICA_KV_CACHE_BYTES = 256 * 1024
    runtime = await get_runtime()
    assert await runtime.wait_ready()
    (replica,) = runtime.replicas.values()
    engine = replica.engine
    assert engine.scheduler.max_blocks_per_sequence() * 16 < engine.max_model_len  # smaller than the context
    acme = await sync_to_async(make_tenant)("acme", tokens_per_minute=10**6)
    async with asgi_client() as client:
        response = await _chat(client, acme.auth, [{"role": "user", "content": "hello"}])
    assert response.status_code == 200, response.text
    body = response.json()
    usage = body["usage"]
    assert usage["completion_tokens"] == engine.max_output_tokens(usage["prompt_tokens"])
    assert body["choices"][0]["finish_reason"] == "length"


async def test_text_parts_and_the_developer_role_read_as_a_string_and_the_system_role(
    runtime: Any, make_tenant: Any, settings: Any
) -> None:
    settings.ALLOWED_HOSTS = ["localhost"]
    acme = await sync_to_async(make_tenant)("acme")
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    parts = [
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]},
    ]
    image = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]},
    ]
    async with asgi_client() as client:
        expected = await _chat(client, acme.auth, plain, max_tokens=8)
        got = await _chat(client, acme.auth, parts, max_tokens=8)
        refused = await _chat(client, acme.auth, image, max_tokens=8)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["message"] == expected.json()["choices"][0]["message"]
    usage, expected_usage = got.json()["usage"], expected.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        expected_usage["prompt_tokens"],
        expected_usage["completion_tokens"],
    )
    # the same prompt, token for token: the second request found all of it in the prefix cache
    assert expected_usage["cached_prompt_tokens"] == 0 and usage["cached_prompt_tokens"] > 0
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == (
        "messages[0].content[0] is not a text part: only text content is supported"
    )


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"messages": [{"role": ["user"], "content": "hi"}]}, "needs a role of"),
        ({"messages": [{"role": {"name": "user"}, "content": "hi"}]}, "needs a role of"),
        ({"stream_options": {"include_usage": True}}, "only allowed when stream is true"),
        ({"stream": True, "stream_options": "usage"}, "stream_options must be an object"),
        # "false" is no boolean: it used to turn usage on
        (
            {"stream": True, "stream_options": {"include_usage": "false"}},
            "stream_options.include_usage must be true or false",
        ),
        (
            {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
            "unsupported stream_options field(s): continuous_usage_stats",
        ),
        # true == 1 in Python: each is checked before they are compared
        ({"max_tokens": True, "max_completion_tokens": 1}, "max_tokens must be an integer"),
        ({"max_tokens": 1, "max_completion_tokens": True}, "max_completion_tokens must be an integer"),
        ({"max_completion_tokens": "8"}, "max_completion_tokens must be an integer"),
    ],
)
async def test_bad_chat_bodies_get_the_json_error(
    runtime: Any, make_tenant: Any, settings: Any, fields: dict[str, Any], fragment: str
) -> None:
    settings.ALLOWED_HOSTS = ["localhost"]
    acme = await sync_to_async(make_tenant)("acme")
    async with asgi_client() as client:
        messages = fields.pop("messages", [{"role": "user", "content": "hi"}])
        response = await _chat(client, acme.auth, messages, **fields)
    assert response.status_code == 400, response.text
    assert fragment in response.json()["error"]["message"]


async def test_openai_parameters_as_its_clients_send_them(
    runtime: Any, make_tenant: Any, settings: Any
) -> None:
    settings.ALLOWED_HOSTS = ["localhost"]
    acme = await sync_to_async(make_tenant)("acme")
    hello = [{"role": "user", "content": "hello"}]
    async with asgi_client() as client:
        nulls = await _chat(client, acme.auth, hello, max_tokens=3, temperature=None, top_p=None, stream=None)
        newer_name = await _chat(client, acme.auth, hello, max_tokens=3, max_completion_tokens=None)
        both = await _chat(client, acme.auth, hello, max_tokens=3, max_completion_tokens=5)
        text_format = await _chat(client, acme.auth, hello, max_tokens=2, response_format={"type": "text"})
        json_mode = await _chat(
            client, acme.auth, hello, max_tokens=2, response_format={"type": "json_object"}
        )
        negative = [
            await _chat(client, acme.auth, hello, max_tokens=6, temperature=1.0, seed=seed)
            for seed in (-1, -1, 2**63 - 1, 2**63)
        ]
    assert nulls.status_code == 200, nulls.text
    assert nulls.json()["usage"]["completion_tokens"] == 3
    # A null max_completion_tokens is absent: max_tokens stands (it ran to the context's end before).
    assert newer_name.status_code == 200 and newer_name.json()["usage"]["completion_tokens"] == 3
    assert both.status_code == 400 and "max_completion_tokens" in both.json()["error"]["message"]
    assert text_format.status_code == 200
    # JSON mode is constrained decoding now (tests/serving/edge/test_structured_outputs.py): two tokens of
    # an object, cut short by max_tokens.
    assert json_mode.status_code == 200, json_mode.text
    assert json_mode.json()["choices"][0]["message"]["content"].startswith("{")
    assert [r.status_code for r in negative] == [200, 200, 200, 400]
    texts = [r.json()["choices"][0]["message"]["content"] for r in negative[:3]]
    assert texts[0] == texts[1] == texts[2]  # -1 is 2**63 - 1 modulo 2**63: one seed, reproduced
    usage = nulls.json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": usage["cached_prompt_tokens"]}


async def test_unsupported_fields_sent_as_null_read_as_absent(
    runtime: Any, make_tenant: Any, settings: Any
) -> None:
    """docs/api.md: a parameter sent as null reads as absent, those we do not implement included; any
    other value of one is refused, as before."""
    settings.ALLOWED_HOSTS = ["localhost"]
    acme = await sync_to_async(make_tenant)("acme")
    hello = [{"role": "user", "content": "hello"}]
    completion = {"model": "demo-chat", "prompt": "hello", "max_tokens": 2}
    async with asgi_client() as client:
        chat_nulls = await _chat(client, acme.auth, hello, max_tokens=2, tools=None, tool_choice=None)
        completion_nulls = await client.post(
            "/v1/completions", json={**completion, "suffix": None, "best_of": None}, headers=acme.auth
        )
        chat_tools = await _chat(client, acme.auth, hello, max_tokens=2, functions=[], tool_choice=None)
        completion_suffix = await client.post(
            "/v1/completions", json={**completion, "suffix": "", "best_of": None}, headers=acme.auth
        )
    assert chat_nulls.status_code == 200, chat_nulls.text
    assert chat_nulls.json()["usage"]["completion_tokens"] == 2
    assert completion_nulls.status_code == 200, completion_nulls.text
    assert completion_nulls.json()["usage"]["completion_tokens"] == 2
    assert chat_tools.status_code == 400
    assert chat_tools.json()["error"] == {
        "type": "invalid_request_error",
        "message": "unsupported field(s): functions",
        "param": None,
        "code": None,
    }
    assert completion_suffix.status_code == 400
    assert completion_suffix.json()["error"]["message"] == "unsupported field(s): suffix"


# As Mistral's template and others: two messages of one role in a row are refused with raise_exception.
ALTERNATING_TEMPLATE = (
    "{% for m in messages %}"
    "{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture
def alternating_model_dir(demo_model_dir: Path, tmp_path: Path) -> Path:
    """The demo model with a chat template that refuses two user messages in a row."""
    out = tmp_path / "alternating-model"
    shutil.copytree(demo_model_dir, out)
    (out / "chat_template.jinja").write_text(ALTERNATING_TEMPLATE)
    return out


async def test_a_conversation_the_chat_template_refuses_is_a_400_with_its_message(
    db: None, alternating_model_dir: Path, make_tenant: Any, settings: Any
) -> None:
    """It was the replica's failure: "could not admit it", a 503 to retry (an error stream when
    streamed), counted against the version."""
    from registry.services import model_version_register
    from serving.runtime import get_runtime

    settings.ALLOWED_HOSTS = ["localhost"]
    await sync_to_async(model_version_register)(
        name="demo-chat", version="v1", source_dir=alternating_model_dir, created_by="test"
    )
    runtime = await get_runtime()
    assert await runtime.wait_ready()
    acme = await sync_to_async(make_tenant)("acme")
    alternating = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    twice = [{"role": "user", "content": "hello"}, {"role": "user", "content": "are you there?"}]
    async with asgi_client() as client:
        served = await _chat(client, acme.auth, alternating, max_tokens=2)
        refused = await _chat(client, acme.auth, twice, max_tokens=2)
        refused_stream = await _chat(client, acme.auth, twice, max_tokens=2, stream=True)
    assert served.status_code == 200, served.text
    expected = {
        "type": "invalid_request_error",
        "message": "Conversation roles must alternate user/assistant/user/assistant/...",
        "param": None,
        "code": None,
    }
    for response in (refused, refused_stream):
        assert response.status_code == 400, response.text
        assert response.json()["error"] == expected
        assert "Retry-After" not in response.headers


async def test_a_chat_template_that_is_broken_is_the_versions_failure_not_the_clients(
    db: None, demo_model_dir: Path, tmp_path: Path, make_tenant: Any, settings: Any, monkeypatch: Any
) -> None:
    """Only the template's own refusal (raise_exception) is the request's fault. A template that does not
    compile fails every chat, whatever it holds: a 503, counted against the version, so that a rollout's
    judge sees a canary registered with it fail rather than its clients err. Registration now refuses such
    a template (registry/chat_template.py); one registered before it did is served as here."""
    from registry import services
    from registry.services import model_version_register
    from serving.runtime import get_runtime

    monkeypatch.setattr(services, "check_chat_template", lambda model_dir: None)  # an older registration

    settings.ALLOWED_HOSTS = ["localhost"]
    broken = tmp_path / "broken-template-model"
    shutil.copytree(demo_model_dir, broken)
    (broken / "chat_template.jinja").write_text("{{ messages[0]['content'] | no_such_filter }}")
    await sync_to_async(model_version_register)(
        name="demo-chat", version="v1", source_dir=broken, created_by="test"
    )
    runtime = await get_runtime()
    assert await runtime.wait_ready()
    acme = await sync_to_async(make_tenant)("acme")
    async with asgi_client() as client:
        response = await _chat(client, acme.auth, [{"role": "user", "content": "hello"}], max_tokens=2)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["message"] == "the replica could not admit it"
