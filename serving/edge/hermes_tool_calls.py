"""Tool calls under `tool_choice: "auto"`, read from the model's own output in the Hermes format that
Qwen2.5/Qwen3, Hermes 2/3 and other templates teach their models (docs/api.md, "Tools"):

    Some text the model writes first.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each call is a JSON object between the tags, with its name and its arguments (an object, or a JSON
string of one; `parameters` is read as `arguments`, as some fine-tunes write it). A last call cut short
of its closing tag is read too, as vLLM's hermes parser reads it: models often end the answer there.
Nothing here is enforced (auto samples freely), so an output is calls only if every tagged call is
whole JSON that names one of the request's tools; otherwise the answer is its text, as the model wrote
it. Text after the last call is dropped, as vLLM drops it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from serving.edge.tool_calls import MAX_PARALLEL_CALLS, ToolCall, ToolRequest, new_call_id

OPEN_TAG = "<tool_call>"
_CALLS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ParsedCalls:
    """An output that holds calls: `content`, the text before the first (None when it is only
    whitespace, as OpenAI's null content beside tool calls)."""

    content: str | None
    calls: tuple[ToolCall, ...]


def parse_hermes(request: ToolRequest, text: str) -> ParsedCalls | None:
    """The calls `text` makes, or None when it makes none that can be read (the answer is then text)."""
    start = text.find(OPEN_TAG)
    if start < 0:
        return None
    names = {tool.name for tool in request.tools}
    calls = []
    for match in _CALLS.finditer(text, start):
        call = _call(match.group(1) if match.group(1) is not None else match.group(2), names)
        if call is None:
            return None
        calls.append(call)
    if not calls:
        return None
    # Without parallel calls the model was asked for one; it may still write more, and the first stands.
    calls = calls[: MAX_PARALLEL_CALLS if request.parallel else 1]
    prefix = text[:start]
    return ParsedCalls(prefix if prefix.strip() else None, tuple(calls))


def _call(body: str, names: set[str]) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return call_from(value, names)


def call_from(value: Any, names: set[str]) -> ToolCall | None:
    """A call from a parsed JSON value: an object naming one of `names`, with its arguments an object
    (or the JSON text of one) under `arguments` or `parameters`; None for anything else."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments: Any = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as OpenAI sends them, JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


def held_back(text: str) -> int:
    """How many of `text`'s last characters may begin OPEN_TAG: a stream holds them until it knows."""
    for size in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
        if OPEN_TAG.startswith(text[-size:]):
            return size
    return 0
