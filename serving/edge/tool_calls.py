"""Tools on chat completions (docs/api.md, "Tools"): `tools`, `tool_choice` and `parallel_tool_calls`
checked as OpenAI defines them; the JSON schema that constrains the output to valid calls for
`tool_choice` "required" or a named function (enforced by the same constrained decoding as
`response_format`, docs/architecture.md "Structured outputs"), checked to compile before anything is
sent; the tools as the chat template is given them; and the model's constrained output read back as
OpenAI's `tool_calls`.

The output shape for "required" is vLLM's: a JSON array of `{"name", "parameters"}` objects (at most one
without parallel calls); for a named function, the arguments object itself. `auto` is read from the
model's own format (hermes_tool_calls.py); a choice's text becomes its answer in tool_answers.py, and the
conversation's assistant and `tool` messages are checked in chat_messages.py.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from serving.edge.response_format import compile_error
from serving.gateway.errors import GatewayError

MAX_TOOLS = 128  # as OpenAI's
# Calls in one parallel answer: a model that would go on calling fills max_tokens with them otherwise.
MAX_PARALLEL_CALLS = 8
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    parameters: dict[str, Any]  # a JSON schema of an object (its type said); none: no parameters
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

    def for_template(self) -> list[dict[str, Any]]:
        """The tools in OpenAI's function format, as transformers' apply_chat_template(tools=…) takes
        them (plain JSON: they cross to the replica in the submission)."""
        functions = []
        for tool in self.tools:
            function: dict[str, Any] = {"name": tool.name, "parameters": tool.parameters}
            if tool.description is not None:
                function["description"] = tool.description
            functions.append({"type": "function", "function": function})
        return functions


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
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise _refuse(f"tools[{i}].function.parameters must be a JSON schema of an object")
        # Said outright: a schema without a type allows any JSON value, and arguments are an object.
        parameters = {"type": "object", **parameters}
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
    request = ToolRequest(tuple(parsed), choice, forced, parallel_tool_calls is not False)
    _check_enforceable(request)
    return request


def _check_enforceable(request: ToolRequest) -> None:
    """A 400 naming tools for a constrained choice whose schema is too large or will not compile: the
    replica would refuse it only after the request was admitted. auto and none enforce nothing."""
    schema = constraint_schema(request)
    if schema is None:
        return
    compact = json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    size = len(compact.encode())
    if size > settings.MAX_RESPONSE_SCHEMA_BYTES:
        limit = settings.MAX_RESPONSE_SCHEMA_BYTES
        raise _refuse(f"tools: the calls' schema is {size} bytes of JSON; the limit is {limit}")
    error = compile_error(compact)
    if error:
        raise _refuse(f"tools: the functions' parameters cannot be enforced: {error}")


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
        return [ToolCall(new_call_id(), request.forced, json.dumps(value, ensure_ascii=False))]
    if request.choice != "required" or not isinstance(value, list):
        raise ValueError("not tool calls")
    return [
        ToolCall(new_call_id(), call["name"], json.dumps(call["parameters"], ensure_ascii=False))
        for call in value
    ]


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"
