"""What admission charges for a prompt before it is tokenised (serving/gateway/prompt_size.py): a chat's
tools and its earlier calls' arguments are read by the model, so they are charged and forecast too."""

from __future__ import annotations

import json

from registry.selectors import TenantContext
from serving.gateway.prompt_size import prompt_chars
from serving.gateway.quota import charge_estimate
from serving.gateway.slo_admission import prompt_tokens_of

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALLED = [
    *ASK,
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "content": "12 C, rain", "tool_call_id": "call_1"},
]


def _context() -> TenantContext:
    return TenantContext(
        tenant_id=1,
        tenant_name="acme",
        cache_group="acme",
        requests_per_second=10.0,
        tokens_per_minute=100_000,
        max_concurrent_requests=4,
        allowed_model_names=frozenset(),
        may_pin=False,
        may_deploy=False,
    )


def test_a_chats_tools_and_earlier_calls_count_toward_its_prompt() -> None:
    plain = prompt_chars(messages=ASK)
    assert plain == len(ASK[0]["content"])
    assert prompt_chars(messages=ASK, tools=[TOOL] * 10) == plain + len(json.dumps([TOOL] * 10))
    called = prompt_chars(messages=CALLED)
    assert called == plain + len('{"city": "Paris"}') + len("12 C, rain")


def test_admission_charges_and_forecasts_the_tools() -> None:
    params = {"max_tokens": 16}
    bare = charge_estimate(_context(), params=params, messages=ASK)
    with_tools = charge_estimate(_context(), params=params, messages=ASK, tools=[TOOL] * 10)
    tools_chars = len(json.dumps([TOOL] * 10))  # ~4 characters a token, as the estimate reckons
    assert with_tools - bare in (tools_chars // 4, tools_chars // 4 + 1)
    forecast_bare = prompt_tokens_of({"messages": ASK})
    assert prompt_tokens_of({"messages": ASK, "tools": [TOOL] * 10}) - forecast_bare >= tools_chars // 4
    assert prompt_tokens_of({"input": "x" * 400}) == 100
