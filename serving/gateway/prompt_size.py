"""How much a request gives the model to read, in characters, before anything is tokenised: what the
quota charges for the prompt (quota.py) and what the TTFT forecast prefills (slo_admission.py) start
from. A chat's tools count: the template writes their schemas into the prompt (docs/api.md, "Tools"),
and a long tool list can outweigh the messages."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any


def prompt_chars(
    *,
    text: str | None = None,
    messages: Iterable[dict[str, Any]] | None = None,
    inputs: Iterable[str] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> int:
    """A text's characters, or a chat's (its messages' contents, its earlier calls' arguments and its
    tools as JSON), or an encoder's inputs'."""
    if text is not None:
        return len(text)
    if messages is not None:
        chars = 0
        for message in messages:
            chars += len(message["content"])
            chars += sum(len(call["function"]["arguments"]) for call in message.get("tool_calls") or ())
        return chars + (len(json.dumps(tools)) if tools else 0)
    return sum(len(t) for t in inputs or ())
