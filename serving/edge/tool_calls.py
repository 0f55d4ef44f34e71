"""Tools on chat completions (issue 38, item 2), the parts that need no new wiring: `tools`,
`tool_choice` and `parallel_tool_calls` checked as OpenAI defines them; the JSON schema that constrains
the output to valid calls for `tool_choice` "required" or a named function (enforced by the same
constrained decoding as `response_format`, docs/architecture.md "Structured outputs"); and the model's
constrained output read back as OpenAI's `tool_calls`.

NOT WIRED YET: parse_chat still refuses `tools` (openai_bodies.py), so nothing here is reachable over
the API. What remains: passing the tools to the chat template (the replica renders it, with
`apply_chat_template(tools=…)`), `auto` (parsing a model's own tool-call format), the response's
`message.tool_calls` with `finish_reason: "tool_calls"` and the streamed tool-call deltas, and
`role: "tool"` messages. The output shape for "required" is vLLM's: a JSON array of
`{"name", "parameters"}` objects (at most one without parallel calls); for a named function, the
arguments object itself.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from serving.gateway.errors import GatewayError

MAX_TOOLS = 128  # as OpenAI's
# Calls in one parallel answer: a model that would go on calling fills max_tokens with them otherwise.
MAX_PARALLEL_CALLS = 8
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    parameters: dict[str, Any]  # a JSON schema of an object; {} from OpenAI's "no parameters"
    description: str | None = None


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """What a chat's tool fields ask for. `forced`: the one function a named tool_choice names, else
    None; `choice` is "none", "auto", "required" or "function"."""

    tools: tuple[Tool, ...]
    choice: str
    forced: str | None
    parallel: bool

    @property
    def is_constrained(self) -> bool:
        """The output must be calls: constrained decoding enforces it."""
        return self.choice in ("required", "function")


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI's

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _refuse(message: str) -> GatewayError:
    return GatewayError(400, message)


def parse_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolRequest | None:
    """The chat body's tool fields, checked; None when it has no tools (tool_choice "none" or absent)."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise _refuse("parallel_tool_calls must be true or false")
    if tools is None:
        if tool_choice not in (None, "none"):
            raise _refuse("tool_choice needs tools")
        return None
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise _refuse(f"tools must be a list of 1 to {MAX_TOOLS} functions")
    parsed: list[Tool] = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise _refuse(f'tools[{i}] must be {{"type": "function", "function": {{"name": …}}}}')
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _refuse(f"tools[{i}].function.name must be 1 to 64 letters, digits, underscores or dashes")
        if any(t.name == name for t in parsed):
            raise _refuse(f"tools[{i}].function.name {name!r} is not unique")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise _refuse(f"tools[{i}].function.parameters must be a JSON schema object")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise _refuse(f"tools[{i}].function.description must be a string")
        parsed.append(Tool(name, parameters, description))
    forced = None
    if tool_choice is None:
        choice = "auto"
    elif isinstance(tool_choice, str) and tool_choice in _CHOICES:
        choice = tool_choice
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        named = tool_choice.get("function")
        forced = named.get("name") if isinstance(named, dict) else None
        if not any(t.name == forced for t in parsed):
            raise _refuse("tool_choice names a function that is not in tools")
        choice = "function"
    else:
        raise _refuse('tool_choice must be "none", "auto", "required" or {"type": "function", …}')
    return ToolRequest(tuple(parsed), choice, forced, parallel_tool_calls is not False)


def constraint_schema(request: ToolRequest) -> dict[str, Any] | None:
    """The JSON schema the output must match for a constrained tool_choice; None for none and auto."""
    if request.choice == "function":
        (tool,) = [t for t in request.tools if t.name == request.forced]
        return tool.parameters
    if request.choice != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.name}, "parameters": tool.parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in request.tools
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    schema["maxItems"] = MAX_PARALLEL_CALLS if request.parallel else 1
    return schema


def response_format_for(request: ToolRequest) -> dict[str, Any] | None:
    """The response_format a replica is sent for a constrained tool_choice (as response_format.py's)."""
    schema = constraint_schema(request)
    if schema is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "tool_calls", "schema": schema, "strict": True}}


def tool_calls_from_output(request: ToolRequest, text: str) -> list[ToolCall]:
    """The calls a constrained output holds. Raises ValueError for text that is not whole calls (one
    cut short by max_tokens): its caller answers with the text as it is, finish_reason "length"."""
    value = json.loads(text)
    if request.choice == "function":
        assert request.forced is not None
        return [ToolCall(_call_id(), request.forced, json.dumps(value, ensure_ascii=False))]
    if request.choice != "required" or not isinstance(value, list):
        raise ValueError("not tool calls")
    return [
        ToolCall(_call_id(), call["name"], json.dumps(call["parameters"], ensure_ascii=False))
        for call in value
    ]


def _call_id() -> str:
    return f"call_{secrets.token_hex(12)}"
