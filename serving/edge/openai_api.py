"""OpenAI-compatible endpoints, so the `openai` client works with base_url=http://host/v1.

Features we do not implement (echo, tools, images, response formats other than text) are refused with
a 400 rather than silently ignored (sent as null, they read as absent, as every parameter does); n is
served up to MAX_CHOICES. Log probabilities are the model's own (before temperature and top-p), of each
token decoded alone, as OpenAI's and vLLM's: completions' `logprobs` (0-5 alternatives), chat's
`logprobs` and `top_logprobs` (0-20)."""

from __future__ import annotations

import asyncio
import codecs
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from registry.errors import error_response
from registry.models import Model
from registry.selectors import TenantContext
from serving.edge.infer_api import failed_dispatch, sse_response
from serving.edge.request_bodies import (
    SAMPLING_FIELDS,
    check_max_tokens,
    is_int,
    parse_json_body,
    parse_sampling,
    parse_text_inputs,
)
from serving.engine.sequence import MAX_LOGPROBS
from serving.gateway.auth import GatewayError
from serving.gateway.dispatch import (
    Dispatch,
    authenticate,
    charge_estimate,
    close_all,
    dispatch,
    prompt_usage,
)
from serving.transport.vectors import decode_vector

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant"})
# Accepted and ignored: they do not change what we generate.
_IGNORED = frozenset({"user", "stream_options", "service_tier", "store", "metadata"})
_COMMON = SAMPLING_FIELDS | {"model", "n"}
COMPLETION_FIELDS = _COMMON | _IGNORED | {"prompt", "echo", "logprobs"}
CHAT_FIELDS = (
    _COMMON
    | _IGNORED
    | {
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "response_format",
    }
)
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
    include_usage = _include_usage(body)
    sampling = parse_sampling(body, default_max_tokens=default_max_tokens)
    sampling["n"] = n or 1
    return model, sampling, include_usage


def _include_usage(body: dict[str, Any]) -> bool:
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


def _parse_completion(body: dict[str, Any]) -> tuple[str, dict[str, Any], bool, str]:
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


def _parse_chat(body: dict[str, Any]) -> tuple[str, dict[str, Any], bool, list[dict[str, str]]]:
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
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:  # text is what we make anyway
        raise GatewayError(
            400, 'response_format: only {"type": "text"} is supported (no JSON mode or schema)'
        )
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise GatewayError(400, "logprobs must be true or false")
    if top is not None and (not is_int(top) or not 0 <= top <= MAX_LOGPROBS):
        raise GatewayError(400, f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS}")
    if top is not None and not logprobs:
        raise GatewayError(400, "top_logprobs needs logprobs set to true")
    if logprobs:
        sampling["logprobs"] = top or 0
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise GatewayError(400, "messages must be a non-empty list")
    clean = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in CHAT_ROLES:  # a list or an object is unhashable
            raise GatewayError(400, f"messages[{i}] needs a role of {', '.join(sorted(CHAT_ROLES))}")
        # "developer" is what OpenAI's newer models call the system prompt; chat templates know "system".
        clean.append({"role": "system" if role == "developer" else role, "content": _text(message, i)})
    if sum(len(m["content"]) for m in clean) > settings.MAX_INPUT_CHARS:
        raise GatewayError(400, f"messages are over the {settings.MAX_INPUT_CHARS}-character limit")
    return model, sampling, include_usage, clean


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


def _sse(payload: Any) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def _finish_reason(event: dict[str, Any]) -> str:
    reason = event.get("finish_reason", "stop")
    return "stop" if reason == "abort" else reason


class Chunk(Protocol):
    """One chunk of either endpoint, for choice `index`; `logprobs`, the replica's entries for the tokens
    it carries ({"token", "logprob", "bytes", "top": [[token, logprob, bytes], …]}), or None."""

    def __call__(
        self,
        text: str | None,
        finish_reason: str | None,
        logprobs: list[dict[str, Any]] | None,
        index: int = 0,
    ) -> dict[str, Any]: ...


