"""The OpenAI-shaped stream when a generation fails after its first token."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from serving.openai_api import _chat_chunk, _completion_chunk, _stream


class FailingHandle:
    """A dispatched request whose replica died after one token."""

    closed = False

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        yield {"token": "Once", "index": 0}
        yield {"finish_reason": "error", "error": {"type": "replica_lost", "message": "it stopped"}}

    async def close(self) -> None:
        self.closed = True


async def _data_lines(make_chunk: Any) -> list[Any]:
    handle = FailingHandle()
    base = {"created": 0, "model": "chat-model", "system_fingerprint": "chat-model:v2", "request_id": "r1"}
    body = b"".join([part async for part in _stream(handle, make_chunk(base), include_usage=True)])  # type: ignore[arg-type]
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
