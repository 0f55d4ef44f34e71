"""OpenAI request bodies, checked field by field before anything is sent: completions, chat and
embeddings. Features we do not implement (echo, images) are refused with a 400 rather than silently
ignored; sent as null, a field reads as absent. response_format (text, JSON, a JSON schema) is a
sampling field, parsed with the others (request_bodies.py, response_format.py); chat's tools are
tool_calls.py's, its messages chat_messages.py's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings

from serving.edge.chat_messages import parse_messages
from serving.edge.request_bodies import (
    SAMPLING_FIELDS,
    check_max_tokens,
    is_int,
    parse_sampling,
    parse_text_inputs,
)
from serving.edge.tool_calls import ToolRequest, parse_tools, response_format_for
from serving.gateway.errors import GatewayError
from serving.gateway.prompt_size import prompt_chars
from serving.gateway.service_tiers import parse_service_tier
from serving.transport.protocol import MAX_LOGPROBS

# Accepted and ignored: they do not change what we generate.
_IGNORED = frozenset({"user", "stream_options", "store", "metadata"})


_COMMON = SAMPLING_FIELDS | {"model", "n", "service_tier"}


COMPLETION_FIELDS = _COMMON | _IGNORED | {"prompt", "echo", "logprobs"}


CHAT_FIELDS = (
    _COMMON
    | _IGNORED
    | {
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    }
)


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A chat's conversation as the replica renders it, and what its tool fields ask for (None: no
    tools, or tool_choice "none" without tools)."""

    messages: list[dict[str, Any]]
    tools: ToolRequest | None = None

    def dispatch_fields(self) -> dict[str, Any]:
        """What the submission carries: the messages, and the tools the chat template is given."""
        return {"messages": self.messages, "tools": self.tools.for_template() if self.tools else None}


MAX_COMPLETION_LOGPROBS = 5  # as OpenAI's completions; chat's top_logprobs go to the engine's 20


MAX_CHOICES = 16  # n: choices of one request, each a sequence of its own on the replica


def _refuse_unsupported(fields: dict[str, Any], allowed: frozenset[str], what: str = "field(s)") -> None:
    """GatewayError(400) naming the fields outside `allowed`. One sent as null reads as absent, as every
    parameter does (the openai client sends null for one passed as None)."""
    unknown = sorted(name for name, value in fields.items() if name not in allowed and value is not None)
    if unknown:
        raise GatewayError(400, f"unsupported {what}: {', '.join(unknown)}")


def _model(body: dict[str, Any], allowed: frozenset[str]) -> str:
    """The body's model, after refusing fields the endpoint does not know."""
    _refuse_unsupported(body, allowed)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise GatewayError(400, "model must be a non-empty string")
    return model


def _common(
    body: dict[str, Any], allowed: frozenset[str], *, default_max_tokens: int | None = 16
) -> tuple[str, dict[str, Any], bool]:
    model = _model(body, allowed)
    n = body.get("n")
    if n is not None and (not is_int(n) or not 1 <= n <= MAX_CHOICES):
        raise GatewayError(400, f"n must be an integer from 1 to {MAX_CHOICES}")
    if body.get("echo"):
        raise GatewayError(400, "echo is not supported")
    include_usage = wants_stream_usage(body)
    sampling = parse_sampling(body, default_max_tokens=default_max_tokens)
    sampling["n"] = n or 1
    sampling["service_tier"] = parse_service_tier(body.get("service_tier"))  # granted by the caller
    return model, sampling, include_usage


def wants_stream_usage(body: dict[str, Any]) -> bool:
    """stream_options.include_usage: an object whose one field (null is absent) is a boolean."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise GatewayError(400, "stream_options must be an object")
    _refuse_unsupported(options, frozenset({"include_usage"}), "stream_options field(s)")
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise GatewayError(400, "stream_options.include_usage must be true or false")
    # as OpenAI: a client that asks for stream usage without a stream gets no usage
    if body.get("stream") is not True:
        raise GatewayError(400, "stream_options is only allowed when stream is true")
    return bool(include_usage)


def parse_completion(body: dict[str, Any]) -> tuple[str, dict[str, Any], bool, str]:
    model, sampling, include_usage = _common(body, COMPLETION_FIELDS)
    logprobs = body.get("logprobs")
    if logprobs is not None and logprobs is not False:  # false: none, as some clients send it
        if not is_int(logprobs) or not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
            raise GatewayError(400, f"logprobs must be an integer from 0 to {MAX_COMPLETION_LOGPROBS}")
        sampling["logprobs"] = logprobs
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise GatewayError(400, "prompt must be a non-empty string (one prompt per request)")
    if len(prompt) > settings.MAX_INPUT_CHARS:
        raise GatewayError(
            400, f"prompt is {len(prompt)} characters; the limit is {settings.MAX_INPUT_CHARS}"
        )
    return model, sampling, include_usage, prompt


def parse_chat(body: dict[str, Any]) -> tuple[str, dict[str, Any], bool, ChatRequest]:
    if "max_completion_tokens" in body:  # OpenAI's newer name; null is absent, as for max_tokens
        body = dict(body)
        max_completion_tokens = body.pop("max_completion_tokens")
        if max_completion_tokens is not None:
            # Each checked before they are compared: true == 1 in Python, but true is no token count.
            if body.get("max_tokens") is not None:
                check_max_tokens(body["max_tokens"])
            check_max_tokens(max_completion_tokens, "max_completion_tokens")
            if body.get("max_tokens") is not None and body["max_tokens"] != max_completion_tokens:
                raise GatewayError(400, "max_tokens and max_completion_tokens differ: send one of them")
            body["max_tokens"] = max_completion_tokens
    # OpenAI's chat default: no max_tokens runs to the end of the answer or of the context.
    model, sampling, include_usage = _common(body, CHAT_FIELDS, default_max_tokens=None)
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise GatewayError(400, "logprobs must be true or false")
    if top is not None and (not is_int(top) or not 0 <= top <= MAX_LOGPROBS):
        raise GatewayError(400, f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS}")
    if top is not None and not logprobs:
        raise GatewayError(400, "top_logprobs needs logprobs set to true")
    if logprobs:
        sampling["logprobs"] = top or 0
    clean = parse_messages(body.get("messages"))
    if prompt_chars(messages=clean) > settings.MAX_INPUT_CHARS:  # the tools have a limit of their own
        raise GatewayError(400, f"messages are over the {settings.MAX_INPUT_CHARS}-character limit")
    tools = parse_tools(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
    constraint = response_format_for(tools) if tools is not None else None
    if constraint is not None:
        if "response_format" in sampling:
            raise GatewayError(
                400,
                'tool_choice "required" or a named function constrains the answer to calls: send no '
                "response_format with it",
            )
        sampling["response_format"] = constraint
    return model, sampling, include_usage, ChatRequest(clean, tools)


EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})


def parse_embeddings(body: dict[str, Any]) -> tuple[str, list[str], str]:
    model = _model(body, EMBEDDING_FIELDS)
    encoding = body.get("encoding_format")
    if encoding is None:  # absent or null; anything else is checked, false and "" included
        encoding = "float"
    if encoding not in ("float", "base64"):
        raise GatewayError(400, 'encoding_format must be "float" or "base64"')
    if body.get("dimensions") is not None:
        raise GatewayError(400, "dimensions is not supported: the model's own dimension is returned")
    return model, parse_text_inputs(body.get("input")), encoding