async def _stream(
    handles: list[Dispatch], chunk: Chunk, include_usage: bool, *, announces_role: bool
) -> AsyncIterator[bytes]:
    """The choices' chunks as their events come. As OpenAI's and vLLM's, a choice's first chunk goes out
    with its first token (or its end), not when a replica accepts it: a client that times the first
    chunk, as load tools do, would otherwise count a request still waiting in the queue as answered.
    `announces_role` (chat): each choice opens with the assistant's role, chunk(None, None, None,
    index), sent when its first event comes (a token, its text held back or not, or its end), as vLLM
    sends it with the engine's first output."""

    def sse(payload: dict[str, Any]) -> bytes:
        # With include_usage every chunk but the last carries "usage": null, as OpenAI documents.
        return _sse({**payload, "usage": None} if include_usage else payload)

    unannounced = set(range(len(handles))) if announces_role else set()
    try:
        for handle in handles:  # the task to cut off is this one, not those _events reads choices in
            handle.set_reader(asyncio.current_task())
        usages: list[dict[str, Any] | None] = []
        async for index, event in _events(handles):
            if index in unannounced:
                unannounced.discard(index)
                yield sse(chunk(None, None, None, index))
            if "token" in event:
                # A token whose text is held back (it may start a stop string) still sends its logprob.
                if event["token"] or "logprob" in event:
                    logprob = event.get("logprob")
                    yield sse(chunk(event["token"], None, [logprob] if logprob else None, index))
            elif event.get("finish_reason") == "error":
                # The choice ends with finish_reason "error"; the error object is what the openai client
                # raises on (APIError) instead of taking the stream as finished. The other choices end
                # with it: their sequences are aborted.
                error = event.get("error", {"type": "internal_error", "message": "failed"})
                yield sse({**chunk(None, "error", None, index), "error": error})
                break
            else:
                yield sse(chunk(None, _finish_reason(event), None, index))
                usages.append(event.get("usage"))
        else:
            if include_usage:
                yield _sse({**chunk(None, None, None), "choices": [], "usage": _usage(usages)})
        yield b"data: [DONE]\n\n"
    finally:
        for handle in handles:  # a cut-off from here on closes its handle, not this closing
            handle.set_reader(None)
        await close_all(handles)


async def _events(handles: list[Dispatch]) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """The choices' events as they come, each with its choice's index. One choice is read directly; for
    several, each choice's next event is awaited only once its last was passed on, so a client that
    stops reading backs every choice up on the gateway's queues, and the slow-reader cut-off cancels
    the task that reads them all (set as each one's reader), as it would a single choice's."""
    if len(handles) == 1:
        async for event in handles[0].events():
            yield 0, event
        return
    streams = [handle.events() for handle in handles]  # their reader: _stream's task, not these
    pending = {asyncio.ensure_future(anext(stream)): index for index, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                index = pending.pop(future)
                try:
                    event = future.result()
                except StopAsyncIteration:
                    continue
                yield index, event
                pending[asyncio.ensure_future(anext(streams[index]))] = index
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


def _usage(usages: list[dict[str, Any] | None]) -> dict[str, Any]:
    """One request's usage over its choices (the replicas' final events'), in OpenAI's shape: the prompt
    once (as OpenAI counts it), every choice's completion, the prompt tokens a prefix cache served as
    prompt_tokens_details.cached_tokens (and, as before, cached_prompt_tokens)."""
    known = [u or {} for u in usages]
    prompt = max(int(u.get("prompt_tokens", 0)) for u in known)
    completion = sum(int(u.get("completion_tokens", 0)) for u in known)
    cached = max(int(u.get("cached_prompt_tokens", 0)) for u in known)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "cached_prompt_tokens": cached,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def _dispatch_choices(n: int, **request: Any) -> list[Dispatch]:
    """The n choices of one request. The first is routed as any request; the others go to its version
    (not a pin: the platform chose it), each admitted against the quota as a request of its own. A
    seeded request's choice i draws from seed + i, so that its choices differ and each reproduces. More
    choices than the tenant's quota admits at once is a 400: refused with a 429, the client would retry
    a request that can never be admitted."""
    context: TenantContext = request["context"]
    if n > 1:
        at_once = min(math.floor(max(1.0, context.requests_per_second)), context.max_concurrent_requests)
        if n > at_once:
            raise GatewayError(
                400,
                f"n={n} asks for more choices than this tenant's quota admits at once ({at_once}: each "
                f"choice counts as a request against {context.requests_per_second:g} requests/s and "
                f"{context.max_concurrent_requests} concurrent)",
            )
        payload = {k: request.get(k) for k in ("text", "messages", "inputs")}
        tokens = charge_estimate(context, params=request["params"], num_choices=n, **payload)
        if n * tokens > context.tokens_per_minute:
            raise GatewayError(
                400,
                f"n={n} choices of an estimated {tokens} tokens each are over this tenant's whole quota of "
                f"{context.tokens_per_minute} tokens/min, so they can never be admitted together: lower "
                "n, max_tokens or the prompt",
            )
        request["num_choices"] = n
    # Admitted only with room for all n: a 429 comes before any choice reaches a replica, and its
    # Retry-After is the wait for all of them.
    first = await dispatch(**request, room_for=n)
    if n == 1:
        return [first]
    params = request.pop("params")
    seed = params.get("seed")

    def params_for(index: int) -> dict[str, Any]:
        return params if seed is None else {**params, "seed": (seed + index) % 2**63}

    tasks = [
        asyncio.create_task(dispatch(**request, params=params_for(i), version=first.version))
        for i in range(1, n)
    ]
    try:
        await asyncio.wait(tasks)  # never raises for a task's own failure
    except BaseException:  # cancelled: the client left while the other choices were dispatched
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        await close_all([first, *_dispatched(tasks)])
        raise
    failure = next((t.exception() for t in tasks if not t.cancelled() and t.exception() is not None), None)
    if failure is not None:
        await close_all([first, *_dispatched(tasks)])
        raise failure
    return [first, *_dispatched(tasks)]


def _dispatched(tasks: list[asyncio.Task[Dispatch]]) -> list[Dispatch]:
    return [task.result() for task in tasks if not task.cancelled() and task.exception() is None]


async def _collect(
    handles: list[Dispatch], logprobs: list[list[dict[str, Any]] | None]
) -> list[tuple[str, dict[str, Any]]]:
    """Every choice's text and final event; the first failure (GatewayError) ends the others."""
    if len(handles) == 1:
        return [await handles[0].collect(logprobs=logprobs[0])]
    failure: GatewayError | None = None
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(h.collect(logprobs=lp)) for h, lp in zip(handles, logprobs, strict=True)
            ]
    except* GatewayError as errors:
        failure = errors.exceptions[0]  # type: ignore[assignment]
    if failure is not None:
        raise failure
    return [task.result() for task in tasks]


