"""A choice's text read as the answer its request gets: plain text, or OpenAI's tool calls (docs/api.md,
"Tools"), whole (`answer`) or as it streams (`ChoiceStream`). Both read a choice's text the same way, so
a stream's deltas reassemble to what the same choice returns whole.

- `tool_choice` "required" or a named function: the output was constrained to calls, and is read once
  it is whole (the stream holds it back: a call's arguments are sent when they parse). An output cut
  short (by max_tokens or a stop string) holds no whole call: it is answered as its text, with its own
  finish_reason ("length"), as response_format's JSON cut short is.
- "auto": the model's own format: the Hermes tags (hermes_tool_calls.py), or bare JSON at the start,
  Llama 3.1's and Mistral's (json_tool_calls.py). A stream sends the text before a call as it comes,
  holding back only what may begin `<tool_call>`, and everything from the tag on until the end: then
  either calls, or, when they do not parse, the rest of the text. An output that begins like bare JSON
  (`{`, `[`, a marker) is held whole until its end.
- "none", or no tools: the text as it is.

A choice that made calls ends with finish_reason "tool_calls" (one cut short keeps "length").
"""

from __future__ import annotations

from dataclasses import dataclass

from serving.edge import json_tool_calls
from serving.edge.hermes_tool_calls import OPEN_TAG, held_back, parse_hermes
from serving.edge.tool_calls import ToolCall, ToolRequest, tool_calls_from_output


@dataclass(frozen=True, slots=True)
class ChoiceAnswer:
    """What a choice answers: `content` (None: none, beside tool calls), its calls, its finish_reason."""

    content: str | None
    calls: tuple[ToolCall, ...]
    finish_reason: str


def answer(tools: ToolRequest | None, text: str, finish_reason: str) -> ChoiceAnswer:
    """A whole choice's answer, from its text and the finish_reason the replica gave it."""
    if tools is None or tools.choice == "none" or finish_reason == "error":
        return ChoiceAnswer(text, (), finish_reason)
    if tools.is_constrained:
        try:
            calls = tool_calls_from_output(tools, text)
        except ValueError:  # cut short: no whole call
            return ChoiceAnswer(text, (), finish_reason)
        return ChoiceAnswer(None, tuple(calls), _with_calls(finish_reason))
    parsed = parse_hermes(tools, text) or json_tool_calls.parse_leading_json(tools, text)
    if parsed is None:
        return ChoiceAnswer(text, (), finish_reason)
    return ChoiceAnswer(parsed.content, parsed.calls, _with_calls(finish_reason))


def _with_calls(finish_reason: str) -> str:
    return "tool_calls" if finish_reason == "stop" else finish_reason


class ChoiceStream:
    """One streamed choice: `feed` each token's text and send what it returns as content now; `finish`
    gives the answer's end: the content still to send (None: nothing), the calls and finish_reason.
    What it sent is always the beginning of its text, and of its answer's content."""

    __slots__ = ("_at_call", "_pending", "_pieces", "_sent", "_tools")

    def __init__(self, tools: ToolRequest | None) -> None:
        self._tools = tools if tools is not None and tools.choice != "none" else None
        self._pieces: list[str] = []  # the text so far (joined once, at the end)
        self._sent = 0  # characters of the text sent as content
        self._pending = ""  # auto: text after what was sent, not yet known to be content
        self._at_call = False  # auto: a call's tag has come, and the rest waits for the end

    @property
    def may_call(self) -> bool:
        """Whether the answer may be calls (its content null then, and so its opening's)."""
        return self._tools is not None

    def feed(self, text: str) -> str:
        if self._tools is None:
            return text
        self._pieces.append(text)
        if self._tools.is_constrained or self._at_call:
            return ""
        # auto: the text before a call, less what may begin the tag, once it is more than whitespace
        # (content that is only whitespace before calls is null, as answer() makes it). Nothing sent
        # may begin the tag, so it is looked for in the pending text alone.
        self._pending += text
        if not self._sent and json_tool_calls.may_open(self._pending):  # bare JSON calls, perhaps
            self._at_call = json_tool_calls.opens(self._pending)
            return ""
        tag = self._pending.find(OPEN_TAG)
        self._at_call = tag >= 0
        end = tag if self._at_call else len(self._pending) - held_back(self._pending)
        out = self._pending[:end]
        if not out or (not self._sent and not out.strip()):
            return ""
        self._pending, self._sent = self._pending[end:], self._sent + end
        return out

    def finish(self, finish_reason: str) -> ChoiceAnswer:
        if self._tools is None:
            return ChoiceAnswer(None, (), finish_reason)
        text = "".join(self._pieces)
        whole = answer(self._tools, text, finish_reason)
        content = whole.content or ""
        # feed sends only text before any call, which the answer's content then begins with
        assert content.startswith(text[: self._sent]), "a stream sent text its answer lacks"
        return ChoiceAnswer(content[self._sent :] or None, whole.calls, whole.finish_reason)
