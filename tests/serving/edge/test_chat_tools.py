"""Tool calling through the `openai` client on the whole application and the random-weight demo model
(docs/api.md, "Tools"): `tool_choice: "required"` and a named function give calls whose arguments
validate, whatever the model writes; a stream's tool-call deltas reassemble, in the client's own stream
accumulation, to the calls the same request returns whole; a conversation continues with `role: "tool"`
messages; bad tool fields are 400s naming the field, before anything reaches a replica."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.django_db(transaction=True)

# Every string, integer, array and enum bounded, so that a call closes well within MAX_TOKENS whatever the
# random model prefers (a JSON number's fraction is not: the random model writes digits on and on); a
# nested object and an array, as real functions take.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "at": {
            "type": "object",
            "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
            "required": ["hour"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zones": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}},
    "required": ["zones"],
    "additionalProperties": False,
}
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": name, "description": f"the {name[4:]}", "parameters": schema},
    }
    for name, schema in PARAMETERS.items()
]
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]
MAX_TOKENS = 400


def _validate_calls(message: Any) -> list[tuple[str, Any]]:
    """A message's calls as (name, arguments); each names a tool and its arguments validate."""
    assert message.content is None and message.tool_calls
    calls = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[call.function.name])
        calls.append((call.function.name, arguments))
    assert len({call.id for call in message.tool_calls}) == len(calls)
    return calls


async def test_required_gives_a_hundred_sampled_answers_of_valid_calls(
    openai_client: openai.AsyncOpenAI,
) -> None:
    """100 choices at temperature 1 (10 requests of n=10 at once, each choice its own seed): every one
    is calls, each naming a tool, with arguments that validate against its parameters."""
    responses = await asyncio.gather(
        *(
            openai_client.chat.completions.create(
                model="demo-chat",
                messages=ASK,  # type: ignore[arg-type]
                tools=TOOLS,
                tool_choice="required",
                max_tokens=MAX_TOKENS,
                temperature=1.0,
                seed=1000 * request,
                n=10,
            )
            for request in range(10)
        )
    )
    choices = [choice for response in responses for choice in response.choices]
    assert len(choices) == 100
    names = set()
    for choice in choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        names.update(name for name, _ in _validate_calls(choice.message))
    assert names == {"get_weather", "get_time"}  # sampled: both come up
    usage = responses[0].usage
    assert usage is not None and usage.completion_tokens > 0


async def test_a_named_function_is_the_one_called_and_parallel_false_calls_once(
    openai_client: openai.AsyncOpenAI,
) -> None:
    named = await openai_client.chat.completions.create(
        model="demo-chat",
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=MAX_TOKENS,
        seed=5,
        n=4,
    )
    for choice in named.choices:
        assert choice.finish_reason == "tool_calls"
        ((name, _),) = _validate_calls(choice.message)
        assert name == "get_time"
    single = await openai_client.chat.completions.create(
        model="demo-chat",
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        seed=6,
        n=6,
    )
    assert all(len(_validate_calls(choice.message)) == 1 for choice in single.choices)


async def test_streamed_tool_calls_reassemble_to_the_whole_answers(openai_client: openai.AsyncOpenAI) -> None:
    """Seeded: the openai client's own stream accumulation rebuilds the calls, names and arguments, as
    the same request returns them whole, and the stream ends with "tool_calls"; a named function's too;
    and several choices in one stream (the client places a choice where it first arrives: all open in
    index order)."""

    async def both(seed: int, tool_choice: Any, n: int = 1) -> list[tuple[Any, Any]]:
        request: dict[str, Any] = {
            "n": n,
            "model": "demo-chat",
            "messages": ASK,
            "tools": TOOLS,
            "tool_choice": tool_choice,
            "max_tokens": MAX_TOKENS,
            "temperature": 1.0,
            "seed": seed,
        }
        whole = await openai_client.chat.completions.create(**request)
        options = {"include_usage": True}
        async with openai_client.chat.completions.stream(**request, stream_options=options) as stream:
            async for _ in stream:
                pass
            streamed = await stream.get_final_completion()
        assert streamed.usage is not None and whole.usage is not None
        assert streamed.usage.completion_tokens == whole.usage.completion_tokens > 0  # the calls' tokens
        assert [c.index for c in streamed.choices] == [c.index for c in whole.choices] == list(range(n))
        return list(zip(whole.choices, streamed.choices, strict=True))

    named = {"type": "function", "function": {"name": "get_weather"}}
    runs = await asyncio.gather(
        *(both(seed, "required") for seed in range(4)), both(9, named), both(11, "required", n=3)
    )
    pairs = [pair for run in runs for pair in run]
    for whole, streamed in pairs:
        assert streamed.finish_reason == whole.finish_reason == "tool_calls"
        assert streamed.message.content is None
        assert _validate_calls(streamed.message) == _validate_calls(whole.message)
    assert [name for name, _ in _validate_calls(runs[4][0][1].message)] == ["get_weather"]