async def _serve(
    request: HttpRequest,
    parse: Callable[[dict[str, Any]], tuple[str, dict[str, Any], bool, Any]],
    payload_name: str,
    make_chunk: Callable[[dict[str, Any]], Chunk],
    make_whole: Callable[[dict[str, Any], str, dict[str, Any]], dict[str, Any]],
    *,
    announces_role: bool,
) -> HttpResponse:
    """The shared body of both endpoints: parse, dispatch, then stream chunks or answer once.
    `announces_role`: whether a streamed choice opens with a chunk of its own (chat's assistant role)."""
    if request.method != "POST":
        return error_response(405, "use POST", headers={"Allow": "POST"})
    try:
        context = await authenticate(request.headers.get("Authorization"))
        model, sampling, include_usage, payload = parse(parse_json_body(request))
        params = {k: v for k, v in sampling.items() if k not in ("stream", "n")}
        params["stop"] = list(params["stop"])
        handles = await _dispatch_choices(
            sampling["n"],
            context=context,
            path_model=model,
            pin=request.headers.get("X-Version-Pin"),
            params=params,
            **{payload_name: payload},
        )
    except GatewayError as exc:
        return error_response(exc.status, exc.message, headers=exc.headers)
    handle = handles[0]
    base = {
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": f"{handle.model_name}:{handle.version}",
        "request_id": handle.request_id,
    }
    chunk = make_chunk(base)
    if sampling["stream"]:
        return sse_response(_stream(handles, chunk, include_usage, announces_role=announces_role), handles)
    logprobs: list[list[dict[str, Any]] | None] = [[] if "logprobs" in sampling else None for _ in handles]
    try:
        results = await _collect(handles, logprobs)
    except GatewayError as exc:
        return failed_dispatch(handle, exc)
    wholes = [
        make_whole(chunk(text, _finish_reason(final), logprobs[i], i), text, final)
        for i, (text, final) in enumerate(results)
    ]
    body = {**wholes[0], "choices": [whole["choices"][0] for whole in wholes]}
    if len(results) > 1:
        body["usage"] = _usage([final.get("usage") or {} for _, final in results])
    return JsonResponse(body, headers=handle.response_headers())


def _completion_chunk(base: dict[str, Any]) -> Chunk:
    head = {"id": f"cmpl-{base.pop('request_id')}", "object": "text_completion", **base}
    # text_offset runs on across a stream's chunks, in characters of the choice's text, counted from the
    # tokens' bytes: the tokens that share one character's bytes all start where it does.
    ends: dict[int, int] = {}  # each choice's text so far, in characters
    decoders: dict[int, codecs.IncrementalDecoder] = {}

    def chunk(
        text: str | None,
        finish_reason: str | None,
        logprobs: list[dict[str, Any]] | None,
        index: int = 0,
    ) -> dict[str, Any]:
        shaped = None
        if logprobs:
            tokens = [entry["token"] for entry in logprobs]
            characters = decoders.get(index)
            if characters is None:
                characters = decoders[index] = codecs.getincrementaldecoder("utf-8")(errors="replace")
            offsets = []
            for entry in logprobs:
                offsets.append(ends.get(index, 0))
                ends[index] = offsets[-1] + len(characters.decode(_token_bytes(entry)))
            shaped = {
                "tokens": tokens,
                "token_logprobs": [entry["logprob"] for entry in logprobs],
                "top_logprobs": [_top_dict(entry) for entry in logprobs],
                "text_offset": offsets,
            }
        choice = {"text": text or "", "index": index, "logprobs": shaped, "finish_reason": finish_reason}
        return {**head, "choices": [choice]}

    return chunk


