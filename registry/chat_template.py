"""A model's chat template, checked at registration: rendered over a few probe conversations in a process
of its own, it must finish within CHAT_TEMPLATE_TIMEOUT_S and write at most a bounded amount per input
character. A template is code (Jinja, sandboxed by transformers, but a loop over range(10**5) inside
another can still run for hours, and one can write gigabytes): checked here, one that would hold a
replica's preparing thread, or its model thread, is refused before any replica loads it
(docs/reliability.md, "Artifacts")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from registry.artifacts import ArtifactError

CHAT_TEMPLATE_TIMEOUT_S = 20.0  # the whole probe: loading the tokenizer is most of it
# A rendering may add this much to its conversation's text, plus a little per character of it.
MAX_TEMPLATE_OVERHEAD_CHARS = 64 * 1024
MAX_GROWTH_PER_CHAR = 4

PROBES = [
    [{"role": "user", "content": "hello"}],
    [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "hi " * 2000},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "and now?"},
    ],
]


# The same chats with tools, as a chat with tools reaches a template (serving/engine/chat.py): the tools in
# OpenAI's function format, and an assistant's call, its arguments an object, with the tool's answer. A
# template that refuses them (many take no tools) is no reason to refuse the model, whose chats without
# tools it serves; one that runs too long or writes too much with them is, as without.
PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_PROBES = [
    [{"role": "user", "content": "What is the weather in Paris?"}],
    [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and clear"},
    ],
]


def has_chat_template(model_dir: Path) -> bool:
    config = model_dir / "tokenizer_config.json"
    if (model_dir / "chat_template.jinja").is_file() or (model_dir / "chat_template.json").is_file():
        return True
    try:
        return bool(config.is_file() and json.loads(config.read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError):
        return False  # the loader's own error says what is wrong with it


def check_chat_template(model_dir: Path) -> None:
    """Raise ArtifactError for a template that runs too long, writes too much, or does not render a chat
    without tools (with tools it may refuse to render: see TOOL_PROBES)."""
    if not has_chat_template(model_dir):
        return
    probes = {"plain": PROBES, "with_tools": TOOL_PROBES, "tools": PROBE_TOOLS}
    try:
        probe = subprocess.run(
            [sys.executable, "-m", "registry.chat_template_probe", str(model_dir)],
            input=json.dumps(probes),
            capture_output=True,
            text=True,
            timeout=CHAT_TEMPLATE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise ArtifactError(
            f"its chat template did not render {len(PROBES) + len(TOOL_PROBES)} short conversations (with "
            f"and without tools) within {CHAT_TEMPLATE_TIMEOUT_S:g} s; refusing it"
        ) from None
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise ArtifactError(f"its chat template does not render: {last}")
    rendered = json.loads(probe.stdout)
    tools_chars = len(json.dumps(PROBE_TOOLS))
    checks = [
        (sum(len(m["content"]) for m in messages), n)
        for messages, n in zip(PROBES, rendered["lengths"], strict=True)
    ]
    checks += [
        (len(json.dumps(messages)) + tools_chars, n)
        for messages, n in zip(TOOL_PROBES, rendered["tool_lengths"], strict=True)
        if n is not None  # the template refused tools: chats with them will be refused as they come
    ]
    for text, length in checks:
        if length > MAX_TEMPLATE_OVERHEAD_CHARS + MAX_GROWTH_PER_CHAR * text:
            raise ArtifactError(
                f"its chat template writes {length} characters for a conversation of {text}; refusing it"
            )
