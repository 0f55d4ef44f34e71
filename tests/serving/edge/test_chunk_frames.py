"""A stream's text chunks, spliced (serving/edge/chunk_frames.py), are the very bytes of the chunk
built as a dict and serialized whole: for either endpoint, any text (quotes, backslashes, control
characters, characters beyond the BMP, the splice's own mark), any choice, with usage or without."""

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from serving.edge.chunk_frames import ChunkFrames
from serving.edge.openai_chunks import chat_chunk, completion_chunk
from serving.edge.sse import sse_frame


def _base() -> dict[str, Any]:
    return {
        "created": 1765100000,
        "model": "chat-model@stable",
        "system_fingerprint": "chat-model:v2",
        "service_tier": "default",
        "request_id": "0f3c5e2a9b8d4c7e",
    }


def _framing(include_usage: bool) -> Any:
    """As openai_api's streams frame a chunk: "usage": null in each where the client asked for usage."""
    return lambda payload: sse_frame({**payload, "usage": None} if include_usage else payload)


def _whole(chunk: Any, text: str, index: int, include_usage: bool) -> bytes:
    return _framing(include_usage)(chunk(text, None, None, index))


texts = st.text(min_size=1) | st.sampled_from(['"', "\\", "\x00text\x00", "é", "😀", "\n\r\t", "</script>"])


@given(
    texts=st.lists(texts, min_size=1, max_size=6),
    index=st.integers(min_value=0, max_value=3),
    include_usage=st.booleans(),
    chat=st.booleans(),
)
def test_a_spliced_frame_is_the_chunk_serialized_whole(
    texts: list[str], index: int, include_usage: bool, chat: bool
) -> None:
    make = chat_chunk if chat else completion_chunk
    frames = ChunkFrames(make(_base()), _framing(include_usage))
    whole = make(_base())
    for text in texts:  # later frames reuse the halves the first one cut
        assert frames.text(text, index) == _whole(whole, text, index, include_usage)


def test_each_choice_has_its_own_halves() -> None:
    frames = ChunkFrames(completion_chunk(_base()), _framing(False))
    whole = completion_chunk(_base())
    assert frames.text("a", 0) == _whole(whole, "a", 0, False)
    assert frames.text("b", 2) == _whole(whole, "b", 2, False)
    assert b'"index":2' in frames.text("c", 2) and b'"index":0' in frames.text("c", 0)
