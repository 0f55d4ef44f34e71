"""A choice's text read as its answer under `tool_choice: "auto"` (the Hermes/Qwen format,
serving/edge/hermes_tool_calls.py; Llama 3.1's and Mistral's bare JSON, json_tool_calls.py), whole and
streamed: the stream's chunks, split wherever the tokens
fall, reassemble in the `openai` client's own accumulation to the answer the whole response gives."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from serving.edge.chat_messages import parse_messages
from serving.edge.openai_api import _stream
from serving.edge.openai_chunks import chat_chunk
from serving.edge.tool_answers import ChoiceStream, answer
from serving.edge.tool_calls import ToolRequest, parse_tools
from serving.gateway.errors import GatewayError

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
TIME = '{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}'  # arguments as JSON text


def _auto(parallel: bool | None = None) -> ToolRequest:
    request = parse_tools(TOOLS, "auto", parallel)
    assert request is not None
    return request


def test_hermes_calls_are_read_with_the_text_before_them() -> None:
    text = f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>"
    got = answer(_auto(), text, "stop")
    assert got.content == "Let me check.\n" and got.finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_time", {"zone": "CET"}),
    ]
    assert got.calls[0].id != got.calls[1].id
    only = answer(_auto(parallel=False), text, "stop")  # asked for one call: the first stands
    assert [c.name for c in only.calls] == ["get_weather"]


def test_calls_alone_have_null_content_and_an_unclosed_last_call_is_read() -> None:
    got = answer(_auto(), f"\n<tool_call>{WEATHER}", "stop")
    assert got.content is None and [c.name for c in got.calls] == ["get_weather"]


@pytest.mark.parametrize(
    "text",
    [
        "It is sunny in Paris.",  # no call
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "get_date", "arguments": {}}</tool_call>',  # a function it was not given
        '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
        f"<tool_call>{WEATHER}</tool_call><tool_call>{{cut",  # one bad call spoils them all
    ],
)
def test_an_output_without_readable_calls_is_answered_as_its_text(text: str) -> None:
    got = answer(_auto(), text, "stop")
    assert got.content == text and got.calls == () and got.finish_reason == "stop"


LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
MISTRAL = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, ' + TIME + "]"


@pytest.mark.parametrize(
    ("text", "names"),
    [
        (LLAMA, ["get_weather"]),  # Llama 3.1/3.2's JSON tool use
        (" <|python_tag|>" + LLAMA, ["get_weather"]),  # its marker kept by the detokenizer
        (MISTRAL, ["get_weather", "get_time"]),
        (MISTRAL.removeprefix("[TOOL_CALLS]"), ["get_weather", "get_time"]),  # the marker dropped
    ],
)
def test_bare_json_calls_of_llama_and_mistral_are_read(text: str, names: list[str]) -> None:
    got = answer(_auto(), text, "stop")
    assert got.content is None and got.finish_reason == "tool_calls"
    assert [c.name for c in got.calls] == names
    assert json.loads(got.calls[0].arguments) == {"city": "Paris"}


@pytest.mark.parametrize(
    "text",
    [
        '{"answer": 42}',  # JSON, but no call
        '{"name": "get_date", "parameters": {}}',  # a function it was not given
        LLAMA + " and then some text",
        "[1, 2, 3] are the numbers",
    ],
)
def test_json_that_is_not_only_calls_is_text(text: str) -> None:
    got = answer(_auto(), text, "stop")
    assert got.content == text and got.calls == ()


@pytest.mark.parametrize("size", [1, 4, 1000])
async def test_a_bare_json_stream_is_held_to_its_end_and_reassembles(size: int) -> None:
    chunks, streamed = await _streamed(_split(MISTRAL, size))
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks)  # nothing of the JSON as text
    assert streamed.finish_reason == "tool_calls" and streamed.message.content is None
    assert [c.function.name for c in streamed.message.tool_calls or []] == ["get_weather", "get_time"]
    _, text = await _streamed(_split('{"answer": 42}', size))
    assert text.message.content == '{"answer": 42}' and text.message.tool_calls is None


def test_tool_choice_none_and_a_cut_short_constrained_output_are_text() -> None:
    none = parse_tools(TOOLS, "none", None)
    text = f"<tool_call>{WEATHER}</tool_call>"
    assert answer(none, text, "stop").calls == ()
    required = parse_tools(TOOLS, "required", None)
    assert required is not None
    cut = answer(required, '[{"name": "get_weather", "parameters": {"ci', "length")
    assert cut.content == '[{"name": "get_weather", "parameters": {"ci' and cut.finish_reason == "length"


class TokensHandle:
    """A dispatched request whose replica writes `tokens`, then stops."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens

    def set_reader(self, reader: object) -> None:
        pass

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        for index, token in enumerate(self.tokens):
            yield {"token": token, "index": index}
        usage = {"prompt_tokens": 5, "completion_tokens": len(self.tokens), "total_tokens": 5}
        yield {"finish_reason": "stop", "usage": usage}

    async def close(self) -> None:
        pass


