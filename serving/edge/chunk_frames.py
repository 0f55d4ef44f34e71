"""The SSE frames of a stream's text chunks, spliced: each choice's chunk is serialized once, with a
mark where its text goes, and each token's frame is the text's JSON between the two halves.

Most of a stream's chunks differ only in their text. Built as a dict and serialized whole
(`sse_frame`), each cost the event loop ~4.6 µs; spliced, ~0.4 µs (docs/architecture.md, "The event
loop's cost of a token"). A frame is byte for byte what sse_frame makes of the same chunk: a property
test holds the two equal, for either endpoint's chunks."""

from __future__ import annotations

import json

from serving.edge.openai_chunks import Chunk
from serving.edge.sse import sse_frame

_MARK = "\x00text\x00"
_MARK_JSON = json.dumps(_MARK)


class ChunkFrames:
    def __init__(self, chunk: Chunk, *, include_usage: bool) -> None:
        self._chunk = chunk
        self._include_usage = include_usage
        self._halves: dict[int, tuple[str, str]] = {}  # choice index -> the frame before and after the text

    def text(self, text: str, index: int = 0) -> bytes:
        """The frame of choice `index`'s chunk that carries `text` (not empty), no log probabilities and
        no finish_reason."""
        halves = self._halves.get(index)
        if halves is None:
            payload = self._chunk(_MARK, None, None, index)
            if self._include_usage:  # every chunk but the last carries "usage": null (openai_api.py)
                payload = {**payload, "usage": None}
            before, mark, after = sse_frame(payload).decode().partition(_MARK_JSON)
            assert mark, "the chunk's serialized form holds its text"
            halves = self._halves[index] = (before, after)
        return f"{halves[0]}{json.dumps(text)}{halves[1]}".encode()
