"""The OpenAI-shaped stream: when its chunks go out, and when a generation fails after its first
token."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from serving.edge.openai_api import _stream
from serving.edge.openai_chunks import chat_chunk, completion_chunk


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


def _base() -> dict[str, Any]:
    return {"created": 0, "model": "chat-model", "system_fingerprint": "chat-model:v2", "request_id": "r1"}


def _stream_of(make_chunk: Any, handles: list[Any], include_usage: bool = False) -> AsyncIterator[bytes]:
    """The stream of /v1/completions (completion_chunk) or /v1/chat/completions (chat_chunk)."""
    announces_role = make_chunk is chat_chunk  # as each endpoint calls it
    return _stream(handles, make_chunk(_base()), include_usage, announces_role=announces_role)


def _parse(parts: list[bytes]) -> list[Any]:
    events = [line.removeprefix("data: ") for line in b"".join(parts).decode().split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def _data_lines(make_chunk: Any, *handles: Any) -> list[Any]:
    handles = handles or (FailingHandle(),)
    parts = [part async for part in _stream_of(make_chunk, list(handles), include_usage=True)]
    assert all(handle.closed for handle in handles)
    return _parse(parts)


async def test_a_failed_completion_stream_ends_its_choice_with_an_error_and_says_which_version() -> None:
    *_, last = await _data_lines(completion_chunk)
    # finish_reason "error" for readers of the chunks; the error object is what the openai client raises on.
    assert last["choices"][0]["finish_reason"] == "error"
    assert last["error"] == {"type": "replica_lost", "message": "it stopped"}
    assert last["system_fingerprint"] == "chat-model:v2"


async def test_a_failed_chat_stream_ends_the_same_way() -> None:
    chunks = await _data_lines(chat_chunk)
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
    chunk = completion_chunk(base)
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
    content = chat_chunk(base)("x", None, entries)["choices"][0]["logprobs"]["content"]
    assert [bytes(e["bytes"]) for e in content] == [b" Snow", snowman[:1], snowman[1:]]
    assert content[1]["top_logprobs"] == [{"token": "\ufffd", "logprob": -0.5, "bytes": [snowman[0]]}]


def test_entries_from_a_replica_of_the_release_before_still_shape() -> None:
    """A rolling upgrade: no bytes, and [token, logprob] pairs for the alternatives."""
    base = {"created": 0, "model": "m", "system_fingerprint": "m:v1", "request_id": "r1"}
    old = [{"token": " a", "logprob": -0.1, "top": [[" a", -0.1], [" b", -2.0]]}]
    completion = completion_chunk(dict(base))(" a", None, old)["choices"][0]["logprobs"]
    assert completion["text_offset"] == [0] and completion["top_logprobs"] == [{" a": -0.1, " b": -2.0}]
    chat = chat_chunk(dict(base))(" a", None, old)["choices"][0]["logprobs"]["content"][0]
    assert chat["bytes"] == list(b" a") and chat["top_logprobs"][1]["bytes"] == list(b" b")


class FinishingHandle(FailingHandle):
    async def events(self) -> AsyncIterator[dict[str, Any]]:
        yield {"token": "Once", "index": 0}
        yield {"finish_reason": "length", "usage": {"prompt_tokens": 3, "completion_tokens": 1}}


async def test_with_include_usage_every_chunk_but_the_last_has_usage_null() -> None:
    """As OpenAI documents stream_options.include_usage: "All other chunks will also include a usage
    field, but with a null value"; without it, no chunk has the field."""
    for include_usage in (True, False):
        chunks = _parse([part async for part in _stream_of(chat_chunk, [FinishingHandle()], include_usage)])
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        if include_usage:
            *others, last = chunks
            assert last["choices"] == [] and last["usage"]["total_tokens"] == 4
            assert others and all("usage" in c and c["usage"] is None for c in others)
        else:
            assert not any("usage" in c for c in chunks)


class QueuedHandle(FailingHandle):
    """A request its replica accepted that waits in the queue until `admit()`, then generates two
    tokens; `queued` is set once the stream waits on it."""

    def __init__(self, *, first_token: str = " Once") -> None:
        self.queued, self._admitted = asyncio.Event(), asyncio.Event()
        self.first_token = first_token

    def admit(self) -> None:
        self._admitted.set()

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        self.queued.set()
        await self._admitted.wait()
        yield {"token": self.first_token, "index": 0}
        yield {"token": " upon", "index": 1}
        yield {"finish_reason": "length", "usage": {"prompt_tokens": 3, "completion_tokens": 2}}


