"""A chat's `messages`, checked at the edge and put in the one shape the replica renders (docs/api.md,
"Tools"): every message has a role and a string `content`; an assistant's may carry `tool_calls` (its
content null or absent then, sent as ""), and a `tool` message carries the `tool_call_id` of a call the
assistant message before it made, as OpenAI requires. Content is a string or a list of text parts,
joined; `developer` is read as `system`. Other fields of a message (`name`, `refusal`, …) are not
rendered, so they are dropped."""

from __future__ import annotations

from typing import Any

from serving.gateway.errors import GatewayError

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages as the replica renders them. Raises GatewayError(400) naming the message and why."""
    if not isinstance(messages, list) or not messages:
        raise GatewayError(400, "messages must be a non-empty list")
    clean: list[dict[str, Any]] = []
    open_calls: set[str] = set()  # the ids of the last assistant message's calls, for tool messages
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in CHAT_ROLES:  # a list or an object is unhashable
            raise GatewayError(400, f"messages[{i}] needs a role of {', '.join(sorted(CHAT_ROLES))}")
        assert isinstance(message, dict)
        # [] as absent: some clients (LangChain's) send it with every assistant message
        if role == "assistant" and message.get("tool_calls") not in (None, []):
            calls = _tool_calls(message["tool_calls"], i)
            content = "" if message.get("content") is None else _text(message, i)
            clean.append({"role": role, "content": content, "tool_calls": calls})
            open_calls = {call["id"] for call in calls}
            continue
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise GatewayError(400, f"messages[{i}].tool_call_id must be the id of the call it answers")
            if call_id not in open_calls:
                raise GatewayError(
                    400,
                    f"messages[{i}] (role tool) must answer a call of the assistant message before it: "
                    f"no call there has the id {call_id!r}",
                )
            clean.append({"role": role, "content": _text(message, i), "tool_call_id": call_id})
            continue
        open_calls = set()
        # "developer" is what OpenAI's newer models call the system prompt; chat templates know "system".
        clean.append({"role": "system" if role == "developer" else role, "content": _text(message, i)})
    return clean


def _tool_calls(value: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's calls, as OpenAI returned them: id, type "function", name, arguments."""
    if not isinstance(value, list):
        raise GatewayError(400, f"messages[{i}].tool_calls must be a list of calls")
    calls = []
    for j, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise GatewayError(400, f'{where} must be {{"id": …, "type": "function", "function": {{…}}}}')
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise GatewayError(400, f"{where}.id must be a non-empty string")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise GatewayError(400, f"{where}.function.name must be a string")
        if not isinstance(function.get("arguments"), str):
            raise GatewayError(400, f"{where}.function.arguments must be a string (the arguments' JSON)")
        name, arguments = function["name"], function["arguments"]
        calls.append(
            {"id": call["id"], "type": "function", "function": {"name": name, "arguments": arguments}}
        )
    return calls


def _text(message: dict[str, Any], i: int) -> str:
    """A message's content: a string, or a list of text parts ({"type": "text", "text": …}), joined."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise GatewayError(
                    400, f"messages[{i}].content[{j}] is not a text part: only text content is supported"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise GatewayError(400, f"messages[{i}].content must be a string or a list of text parts")
