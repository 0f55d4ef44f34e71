"""The SSE frames of a stream's text chunks, spliced: each choice's chunk is serialized once, with a
mark where its text goes, and each token's frame is the text's JSON between the two halves.

Most of a stream's chunks differ only in their text. Built as a dict and serialized whole
(`sse_frame`), each cost the event loop ~4.6 µs; spliced, ~0.4 µs (docs/architecture.md, "The event
loop's cost of a token"). The halves are cut from the stream's own frame of the chunk, so a spliced
frame is byte for byte the one it would make: a property test holds the two equal, for either
endpoint's chunks."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from serving.edge.openai_chunks import Chunk

_MARK = "\x00text\x00"
_MARK_JSON = json.dumps(_MARK)


class ChunkFrames:
    def __init__(self, chunk: Chunk, frame: Callable[[dict[str, Any]], bytes]) -> None:
        """`frame`: how the stream frames a chunk (with its "usage": null where it asked for usage)."""
        self._chunk = chunk
        self._frame = frame
        self._halves: dict[int, tuple[str, str]] = {}  # choice index -> the frame before and after the text

    def text(self, text: str, index: int = 0) -> bytes:
        """The frame of choice `index`'s chunk that carries `text` (not empty), no log probabilities and
        no finish_reason."""
        halves = self._halves.get(index)
        if halves is None:
            frame = self._frame(self._chunk(_MARK, None, None, index))
            before, mark, after = frame.decode().partition(_MARK_JSON)
            assert mark, "the chunk's serialized form holds its text"
            halves = self._halves[index] = (before, after)
        return f"{halves[0]}{json.dumps(text)}{halves[1]}".encode()
