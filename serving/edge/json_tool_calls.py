"""Tool calls under `tool_choice: "auto"` written as bare JSON at the start of the output, the formats
Llama 3.1/3.2's and Mistral's chat templates teach (docs/api.md, "Tools"; the Hermes tags are
hermes_tool_calls.py's):

    {"name": "get_weather", "parameters": {"city": "Paris"}}            Llama 3.1/3.2 (JSON tool use)
    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]    Mistral

Their markers (`<|python_tag|>`, `[TOOL_CALLS]`) are special tokens, which the detokenizer usually
drops; read with or without them. The output is calls only if all of it, after a marker, is one JSON
object or an array of them, each naming one of the request's tools with an object of arguments
(`arguments` or `parameters`); anything else is text, as the model wrote it. The format is read from the
output rather than from the model's template: an answer that is nothing but such JSON naming a given
tool is a call whichever model wrote it."""

from __future__ import annotations

import json

from serving.edge.hermes_tool_calls import ParsedCalls, call_from
from serving.edge.tool_calls import MAX_PARALLEL_CALLS, ToolRequest

MARKERS = ("<|python_tag|>", "[TOOL_CALLS]")
# What such an output begins with, once leading whitespace is dropped.
OPENINGS = ("{", "[", *MARKERS)


def parse_leading_json(request: ToolRequest, text: str) -> ParsedCalls | None:
    """The calls `text` makes in either format, or None when it is not only calls."""
    body = text.strip()
    for marker in MARKERS:
        body = body.removeprefix(marker).strip()
    if not body.startswith(("{", "[")):
        return None
    try:
        value = json.loads(body)
    except ValueError:
        return None
    values = value if isinstance(value, list) else [value]
    names = {tool.name for tool in request.tools}
    calls = [call_from(v, names) for v in values]
    if not calls or any(call is None for call in calls):
        return None
    kept = [call for call in calls if call is not None][: MAX_PARALLEL_CALLS if request.parallel else 1]
    return ParsedCalls(None, tuple(kept))


def may_open(text: str) -> bool:
    """Whether a choice's text so far may still become such calls: nothing but whitespace yet, or the
    beginning of an opening. A stream holds it back until it knows."""
    start = text.lstrip()
    return not start or any(o.startswith(start) or start.startswith(o) for o in OPENINGS)


def opens(text: str) -> bool:
    """Whether a choice's text so far begins like such calls: the rest is held until the end."""
    return text.lstrip().startswith(OPENINGS)
