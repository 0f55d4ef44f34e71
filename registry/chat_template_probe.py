"""Run in a process of its own by registry/chat_template.py: load a model directory's tokenizer (local
files only, no remote code) and render its chat template over the probe conversations given as JSON on
stdin, and those with tools (null where the template refuses them); print each rendering's length as JSON
on stdout. Apart, so that a template that never ends can be killed, and so that registry's own modules
need no transformers."""

from __future__ import annotations

import json
import sys
from typing import Any

from transformers import AutoTokenizer


def main() -> None:
    model_dir, probes = sys.argv[1], json.load(sys.stdin)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)

    def length(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
        rendered = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        return len(rendered)

    def length_with_tools(messages: list[dict[str, Any]]) -> int | None:
        try:
            return length(messages, probes["tools"])
        except Exception:  # the template's own refusal (raise_exception, a missing field): no tools
            return None

    json.dump(
        {
            "lengths": [length(messages) for messages in probes["plain"]],
            "tool_lengths": [length_with_tools(messages) for messages in probes["with_tools"]],
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
