"""OpenAI-compatible endpoints, so the `openai` client works with base_url=http://host/v1.

Features we do not implement (echo, images) are refused with a 400 rather than silently ignored (sent
as null, they read as absent, as every parameter does); n is served up to MAX_CHOICES.
response_format's JSON and JSON schemas are enforced by constrained decoding on the replica (docs/api.md,
"Structured outputs"); chat's tools are answered as OpenAI's tool calls, whole and streamed
(tool_answers.py, docs/api.md "Tools"). Log probabilities are the model's own (before temperature and
top-p), of each token decoded alone, as OpenAI's and vLLM's: completions' `logprobs` (0-5
alternatives), chat's `logprobs` and `top_logprobs` (0-20)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from registry.errors import error_response
from registry.models import Model
from serving.edge.chunk_frames import ChunkFrames
from serving.edge.error_fields import error_fields
from serving.edge.infer_api import failed_dispatch
from serving.edge.openai_bodies import ChatRequest, parse_chat, parse_completion, parse_embeddings
from serving.edge.openai_chunks import (
    Chunk,
    chat_chunk,
    chat_whole,
    choices_usage,
    completion_chunk,
    completion_whole,
    embedding_vector,
    finish_reason,
    tool_call_chunks,
)
from serving.edge.request_bodies import parse_json_body
from serving.edge.sse import sse_frame, sse_response
from serving.edge.tool_answers import ChoiceAnswer, ChoiceStream, answer
from serving.edge.tool_calls import ToolRequest
from serving.gateway.dispatch import authenticate, dispatch, dispatch_choices, prompt_usage
from serving.gateway.errors import GatewayError
from serving.gateway.in_flight import InFlightRequest, close_all
from serving.gateway.results import collect, collect_vectors
from serving.gateway.service_tiers import grant_tier


async def _stream(
    handles: list[InFlightRequest],
    chunk: Chunk,
    include_usage: bool,
    *,
    announces_role: bool,
    tools: ToolRequest | None = None,
) -> AsyncIterator[bytes]:
    """The choices' chunks as their events come. As OpenAI's and vLLM's, a choice's first chunk goes out
    with its first token (or its end), not when a replica accepts it: a client that times the first
    chunk, as load tools do, would otherwise count a request still waiting in the queue as answered.
    `announces_role` (chat): each choice opens with the assistant's role, chunk(None, None, None,
    index), all of them in index order when the first event of any comes (a token, its text held back
    or not, or its end), as vLLM sends them with the engine's first output. `tools` (chat): each
    choice's text goes through a ChoiceStream of its own, which holds back what may be calls and ends
    the choice with them."""

    def sse(payload: dict[str, Any]) -> bytes:
        # With include_usage every chunk but the last carries "usage": null, as OpenAI documents.
        return sse_frame({**payload, "usage": None} if include_usage else payload)

    frames = ChunkFrames(chunk, sse)  # a token's text chunk, spliced into its frame
    unannounced = set(range(len(handles))) if announces_role else set()
    choices = [ChoiceStream(tools) for _ in handles]
    try:
        for handle in handles:  # the task to cut off is this one, not those _events reads choices in
            handle.set_reader(asyncio.current_task())
        usages: list[dict[str, Any] | None] = []
        async for index, event in _events(handles):
            # Every choice opens at the first event of any, in index order, as vLLM's do: the openai
            # client's stream accumulation places a choice where it first arrives, so a choice 1 that
            # came before choice 0 would take choice 0's place.
            for opened in sorted(unannounced):
                opening = chunk(None, None, None, opened)
                if choices[opened].may_call:  # as OpenAI opens a choice that may be calls: content null
                    opening["choices"][0]["delta"]["content"] = None
                yield sse(opening)
            unannounced.clear()
            if "token" in event:
                # A token whose text is held back (it may start a stop string) still sends its logprob.
                text = choices[index].feed(event["token"])
                logprob = event.get("logprob")
                if text and not logprob:
                    yield frames.text(text, index)
                elif text or "logprob" in event:
                    yield sse(chunk(text, None, [logprob] if logprob else None, index))
            elif event.get("finish_reason") == "error":
                # The choice ends with finish_reason "error"; the error object is what the openai client
                # raises on (APIError) instead of taking the stream as finished. The other choices end
                # with it: their sequences are aborted.
                error = event.get("error", {"type": "internal_error", "message": "failed"})
                yield sse({**chunk(None, "error", None, index), "error": error})
                break
            else:
                end = choices[index].finish(finish_reason(event))
                if end.content:
                    yield sse(chunk(end.content, None, None, index))
                for part in tool_call_chunks(chunk, end.calls, index):
                    yield sse(part)
                yield sse(chunk(None, end.finish_reason, None, index))
                usages.append(event.get("usage"))
        else:
            if include_usage:
                yield sse_frame({**chunk(None, None, None), "choices": [], "usage": choices_usage(usages)})
        yield b"data: [DONE]\n\n"
    finally:
        for handle in handles:  # a cut-off from here on closes its handle, not this closing
            handle.set_reader(None)
        await close_all(handles)


async def _events(handles: list[InFlightRequest]) -> AsyncIterator[tuple[int, dict[str, Any]]]:
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


async def _collect(
    handles: list[InFlightRequest], logprobs: list[list[dict[str, Any]] | None]
) -> list[tuple[str, dict[str, Any]]]:
    """Every choice's text and final event; the first failure (GatewayError) ends the others."""
    if len(handles) == 1:
        return [await collect(handles[0], logprobs=logprobs[0])]
    failure: GatewayError | None = None
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(collect(h, logprobs=lp)) for h, lp in zip(handles, logprobs, strict=True)
            ]
    except* GatewayError as errors:
        failure = errors.exceptions[0]  # type: ignore[assignment]
    if failure is not None:
        raise failure
    return [task.result() for task in tasks]


