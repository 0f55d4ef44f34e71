"""OpenAI-compatible endpoints, so the `openai` client works with base_url=http://host/v1.

Only n=1 is served; features we do not implement (logprobs, echo, tools, penalties other than 0) are
refused with a 400 rather than silently ignored."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from registry.errors import error_response
from registry.selectors import TenantContext
from serving.dispatch import Dispatch, authenticate, dispatch
from serving.gateway import GatewayError
from serving.requests import parse_json_body, parse_sampling

CHAT_ROLES = frozenset({"system", "user", "assistant"})
# Accepted and ignored: they do not change what we generate.
_IGNORED = frozenset({"user", "stream_options", "logit_bias", "service_tier", "store", "metadata"})
_ZERO_ONLY = ("presence_penalty", "frequency_penalty")
_COMMON = frozenset(
    {"model", "max_tokens", "stream", "temperature", "top_p", "seed", "stop", "n", *_ZERO_ONLY}
)
COMPLETION_FIELDS = _COMMON | _IGNORED | {"prompt", "echo", "logprobs"}
CHAT_FIELDS = _COMMON | _IGNORED | {"messages", "max_completion_tokens", "logprobs"}


def _common(body: dict[str, Any], allowed: frozenset[str]) -> tuple[str, dict[str, Any], bool]:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise GatewayError(400, f"unsupported field(s): {', '.join(unknown)}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise GatewayError(400, "model must be a non-empty string")
    if body.get("n", 1) != 1:
        raise GatewayError(400, "only n=1 is supported")
    for name in _ZERO_ONLY:
        if body.get(name, 0) not in (0, 0.0, None):
            raise GatewayError(400, f"{name} is not supported")
    if body.get("logprobs") not in (None, False, 0):
        raise GatewayError(400, "logprobs are not supported")
    if body.get("echo"):
        raise GatewayError(400, "echo is not supported")
    options = body.get("stream_options") or {}
    include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    return model, parse_sampling(body), include_usage


def _parse_completion(body: dict[str, Any]) -> tuple[str, dict[str, Any], bool, str]:
    model, sampling, include_usage = _common(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise GatewayError(400, "prompt must be a non-empty string (one prompt per request)")
    if len(prompt) > settings.MAX_INPUT_CHARS:
        raise GatewayError(
            413, f"prompt is {len(prompt)} characters; the limit is {settings.MAX_INPUT_CHARS}"
        )
    return model, sampling, include_usage, prompt


def _parse_chat(body: dict[str, Any]) -> tuple[str, dict[str, Any], bool, list[dict[str, str]]]:
    if "max_completion_tokens" in body:
        body = {**body, "max_tokens": body.pop("max_completion_tokens")}
    model, sampling, include_usage = _common(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise GatewayError(400, "messages must be a non-empty list")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise GatewayError(400, f"messages[{i}] needs a role of {', '.join(sorted(CHAT_ROLES))}")
        content = message.get("content")
        if not isinstance(content, str):
            raise GatewayError(400, f"messages[{i}].content must be a string")
        clean.append({"role": message["role"], "content": content})
    if sum(len(m["content"]) for m in clean) > settings.MAX_INPUT_CHARS:
        raise GatewayError(413, f"messages are over the {settings.MAX_INPUT_CHARS}-character limit")
    return model, sampling, include_usage, clean


def _sse(payload: Any) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def _finish_reason(event: dict[str, Any]) -> str:
    reason = event.get("finish_reason", "stop")
    return "stop" if reason == "abort" else reason


async def _stream(
    handle: Dispatch, chunk: Callable[[str | None, str | None], dict[str, Any]], include_usage: bool
) -> AsyncIterator[bytes]:
    try:
        yield _sse(chunk(None, None))  # announces the stream (chat: the assistant role)
        async for event in handle.events():
            if "token" in event:
                if event["token"]:
                    yield _sse(chunk(event["token"], None))
            elif event.get("finish_reason") == "error":
                yield _sse({"error": event.get("error", {"type": "internal_error", "message": "failed"})})
            else:
                final = chunk(None, _finish_reason(event))
                yield _sse(final)
                if include_usage:
                    yield _sse({**final, "choices": [], "usage": event.get("usage")})
        yield b"data: [DONE]\n\n"
    finally:
        await handle.close()


async def _collect(handle: Dispatch) -> tuple[str, dict[str, Any]]:
    pieces: list[str] = []
    final: dict[str, Any] = {}
    try:
        async for event in handle.events():
            if "token" in event:
                pieces.append(event["token"])
            elif "finish_reason" in event:
                final = event
    finally:
        await handle.close()
    if final.get("finish_reason") == "error" and not pieces:
        raise GatewayError(503, final.get("error", {}).get("message", "the replica failed"))
    return "".join(pieces), final


def _headers(handle: Dispatch) -> dict[str, str]:
    return handle.response_headers()


async def _start(
    request: HttpRequest, context: TenantContext, *, model: str, sampling: dict[str, Any], **payload: Any
) -> Dispatch:
    params = {k: v for k, v in sampling.items() if k != "stream"}
    params["stop"] = list(params["stop"])
    return await dispatch(
        context=context, path_model=model, pin=request.headers.get("X-Version-Pin"), params=params, **payload
    )


@csrf_exempt
async def completions(request: HttpRequest) -> HttpResponse:
    if request.method != "POST":
        return error_response(405, "use POST")
    try:
        context = await authenticate(request.headers.get("Authorization"))
        model, sampling, include_usage, prompt = _parse_completion(parse_json_body(request))
        handle = await _start(request, context, model=model, sampling=sampling, text=prompt)
    except GatewayError as exc:
        return error_response(exc.status, exc.message, headers=exc.headers)
    base = {
        "id": f"cmpl-{handle.request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": f"{handle.model_name}:{handle.version}",
    }

    def chunk(text: str | None, finish_reason: str | None) -> dict[str, Any]:
        return {
            **base,
            "choices": [{"text": text or "", "index": 0, "logprobs": None, "finish_reason": finish_reason}],
        }

    if sampling["stream"]:
        return StreamingHttpResponse(
            _stream(handle, chunk, include_usage), content_type="text/event-stream", headers=_headers(handle)
        )
    try:
        text, final = await _collect(handle)
    except GatewayError as exc:
        return error_response(exc.status, exc.message, headers=_headers(handle))
    body = chunk(text, _finish_reason(final))
    return JsonResponse({**body, "usage": final.get("usage", {})}, headers=_headers(handle))


@csrf_exempt
async def chat_completions(request: HttpRequest) -> HttpResponse:
    if request.method != "POST":
        return error_response(405, "use POST")
    try:
        context = await authenticate(request.headers.get("Authorization"))
        model, sampling, include_usage, messages = _parse_chat(parse_json_body(request))
        handle = await _start(request, context, model=model, sampling=sampling, messages=messages)
    except GatewayError as exc:
        return error_response(exc.status, exc.message, headers=exc.headers)
    base = {
        "id": f"chatcmpl-{handle.request_id}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": f"{handle.model_name}:{handle.version}",
    }

    def chunk(text: str | None, finish_reason: str | None) -> dict[str, Any]:
        if text is None and finish_reason is None:
            delta: dict[str, str] = {"role": "assistant", "content": ""}
        else:
            delta = {"content": text} if text else {}
        return {
            **base,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
        }

    if sampling["stream"]:
        return StreamingHttpResponse(
            _stream(handle, chunk, include_usage), content_type="text/event-stream", headers=_headers(handle)
        )
    try:
        text, final = await _collect(handle)
    except GatewayError as exc:
        return error_response(exc.status, exc.message, headers=_headers(handle))
    return JsonResponse(
        {
            **base,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": _finish_reason(final),
                }
            ],
            "usage": final.get("usage", {}),
        },
        headers=_headers(handle),
    )
