"""Chat messages to a prompt: the tokenizer's own chat template when it has one, else a plain default.

The default, for models without a template (such as the demo model), is documented in docs/api.md:
each message as `<|role|>` on its own line followed by its content, then `<|assistant|>` to prompt
the reply."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

DEFAULT_ROLES = frozenset({"system", "user", "assistant"})


def render_chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    if getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)


def encode_chat_prompt(
    tokenizer: Any, messages: list[dict[str, str]], encode: Callable[[str], list[int]]
) -> list[int]:
    """The chat's prompt ids: render_chat_prompt's text through `encode` (a plain call, special tokens
    added as for any prompt), less the second BOS token that gives a template writing its own (Llama,
    Mistral, Gemma): `<s><s>...` is a prompt the model never saw in training, and one token over in usage.
    The plain default writes none, so it keeps the tokenizer's."""
    text = render_chat_prompt(tokenizer, messages)
    ids = encode(text)
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if bos and bos_id is not None and text.startswith(bos) and ids[:2] == [bos_id, bos_id]:
        return ids[1:]
    return ids
