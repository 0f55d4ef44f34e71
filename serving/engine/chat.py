"""Chat messages to a prompt: the tokenizer's own chat template when it has one, else a plain default.

The default, for models without a template (such as the demo model), is documented in the README:
each message as `<|role|>` on its own line followed by its content, then `<|assistant|>` to prompt
the reply."""

from __future__ import annotations

from typing import Any

DEFAULT_ROLES = frozenset({"system", "user", "assistant"})


def render_chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    if getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)
