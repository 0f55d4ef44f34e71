"""A chat's tools and tool messages in its prompt (serving/engine/chat.py): given to the model's template
as transformers takes them, a call's arguments as the object they hold; written by the plain default
for a model without a template."""

from __future__ import annotations

import json
from typing import Any

import pytest

from serving.engine.chat import render_chat_prompt
from serving.engine.demo_model import build_tokenizer

# Qwen2.5's template, its tool parts as they are (the default system prompt shortened).
QWEN_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
{%- else %}{{- 'You are helpful.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\n" }}
{{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \
\\"arguments\\": <args-json-object>}\
\\n</tool_call><|im_end|>\\n" }}
{%- endif %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "the time in a zone",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
        },
    }
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}
CONVERSATION: list[dict[str, Any]] = [
    {"role": "user", "content": "What time is it in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "12:00", "tool_call_id": "call_1"},
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer(256)


def test_a_template_gets_the_tools_and_the_calls_arguments_as_an_object(tokenizer: Any) -> None:
    tokenizer.chat_template = QWEN_TEMPLATE
    prompt = render_chat_prompt(tokenizer, CONVERSATION, TOOLS)
    assert json.dumps(TOOLS[0]) in prompt  # the tool, as the template writes it (tojson)
    # The call as the model was taught to write it: its arguments an object, not a quoted string.
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    without = render_chat_prompt(tokenizer, CONVERSATION[:1])
    assert "<tools>" not in without and without.startswith("<|im_start|>user\n")
    assert CONVERSATION[1]["tool_calls"][0] is CALL and isinstance(CALL["function"]["arguments"], str)


def test_the_plain_default_writes_the_tools_and_the_calls(tokenizer: Any) -> None:
    tokenizer.chat_template = None
    prompt = render_chat_prompt(tokenizer, CONVERSATION, TOOLS)
    assert prompt == (
        f"<|tools|>\n{json.dumps(TOOLS)}\n"
        "<|user|>\nWhat time is it in Paris?\n"
        '<|assistant|>\n\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>\n'
        "<|tool|>\n12:00\n"
        "<|assistant|>\n"
    )