async def test_a_conversation_continues_with_the_tools_answers(openai_client: openai.AsyncOpenAI) -> None:
    """The assistant's calls go back as it returned them, with a `tool` message answering each; the next
    answer is text (tool_choice "none"), and its prompt holds what the first one's did and more."""
    first = await openai_client.chat.completions.create(
        model="demo-chat",
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        seed=3,
    )
    message = first.choices[0].message
    results = [
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"ok": True, "temp_c": 18})}
        for call in message.tool_calls or ()
    ]
    follow_up = [*ASK, message.model_dump(exclude_none=True), *results]
    second = await openai_client.chat.completions.create(
        model="demo-chat",
        messages=follow_up,  # type: ignore[arg-type]
        tools=TOOLS,
        tool_choice="none",
        max_tokens=8,
        seed=3,
    )
    choice = second.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    assert isinstance(choice.message.content, str)
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + len(results)
    # A tool's answer with no call of that id before it is refused, as OpenAI refuses it.
    orphan = [*ASK, {"role": "tool", "tool_call_id": "call_nope", "content": "18"}]
    with pytest.raises(openai.BadRequestError) as raised:
        await openai_client.chat.completions.create(model="demo-chat", messages=orphan)  # type: ignore[arg-type]
    assert raised.value.param == "messages" and "call_nope" in raised.value.message


async def test_the_tools_reach_the_prompt_and_auto_answers_text_when_the_model_calls_none(
    openai_client: openai.AsyncOpenAI,
) -> None:
    """The demo model has no template: the plain default writes the tools into the prompt. Under auto
    (the default with tools) its word salad holds no call, so the answer is that text, as without
    tools."""
    plain = await openai_client.chat.completions.create(
        model="demo-chat",
        messages=ASK,  # type: ignore[arg-type]
        max_tokens=16,
        temperature=0,
    )
    auto = await openai_client.chat.completions.create(
        model="demo-chat",
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,
        max_tokens=16,
        temperature=0,
    )
    assert plain.usage is not None and auto.usage is not None
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools' JSON
    choice = auto.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        ({"tools": []}, "tools", "tools must be a list"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools",
            "JSON schema of an object",
        ),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_date"}}},
            "tool_choice",
            "not in tools",
        ),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
                "tool_choice": "required",
            },
            "tools",
            "cannot be enforced",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "send no response_format",
        ),
        (
            {"messages": [*ASK, {"role": "assistant", "content": None}]},
            "messages",
            "messages[1].content must be",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f"}}]},
                ]
            },
            "messages",
            "arguments must be a string",
        ),
        ({"messages": [*ASK, {"role": "tool", "content": "18"}]}, "messages", "tool_call_id"),
    ],
)
async def test_bad_tool_fields_are_400s_naming_the_field(
    openai_client: openai.AsyncOpenAI, fields: dict[str, Any], param: str, fragment: str
) -> None:
    body = {"model": "demo-chat", "messages": ASK, "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as raised:
        await openai_client.chat.completions.create(**body)
    assert raised.value.param == param
    assert fragment in raised.value.message
