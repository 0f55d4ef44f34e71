"""Tool calls' edge pieces (serving/edge/tool_calls.py): the fields checked as OpenAI defines them, and,
through the engine on the random demo model, `tool_choice: "required"` and a named function constrained
to calls whose arguments validate against the function's parameters (through the API:
test_chat_tools.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from serving.edge.tool_calls import ToolRequest, parse_tools, response_format_for, tool_calls_from_output
from serving.engine.engine import Engine, EngineConfig
from serving.engine.sequence import FinishReason, SamplingParams
from serving.gateway.errors import GatewayError

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 8}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "today's", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.mark.parametrize(
    ("tools", "choice", "parallel", "fragment"),
    [
        (None, "required", None, "tool_choice needs tools"),
        ([], None, None, "tools must be a list"),
        ([{"type": "function"}], None, None, "tools[0] must be"),
        ([{"type": "function", "function": {"name": "a b"}}], None, None, "function.name"),
        ([TOOLS[0], TOOLS[0]], None, None, "not unique"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "not in tools"),
        (TOOLS, "sometimes", None, "tool_choice must be"),
        (TOOLS, None, "yes", "parallel_tool_calls"),
    ],
)
def test_bad_tool_fields_are_400s_saying_why(tools: Any, choice: Any, parallel: Any, fragment: str) -> None:
    with pytest.raises(GatewayError) as raised:
        parse_tools(tools, choice, parallel)
    assert raised.value.status == 400 and fragment in raised.value.message


def test_tool_fields_default_as_openais() -> None:
    assert parse_tools(None, None, None) is None and parse_tools(None, "none", None) is None
    auto = parse_tools(TOOLS, None, None)
    assert auto is not None and auto.choice == "auto" and auto.parallel and not auto.is_constrained
    assert response_format_for(auto) is None
    named = parse_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, False)
    assert named is not None and named.forced == "get_time" and not named.parallel and named.is_constrained
    bare = parse_tools([{"type": "function", "function": {"name": "ping"}}], "required", None)
    assert bare is not None and bare.tools[0].parameters == {"type": "object", "properties": {}}


def _sample(engine: Engine, request: ToolRequest, seeds: range) -> list[str]:
    response_format = response_format_for(request)
    assert response_format is not None
    grammar = engine.grammars.compile(response_format)
    ids = engine.encode("What is the weather in Paris?")
    for seed in seeds:
        params = SamplingParams(max_tokens=400, temperature=1.0, seed=seed, grammar=grammar)
        engine.add_request(str(seed), ids, params)
    texts = {str(seed): "" for seed in seeds}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] += out.new_text
            if out.is_finished:
                assert out.finish_reason is FinishReason.STOP, texts[out.request_id]
    return list(texts.values())


def test_required_and_named_tool_choices_give_calls_whose_arguments_validate(demo_model_dir: Path) -> None:
    engine = Engine(demo_model_dir, config=EngineConfig(kv_cache_bytes=4 << 20, device="cpu", seed=0))
    required = parse_tools(TOOLS, "required", None)
    assert required is not None
    names = set()
    for text in _sample(engine, required, range(6)):
        calls = tool_calls_from_output(required, text)
        assert 1 <= len(calls) <= 8
        for call in calls:
            names.add(call.name)
            jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
            assert call.to_openai()["type"] == "function" and call.id.startswith("call_")
    assert names == {"get_weather", "get_time"}  # sampled: both functions come up
    single = parse_tools(TOOLS, "required", False)
    assert single is not None
    assert all(len(tool_calls_from_output(single, t)) == 1 for t in _sample(engine, single, range(6)))
    named = parse_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named is not None
    for text in _sample(engine, named, range(4)):
        (call,) = tool_calls_from_output(named, text)
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER)