def _token_bytes(entry: dict[str, Any]) -> bytes:
    """A logprobs entry's bytes; a replica of the release before sent none: its text's, then."""
    raw = entry.get("bytes")
    return entry["token"].encode() if raw is None else bytes(raw)


def _top_dict(entry: dict[str, Any]) -> dict[str, float]:
    """A completion token's alternatives, likeliest first, and the token itself (as OpenAI's and vLLM's:
    a sampled token outside the top ones is there too). Two ids that decode alike keep the likelier."""
    top: dict[str, float] = {}
    for token, logprob, *_ in entry["top"]:
        top.setdefault(token, logprob)
    top.setdefault(entry["token"], entry["logprob"])
    return top


def _chat_logprobs(logprobs: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    if not logprobs:
        return None

    def token(text: str, logprob: float, raw: list[int] | None = None) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode()) if raw is None else raw}

    content = [
        {
            **token(entry["token"], entry["logprob"], entry.get("bytes")),
            "top_logprobs": [token(*alternative) for alternative in entry["top"]],
        }
        for entry in logprobs
    ]
    return {"content": content, "refusal": None}


def _chat_chunk(base: dict[str, Any]) -> Chunk:
    head = {"id": f"chatcmpl-{base.pop('request_id')}", "object": "chat.completion.chunk", **base}

    def chunk(
        text: str | None,
        finish_reason: str | None,
        logprobs: list[dict[str, Any]] | None,
        index: int = 0,
    ) -> dict[str, Any]:
        if text is None and finish_reason is None:
            delta: dict[str, str] = {"role": "assistant", "content": ""}  # a choice's first chunk
        else:
            delta = {"content": text} if text else {}
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": _chat_logprobs(logprobs),
            "finish_reason": finish_reason,
        }
        return {**head, "choices": [choice]}

    return chunk


def _completion_whole(last_chunk: dict[str, Any], text: str, final: dict[str, Any]) -> dict[str, Any]:
    return {**last_chunk, "usage": _usage([final.get("usage")])}


def _chat_whole(last_chunk: dict[str, Any], text: str, final: dict[str, Any]) -> dict[str, Any]:
    choice = {
        "index": last_chunk["choices"][0]["index"],
        "message": {"role": "assistant", "content": text},
        "logprobs": last_chunk["choices"][0]["logprobs"],
        "finish_reason": last_chunk["choices"][0]["finish_reason"],
    }
    return {
        **last_chunk,
        "object": "chat.completion",
        "choices": [choice],
        "usage": _usage([final.get("usage")]),
    }


@csrf_exempt
async def completions(request: HttpRequest) -> HttpResponse:
    return await _serve(
        request, _parse_completion, "text", _completion_chunk, _completion_whole, announces_role=False
    )


@csrf_exempt
async def chat_completions(request: HttpRequest) -> HttpResponse:
    return await _serve(request, _parse_chat, "messages", _chat_chunk, _chat_whole, announces_role=True)


EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})


def _parse_embeddings(body: dict[str, Any]) -> tuple[str, list[str], str]:
    model = _model(body, EMBEDDING_FIELDS)
    encoding = body.get("encoding_format")
    if encoding is None:  # absent or null; anything else is checked, false and "" included
        encoding = "float"
    if encoding not in ("float", "base64"):
        raise GatewayError(400, 'encoding_format must be "float" or "base64"')
    if body.get("dimensions") is not None:
        raise GatewayError(400, "dimensions is not supported: the model's own dimension is returned")
    return model, parse_text_inputs(body.get("input")), encoding


def _embedding_vector(encoded: str, encoding: str) -> str | list[float]:
    """The replica sends little-endian float32 in base64, which is the "base64" format itself."""
    return encoded if encoding == "base64" else decode_vector(encoded)


@csrf_exempt
async def embeddings(request: HttpRequest) -> HttpResponse:
    if request.method != "POST":
        return error_response(405, "use POST", headers={"Allow": "POST"})
    try:
        context = await authenticate(request.headers.get("Authorization"))
        model, inputs, encoding = _parse_embeddings(parse_json_body(request))
        handle = await dispatch(
            context=context,
            path_model=model,
            pin=request.headers.get("X-Version-Pin"),
            params={},
            inputs=inputs,
            kind=Model.Kind.EMBEDDING,
        )
    except GatewayError as exc:
        return error_response(exc.status, exc.message, headers=exc.headers)
    try:
        vectors, final = await handle.collect_vectors("embeddings", len(inputs))
    except GatewayError as exc:
        return failed_dispatch(handle, exc)
    return JsonResponse(
        {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": _embedding_vector(v, encoding)}
                for i, v in enumerate(vectors)
            ],
            "model": model,
            "usage": prompt_usage(final),
        },
        headers=handle.response_headers(),
    )
