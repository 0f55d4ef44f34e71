"""The request parsers and the stream framing, fuzzed (hypothesis, bounded: FUZZ_EXAMPLES each): whatever
JSON a client sends, a parser returns a request or refuses it with a 4xx GatewayError, never anything
else (which would be a 500); and every SSE frame is one `data:` line that reads back as what was sent
(docs/reliability.md, "Fuzzing")."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.edge.openai_bodies import parse_chat, parse_completion, parse_embeddings
from serving.edge.request_bodies import loads_json, parse_classify, parse_infer
from serving.edge.sse import sse_frame
from serving.gateway.errors import GatewayError

FUZZ_EXAMPLES = 200

# JSON values, with the field names the parsers look for more often than chance would give them.
FIELDS = [
    "input", "inputs", "prompt", "messages", "model", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "stop", "seed", "stream", "stream_options", "logprobs", "top_logprobs", "logit_bias",
    "presence_penalty", "frequency_penalty", "n", "role", "content", "encoding_format", "user", "ignore_eos",
    "tools", "tool_choice", "parallel_tool_calls", "tool_calls", "tool_call_id", "type", "function", "name",
    "arguments", "parameters",
]  # fmt: skip
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), children, max_size=6)
    ),
    max_leaves=25,
)
bodies = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), values, max_size=10)

PARSERS: dict[str, Callable[[dict[str, Any]], object]] = {
    "infer": parse_infer,
    "classify": parse_classify,
    "completion": parse_completion,
    "chat": parse_chat,
    "embeddings": parse_embeddings,
}


@pytest.mark.parametrize("name", sorted(PARSERS))
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies)
def test_a_parser_returns_a_request_or_a_4xx_for_any_json(name: str, body: dict[str, Any]) -> None:
    try:
        PARSERS[name](body)
    except GatewayError as exc:
        assert 400 <= exc.status < 500 and exc.message


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_a_body_that_is_not_json_is_a_400(raw: bytes) -> None:
    try:
        loads_json(raw)
    except GatewayError as exc:
        assert exc.status == 400
    except ValueError:
        pass  # the caller's 400 (serving/edge/websocket.py, parse_json_body)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(payload=st.dictionaries(st.text(max_size=10), st.text() | st.integers() | st.none(), max_size=5))
def test_an_sse_frame_is_one_data_line_that_reads_back(payload: dict[str, Any]) -> None:
    frame = sse_frame(payload)
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    line = frame[len(b"data: ") : -2]
    assert b"\n" not in line and b"\r" not in line  # a newline in a token cannot end the event early
    assert json.loads(line) == payload


@pytest.mark.django_db(transaction=True)
async def test_a_websocket_fed_junk_messages_answers_each_and_still_serves(acme) -> None:
    """A hundred JSON messages of random shape on one authenticated socket (seeded): none closes it or
    breaks it (an exception there would close it 1011), and a well-formed request after them streams."""
    import random

    from channels.testing import WebsocketCommunicator

    from config.asgi import application

    rng = random.Random(0)

    def junk(depth: int = 0) -> Any:
        kind = rng.randrange(7 if depth < 2 else 5)
        if kind == 0:
            return None
        if kind == 1:
            return rng.choice([True, False, 0, -1, 2**70, 1e308, -0.5])
        if kind == 2:
            return "".join(rng.choice('ab\n\u00e9\u0000{}"') for _ in range(rng.randrange(8)))
        if kind == 3:
            return rng.randrange(-5, 5000)
        if kind == 4:
            return rng.random() * 10
        if kind == 5:
            return [junk(depth + 1) for _ in range(rng.randrange(4))]
        return {rng.choice(FIELDS): junk(depth + 1) for _ in range(rng.randrange(5))}

    auth = [(b"authorization", f"Bearer {acme.key}".encode())]
    socket = WebsocketCommunicator(application, "/v1/models/demo-chat/stream", headers=auth)
    connected, _ = await socket.connect(timeout=10)
    assert connected
    for _ in range(100):
        message = {rng.choice(FIELDS): junk() for _ in range(rng.randrange(6))}
        message["type"] = rng.choice(
            ["infer", "cancel", "nope", 7]
        )  # "auth" with junk closes it, as it should
        await socket.send_json_to(message)
    await socket.send_json_to({"type": "cancel"})
    await socket.send_json_to({"type": "infer", "input": "hello", "max_tokens": 3, "temperature": 0})
    seen: list[dict[str, Any]] = []
    while not (
        seen and seen[-1].get("type") == "done" and seen[-1].get("usage", {}).get("completion_tokens") == 3
    ):
        seen.append(await socket.receive_json_from(timeout=30))  # the junk's answers first, then the stream
    assert {m["type"] for m in seen} <= {"error", "token", "done"}
    await socket.disconnect()
