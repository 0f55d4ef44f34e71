"""The OpenAI-shaped stream when a generation fails after its first token."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from serving.openai_api import _chat_chunk, _completion_chunk, _stream


class FailingHandle:
    """A dispatched request whose replica died after one token."""

    closed = False

    def set_reader(self, reader: object) -> None:
        pass

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        yield {"token": "Once", "index": 0}
        yield {"finish_reason": "error", "error": {"type": "replica_lost", "message": "it stopped"}}

    async def close(self) -> None:
        self.closed = True


async def _data_lines(make_chunk: Any) -> list[Any]:
    handle = FailingHandle()
    base = {"created": 0, "model": "chat-model", "system_fingerprint": "chat-model:v2", "request_id": "r1"}
    body = b"".join([part async for part in _stream([handle], make_chunk(base), include_usage=True)])  # type: ignore[arg-type]
    assert handle.closed
    events = [line.removeprefix("data: ") for line in body.decode().split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_a_failed_completion_stream_ends_its_choice_with_an_error_and_says_which_version() -> None:
    *_, last = await _data_lines(_completion_chunk)
    # finish_reason "error" for readers of the chunks; the error object is what the openai client raises on.
    assert last["choices"][0]["finish_reason"] == "error"
    assert last["error"] == {"type": "replica_lost", "message": "it stopped"}
    assert last["system_fingerprint"] == "chat-model:v2"


async def test_a_failed_chat_stream_ends_the_same_way() -> None:
    chunks = await _data_lines(_chat_chunk)
    assert chunks[1]["choices"][0]["delta"] == {"content": "Once"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "error"
    assert chunks[-1]["error"]["type"] == "replica_lost"
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]) == 1  # one terminal


def _entry(raw: bytes) -> dict[str, Any]:
    text = raw.decode("utf-8", errors="replace")
    return {"token": text, "logprob": -0.5, "bytes": list(raw), "top": [[text, -0.5, list(raw)]]}


def test_text_offsets_count_characters_and_a_split_character_starts_where_it_does() -> None:
    """ " Snow ☃!": the snowman's three bytes come in three tokens, over two chunks of a stream. Each of
    them starts where the character does, and the offsets after it count it once."""
    base = {"created": 0, "model": "m", "system_fingerprint": "m:v1", "request_id": "r1"}
    chunk = _completion_chunk(base)
    snowman = "☃".encode()
    first = chunk(" Snow", None, [_entry(b" Snow"), _entry(b" "), _entry(snowman[:1])])
    second = chunk("☃!", "length", [_entry(snowman[1:2]), _entry(snowman[2:]), _entry(b"!")])
    offsets = first["choices"][0]["logprobs"]["text_offset"] + second["choices"][0]["logprobs"]["text_offset"]
    assert offsets == [0, 5, 6, 6, 6, 7]
    assert " Snow ☃!"[7] == "!"


def test_chat_logprobs_carry_each_tokens_own_bytes() -> None:
    base = {"created": 0, "model": "m", "system_fingerprint": "m:v1", "request_id": "r1"}
    snowman = "☃".encode()
    entries = [_entry(b" Snow"), _entry(snowman[:1]), _entry(snowman[1:])]
    content = _chat_chunk(base)("x", None, entries)["choices"][0]["logprobs"]["content"]
    assert [bytes(e["bytes"]) for e in content] == [b" Snow", snowman[:1], snowman[1:]]
    assert content[1]["top_logprobs"] == [{"token": "\ufffd", "logprob": -0.5, "bytes": [snowman[0]]}]


def test_entries_from_a_replica_of_the_release_before_still_shape() -> None:
    """A rolling upgrade: no bytes, and [token, logprob] pairs for the alternatives."""
    base = {"created": 0, "model": "m", "system_fingerprint": "m:v1", "request_id": "r1"}
    old = [{"token": " a", "logprob": -0.1, "top": [[" a", -0.1], [" b", -2.0]]}]
    completion = _completion_chunk(dict(base))(" a", None, old)["choices"][0]["logprobs"]
    assert completion["text_offset"] == [0] and completion["top_logprobs"] == [{" a": -0.1, " b": -2.0}]
    chat = _chat_chunk(dict(base))(" a", None, old)["choices"][0]["logprobs"]["content"][0]
    assert chat["bytes"] == list(b" a") and chat["top_logprobs"][1]["bytes"] == list(b" b")


class FinishingHandle(FailingHandle):
    async def events(self) -> AsyncIterator[dict[str, Any]]:
        yield {"token": "Once", "index": 0}
        yield {"finish_reason": "length", "usage": {"prompt_tokens": 3, "completion_tokens": 1}}


async def test_with_include_usage_every_chunk_but_the_last_has_usage_null() -> None:
    """As OpenAI documents stream_options.include_usage: "All other chunks will also include a usage
    field, but with a null value"; without it, no chunk has the field."""
    base = {"created": 0, "model": "chat-model", "system_fingerprint": "chat-model:v2", "request_id": "r1"}
    for include_usage in (True, False):
        stream = _stream([FinishingHandle()], _chat_chunk(dict(base)), include_usage=include_usage)  # type: ignore[list-item]
        body = b"".join([part async for part in stream])
        chunks = [json.loads(line.removeprefix("data: ")) for line in body.decode().split("\n\n")[:-2]]
        if include_usage:
            *others, last = chunks
            assert last["choices"] == [] and last["usage"]["total_tokens"] == 4
            assert others and all("usage" in c and c["usage"] is None for c in others)
        else:
            assert not any("usage" in c for c in chunks)