@pytest.mark.parametrize("make_chunk", [completion_chunk, chat_chunk])
async def test_a_request_waiting_in_the_queue_gets_no_chunk_before_its_first_token(make_chunk: Any) -> None:
    """A client that times its first chunk (as load tools do) reads the time to the first token, not to
    the replica's acceptance: as OpenAI's and vLLM's, nothing goes out before it. Chat's role chunk
    comes with it, right before its text."""
    handle = QueuedHandle()
    stream = _stream_of(make_chunk, [handle])
    first = asyncio.ensure_future(anext(stream))
    queued = asyncio.ensure_future(handle.queued.wait())
    await asyncio.wait([first, queued], return_when=asyncio.FIRST_COMPLETED)
    assert handle.queued.is_set() and not first.done()  # the stream waits on the queue, having sent nothing
    handle.admit()
    chunks = _parse([await first, *[part async for part in stream]])
    choices = [chunk["choices"][0] for chunk in chunks]
    if make_chunk is completion_chunk:
        assert [(c["text"], c["finish_reason"]) for c in choices] == [
            (" Once", None),
            (" upon", None),
            ("", "length"),
        ]
    else:
        assert [(c["delta"], c["finish_reason"]) for c in choices] == [
            ({"role": "assistant", "content": ""}, None),
            ({"content": " Once"}, None),
            ({"content": " upon"}, None),
            ({}, "length"),
        ]


@pytest.mark.parametrize("make_chunk", [completion_chunk, chat_chunk])
async def test_each_choices_text_waits_for_its_own_first_event(make_chunk: Any) -> None:
    """n = 2, the second choice still queued when the first has ended: none of its text goes out before
    its own first token. Chat opens every choice with its role, in index order, at the first event of
    any (as vLLM does: the openai client's stream accumulation places a choice where it first arrives)."""
    ready, queued = QueuedHandle(), QueuedHandle(first_token=" Twice")
    ready.admit()
    stream = _stream_of(make_chunk, [ready, queued])
    opening = [await anext(stream) for _ in range(3 if make_chunk is completion_chunk else 5)]
    queued.admit()
    chunks = _parse([*opening, *[part async for part in stream]])
    choices = [chunk["choices"][0] for chunk in chunks]
    if make_chunk is completion_chunk:
        assert [(c["index"], c["text"] or c["finish_reason"]) for c in choices] == [
            (0, " Once"),
            (0, " upon"),
            (0, "length"),
            (1, " Twice"),
            (1, " upon"),
            (1, "length"),
        ]
    else:
        role = {"role": "assistant", "content": ""}
        assert [(c["index"], c["delta"] or c["finish_reason"]) for c in choices] == [
            (0, role),
            (1, role),
            (0, {"content": " Once"}),
            (0, {"content": " upon"}),
            (0, "length"),
            (1, {"content": " Twice"}),
            (1, {"content": " upon"}),
            (1, "length"),
        ]


class FailingAtOnceHandle(FailingHandle):
    """A request whose replica failed before its first token."""

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        yield {"finish_reason": "error", "error": {"type": "replica_lost", "message": "it stopped"}}


async def test_a_choice_that_fails_before_its_first_token_sends_only_its_error() -> None:
    """No empty completion chunk ahead of it; chat's choice still opens with its role, as every one
    that sends anything does."""
    (completion,) = await _data_lines(completion_chunk, FailingAtOnceHandle())
    assert (
        completion["choices"][0]["finish_reason"] == "error" and completion["error"]["type"] == "replica_lost"
    )
    role, error = await _data_lines(chat_chunk, FailingAtOnceHandle())
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert error["choices"][0]["finish_reason"] == "error" and error["usage"] is None


@pytest.mark.django_db(transaction=True)
async def test_the_openai_client_reads_no_empty_completion_chunk_and_each_chat_choice_opens_with_its_role(
    runtime: Any, make_tenant: Any, settings: Any
) -> None:
    """The `openai` package on the whole application, two choices each: every completion chunk carries
    text or the choice's end; each chat choice's first chunk is its role, and its next its text."""
    import httpx
    import openai
    from asgiref.sync import sync_to_async

    from config.asgi import application

    settings.ALLOWED_HOSTS = ["localhost"]
    acme = await sync_to_async(make_tenant)("acme", requests_per_second=100)
    transport = httpx.ASGITransport(app=application)
    async with httpx.AsyncClient(transport=transport) as http:
        # openai takes an httpx client too, though its newer type hints name only httpx2's.
        client = openai.AsyncOpenAI(base_url="http://localhost/v1", api_key=acme.key, http_client=http)  # type: ignore[arg-type]
        completions = await client.completions.create(
            model="demo-chat",
            prompt="hello",
            max_tokens=4,
            temperature=0,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        completion = [c async for c in completions]
        chats = await client.chat.completions.create(
            model="demo-chat",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            temperature=0,
            n=2,
            stream=True,
        )
        chat = [c async for c in chats]
    usage = completion[-1].usage
    assert completion[-1].choices == [] and usage is not None and usage.completion_tokens == 8
    choices = [c.choices[0] for c in completion[:-1]]
    assert all(c.text or c.finish_reason for c in choices)
    for index in (0, 1):
        ends = [c.finish_reason for c in choices if c.index == index]
        assert ends[0] is None and ends[1:] and ends[-1] == "length"  # text first, then the end
    for index in (0, 1):
        deltas = [c.choices[0].delta for c in chat if c.choices[0].index == index]
        assert (deltas[0].role, deltas[0].content) == ("assistant", "")
        assert deltas[1].role is None and deltas[1].content
        assert all(d.role is None for d in deltas[1:])
