"""Chat messages to a prompt: the tokenizer's own chat template when it has one, else a plain default.

Messages come as the gateway checked them (serving/edge/chat_messages.py): a role and a string content;
an assistant's may carry OpenAI's `tool_calls`, a `tool` message its `tool_call_id`. `tools` (OpenAI's
function format) go to the template as transformers' `apply_chat_template(tools=…)` takes them; a
template that ignores them is given them all the same (a constrained tool_choice needs no template).
The calls' arguments, JSON text on the wire as OpenAI's, are given to a template as the object they
hold, as transformers documents and vLLM does: templates write them out with `tojson`.

The default, for models without a template (such as the demo model), is documented in docs/api.md:
the tools, if any, as `<|tools|>` on its own line and their JSON; each message as `<|role|>` on its own
line followed by its content, an assistant's calls after it in the Hermes format
(`<tool_call>{"name": …, "arguments": …}</tool_call>`, one a line); then `<|assistant|>` to prompt the
reply."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

DEFAULT_ROLES = frozenset({"system", "user", "assistant", "tool"})


def render_chat_prompt(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> str:
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [_for_template(m) for m in messages],
            tools=tools or None,
            add_generation_prompt=True,
            tokenize=False,
        )
        return str(rendered)
    parts = [f"<|tools|>\n{json.dumps(tools, ensure_ascii=False)}\n"] if tools else []
    for message in messages:
        calls = "".join(
            f"<tool_call>{json.dumps(_call_for_template(c)['function'], ensure_ascii=False)}</tool_call>\n"
            for c in message.get("tool_calls") or ()
        )
        parts.append(f"<|{message['role']}|>\n{message['content']}\n{calls}")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    if not message.get("tool_calls"):
        return message
    return {**message, "tool_calls": [_call_for_template(call) for call in message["tool_calls"]]}


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    """A call with its arguments as an object where they are JSON of one (else the text, as sent)."""
    function = call["function"]
    try:
        arguments = json.loads(function["arguments"])
    except (TypeError, ValueError):
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def encode_chat_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    encode: Callable[[str], list[int]],
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The chat's prompt ids: render_chat_prompt's text through `encode` (a plain call, special tokens
    added as for any prompt), less the second BOS token that gives a template writing its own (Llama,
    Mistral, Gemma): `<s><s>...` is a prompt the model never saw in training, and one token over in usage.
    The plain default writes none, so it keeps the tokenizer's."""
    text = render_chat_prompt(tokenizer, messages, tools)
    ids = encode(text)
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if bos and bos_id is not None and text.startswith(bos) and ids[:2] == [bos_id, bos_id]:
        return ids[1:]
    return ids
