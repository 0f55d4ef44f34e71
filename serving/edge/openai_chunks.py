"""The OpenAI response shapes: a streamed chunk of either endpoint, chat's tool-call deltas, the whole
response assembled from a choice's last chunk and its answer, usage over the choices, log probabilities
as OpenAI renders them, and an embedding vector in either encoding."""

from __future__ import annotations

import codecs
from typing import Any, Protocol

from serving.edge.tool_answers import ChoiceAnswer
from serving.edge.tool_calls import ToolCall
from serving.transport.vectors import decode_vector


def finish_reason(event: dict[str, Any]) -> str:
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


def choices_usage(usages: list[dict[str, Any] | None]) -> dict[str, Any]:
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


def completion_chunk(base: dict[str, Any]) -> Chunk:
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


def chat_chunk(base: dict[str, Any]) -> Chunk:
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


def tool_call_chunks(chunk: Chunk, calls: tuple[ToolCall, ...], index: int) -> list[dict[str, Any]]:
    """A choice's calls as OpenAI streams them: for each, a delta that opens it (its index among the
    choice's calls, id, type and name, arguments "") and one with its arguments, which a client appends
    to the call of that index (the openai client's stream accumulation does)."""
    chunks = []
    for position, call in enumerate(calls):
        opening = {
            "index": position,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        arguments = {"index": position, "function": {"arguments": call.arguments}}
        for delta in (opening, arguments):
            shaped = chunk("", None, None, index)
            shaped["choices"][0]["delta"] = {"tool_calls": [delta]}
            chunks.append(shaped)
    return chunks


def completion_whole(
    last_chunk: dict[str, Any], answer: ChoiceAnswer, final: dict[str, Any]
) -> dict[str, Any]:
    return {**last_chunk, "usage": choices_usage([final.get("usage")])}


def chat_whole(last_chunk: dict[str, Any], answer: ChoiceAnswer, final: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.calls:
        message["tool_calls"] = [call.to_openai() for call in answer.calls]
    choice = {
        "index": last_chunk["choices"][0]["index"],
        "message": message,
        "logprobs": last_chunk["choices"][0]["logprobs"],
        "finish_reason": last_chunk["choices"][0]["finish_reason"],
    }
    return {
        **last_chunk,
        "object": "chat.completion",
        "choices": [choice],
        "usage": choices_usage([final.get("usage")]),
    }


def embedding_vector(encoded: str, encoding: str) -> str | list[float]:
    """The replica sends little-endian float32 in base64, which is the "base64" format itself."""
    return encoded if encoding == "base64" else decode_vector(encoded)