async def _serve(
    request: HttpRequest,
    parse: Callable[[dict[str, Any]], tuple[str, dict[str, Any], bool, Any]],
    payload_fields: Callable[[Any], tuple[dict[str, Any], ToolRequest | None]],
    make_chunk: Callable[[dict[str, Any]], Chunk],
    make_whole: Callable[[dict[str, Any], ChoiceAnswer, dict[str, Any]], dict[str, Any]],
    *,
    announces_role: bool,
) -> HttpResponse:
    """The shared body of both endpoints: parse, dispatch, then stream chunks or answer once.
    `payload_fields`: the parsed payload's fields for dispatch, and the tools its answers are read for.
    `announces_role`: whether a streamed choice opens with a chunk of its own (chat's assistant role)."""
    if request.method != "POST":
        return error_response(405, "use POST", headers={"Allow": "POST"})
    try:
        context = await authenticate(
            request.headers.get("Authorization"), client=request.META.get("REMOTE_ADDR")
        )
        model, sampling, include_usage, payload = parse(parse_json_body(request))
        fields, tools = payload_fields(payload)
        params = {k: v for k, v in sampling.items() if k not in ("stream", "n", "service_tier")}
        params["stop"] = list(params["stop"])
        service_tier = grant_tier(context, sampling["service_tier"])
        handles = await dispatch_choices(
            sampling["n"],
            context=context,
            path_model=model,
            pin=request.headers.get("X-Version-Pin"),
            params=params,
            service_tier=service_tier,
            **fields,
        )
    except GatewayError as exc:
        return error_response(exc.status, exc.message, headers=exc.headers, openai=error_fields(exc))
    handle = handles[0]
    base = {
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": f"{handle.model_name}:{handle.version}",
        "service_tier": service_tier,  # echoed, as OpenAI does, in every chunk and the whole response
        "request_id": handle.request_id,
    }
    chunk = make_chunk(base)
    if sampling["stream"]:
        stream = _stream(handles, chunk, include_usage, announces_role=announces_role, tools=tools)
        return sse_response(stream, handles)
    logprobs: list[list[dict[str, Any]] | None] = [[] if "logprobs" in sampling else None for _ in handles]
    try:
        results = await _collect(handles, logprobs)
    except GatewayError as exc:
        return failed_dispatch(handle, exc)
    wholes = []
    for i, (text, final) in enumerate(results):
        choice = answer(tools, text, finish_reason(final))  # text, or tool calls read from it
        wholes.append(make_whole(chunk(choice.content, choice.finish_reason, logprobs[i], i), choice, final))
    body = {**wholes[0], "choices": [whole["choices"][0] for whole in wholes]}
    if len(results) > 1:
        body["usage"] = choices_usage([final.get("usage") or {} for _, final in results])
    return JsonResponse(body, headers=handle.response_headers())


@csrf_exempt
async def completions(request: HttpRequest) -> HttpResponse:
    return await _serve(
        request, parse_completion, _prompt_fields, completion_chunk, completion_whole, announces_role=False
    )


@csrf_exempt
async def chat_completions(request: HttpRequest) -> HttpResponse:
    return await _serve(request, parse_chat, _chat_fields, chat_chunk, chat_whole, announces_role=True)


def _prompt_fields(prompt: str) -> tuple[dict[str, Any], ToolRequest | None]:
    return {"text": prompt}, None


def _chat_fields(chat: ChatRequest) -> tuple[dict[str, Any], ToolRequest | None]:
    return chat.dispatch_fields(), chat.tools


@csrf_exempt
async def embeddings(request: HttpRequest) -> HttpResponse:
    if request.method != "POST":
        return error_response(405, "use POST", headers={"Allow": "POST"})
    try:
        context = await authenticate(
            request.headers.get("Authorization"), client=request.META.get("REMOTE_ADDR")
        )
        model, inputs, encoding = parse_embeddings(parse_json_body(request))
        handle = await dispatch(
            context=context,
            path_model=model,
            pin=request.headers.get("X-Version-Pin"),
            params={},
            inputs=inputs,
            kind=Model.Kind.EMBEDDING,
        )
    except GatewayError as exc:
        return error_response(exc.status, exc.message, headers=exc.headers, openai=error_fields(exc))
    try:
        vectors, final = await collect_vectors(handle, "embeddings", len(inputs))
    except GatewayError as exc:
        return failed_dispatch(handle, exc)
    return JsonResponse(
        {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": embedding_vector(v, encoding)}
                for i, v in enumerate(vectors)
            ],
            "model": model,
            "usage": prompt_usage(final),
        },
        headers=handle.response_headers(),
    )