def _split(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


async def _streamed(tokens: list[str]) -> tuple[list[dict[str, Any]], Any]:
    """The chunks of one choice's stream and what the openai client's accumulation makes of them."""
    base = {"created": 0, "model": "m", "system_fingerprint": "m:v1", "request_id": "r1"}
    handles: list[Any] = [TokensHandle(tokens)]
    frames = [f async for f in _stream(handles, chat_chunk(base), False, announces_role=True, tools=_auto())]
    chunks = [json.loads(line.removeprefix(b"data: ")) for line in b"".join(frames).split(b"\n\n")[:-2]]
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    (choice,) = state.get_final_completion().choices
    return chunks, choice


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
async def test_an_auto_stream_reassembles_to_the_whole_answer(size: int) -> None:
    """Content goes out as it comes, up to the call's tag (never a piece of the tag); the calls come
    at the end as OpenAI's deltas; plain text with something like a tag in it streams as text."""
    with_calls = (
        f"Checking <the> weather.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{TIME}</tool_call>"
    )
    chunks, streamed = await _streamed(_split(with_calls, size))
    contents = [c["choices"][0]["delta"].get("content") or "" for c in chunks]
    assert "".join(contents) == "Checking <the> weather.\n"  # never a piece of the tag
    whole = answer(_auto(), with_calls, "stop")
    assert streamed.message.content == whole.content == "Checking <the> weather.\n"
    assert streamed.finish_reason == "tool_calls"
    calls = streamed.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (c.name, json.loads(c.arguments)) for c in whole.calls
    ]
    plain = "No <tool> needed: it is sunny <tool_ca"
    _, streamed = await _streamed(_split(plain, size))
    assert streamed.message.content == plain and streamed.message.tool_calls is None
    assert streamed.finish_reason == "stop"


def test_a_stream_holds_back_only_what_may_begin_the_tag() -> None:
    stream = ChoiceStream(_auto())
    assert stream.feed("  ") == ""  # only whitespace yet: null content if calls follow
    assert stream.feed("Hi <tool") == "  Hi "
    assert stream.feed("s> and") == "<tools> and"
    assert stream.feed(" <tool_call>{") == " "
    assert stream.feed('"name"') == ""
    end = stream.finish("stop")
    assert end.calls == () and end.content == '<tool_call>{"name"'  # no call after all: the rest as text


def test_tool_messages_must_answer_the_assistants_calls() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    clean = parse_messages(
        [
            {"role": "user", "content": "time?"},
            {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None},
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "12:00"}]},
        ]
    )
    assert clean[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert clean[2] == {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}
    plain = parse_messages([{"role": "assistant", "content": "hi", "tool_calls": []}])  # as LangChain sends
    assert plain == [{"role": "assistant", "content": "hi"}]
    with pytest.raises(GatewayError, match="no call there has the id 'call_2'"):
        parse_messages([*clean[:2], {"role": "tool", "tool_call_id": "call_2", "content": "x"}])
    with pytest.raises(GatewayError, match="must answer a call"):  # a user message in between
        parse_messages([*clean[:2], clean[0], clean[2]])
