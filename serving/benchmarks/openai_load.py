"""`bench serve --api openai`: the same open-loop streaming load as the native API's, sent to an
OpenAI-compatible `/v1/completions` (ours, or a peer's such as vLLM's), so that two servers can be
measured side by side by one client with one set of figures.

Each request asks for `stream_options.include_usage`, and its output tokens are the final usage chunk's
`completion_tokens`, never a count of chunks: a chunk may carry several tokens (a server that falls
behind merges them) or none of their text (a token that ends inside a multi-byte character: vLLM sends
such chunks with empty text), so counting chunks undercounts, differently for each server
(the notes on peers, /work/shared/PEERS.md). TTFT is the first chunk that carries text, what a user sees.

The records and outcomes are the native load's own (http_run.py: HttpRun, stream_outcome), and so are
the figures (serve_bench's summarize and http_report): both APIs print the same table."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from serving.benchmarks.http_client import HttpClient, HttpProtocolError
from serving.benchmarks.http_run import (
    REQUEST_TIMEOUT_S,
    SERVED_WITHOUT_TEXT,
    HttpRun,
    TextRequest,
    stream_outcome,
)
from serving.benchmarks.workload import RequestRecord

COMPLETIONS_PATH = "/v1/completions"
_DONE = b"[DONE]"


@dataclass(slots=True, frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(slots=True, frozen=True)
class CompletionChunk:
    """One event of a completions stream, as much of it as the load needs."""

    read_at: float  # perf_counter when the bytes completing it were read
    text: str = ""  # choices[0].text
    has_choice: bool = False  # the usage chunk has none ("choices": [])
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None  # a server that fails mid-stream sends an `error` object in an event
    is_done: bool = False  # `data: [DONE]`, the stream's last event

    @property
    def carries_token(self) -> bool:
        """Whether a token arrived with it. A choice without text and without a finish_reason is still a
        token (vLLM's chunk for one that ends inside a character); a bare finish chunk (ours, after the
        last token) is not, so it does not add a short gap to one server's inter-token figures."""
        return self.has_choice and (bool(self.text) or self.finish_reason is None)


def parse_chunk(data: bytes, read_at: float) -> CompletionChunk:
    """An event's data. Raises ValueError (json's) for one that is not JSON, which the run counts as its
    outcome, as the native path does."""
    if data.strip() == _DONE:
        return CompletionChunk(read_at, is_done=True)
    event = json.loads(data)
    if not isinstance(event, dict):
        raise ValueError(f"a stream event that is not an object: {data[:80]!r}")
    usage = event.get("usage")
    parsed_usage = None
    if isinstance(usage, dict):
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            parsed_usage = Usage(prompt, completion)
    error = event.get("error")
    if isinstance(error, dict):
        error = error.get("message", error)
    choices = event.get("choices")
    # One choice per request here (no `n`); the usage chunk's list is empty.
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
    if choice is None:
        return CompletionChunk(read_at, usage=parsed_usage, error=None if error is None else str(error))
    finish_reason = choice.get("finish_reason")
    return CompletionChunk(
        read_at,
        text=str(choice.get("text") or ""),
        has_choice=True,
        finish_reason=None if finish_reason is None else str(finish_reason),
        usage=parsed_usage,
        error=None if error is None else str(error),
    )


@dataclass(slots=True)
class CompletionStream:
    """What one request's stream delivered, in perf_counter times; read by `read_stream`."""

    first_text_at: float | None = None
    # Every chunk carrying a token from the first text on: their gaps are the request's inter-token
    # latencies, and the last one is when its last token came (its end, for TPOT).
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    is_done: bool = False

    def add(self, chunk: CompletionChunk) -> None:
        if chunk.is_done:
            self.is_done = True
            return
        if chunk.error is not None:
            self.error = chunk.error
        if chunk.usage is not None:
            self.usage = chunk.usage
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        if chunk.text and self.first_text_at is None:
            self.first_text_at = chunk.read_at
        # Before the first text a token chunk carries nothing a user sees: TTFT has not happened yet.
        if chunk.carries_token and self.first_text_at is not None:
            self.token_times.append(chunk.read_at)

    @property
    def gaps_s(self) -> list[float]:
        return [
            later - earlier for earlier, later in zip(self.token_times, self.token_times[1:], strict=False)
        ]


async def read_stream(chunks: AsyncIterator[tuple[bytes, float]]) -> CompletionStream:
    stream = CompletionStream()
    async for data, read_at in chunks:
        stream.add(parse_chunk(data, read_at))
        if stream.is_done:  # nothing follows [DONE]; what does (a broken server) is not read
            break
    return stream


def completion_outcome(stream: CompletionStream, record: RequestRecord, t0: float, *, is_sse: bool) -> str:
    """The request's outcome once its stream ended; fills `record` from the stream. Complete ("200")
    needs a finish_reason, `[DONE]` and usage, and then what the native path's streams need
    (stream_outcome): usage's tokens equal to max_tokens, or fewer where the model stopped."""
    if stream.first_text_at is not None:
        record.first_token_s = stream.first_text_at - t0
    if stream.token_times:
        record.finished_s = stream.token_times[-1] - t0
    if stream.error is not None or stream.finish_reason == "error":
        return "stream_error"
    if stream.finish_reason is not None and stream.usage is not None:
        record.num_output_tokens = stream.usage.completion_tokens
    if stream.finish_reason is not None and not stream.is_done:
        return "incomplete_no_done"
    if stream.finish_reason is not None and stream.usage is None:
        return "incomplete_no_usage"
    if stream.finish_reason is not None and stream.first_text_at is None and record.num_output_tokens:
        return SERVED_WITHOUT_TEXT  # tokens by usage, but none a user could see: no TTFT to take
    return stream_outcome(record, stream.finish_reason, is_sse=is_sse)


async def _one(
    client: HttpClient, model: str, key: str, request: TextRequest, t0: float, run: HttpRun
) -> None:
    """One request, kept in `run` as serve_bench's native `_one` keeps its own."""
    record = await run.send_when_due(request, t0)
    body = {
        "model": model,
        "prompt": request.text,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {key}"} if key else {}  # vLLM, unconfigured, takes none
    stream = CompletionStream()
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S), client.post(COMPLETIONS_PATH, body, headers) as resp:
            if resp.status != 200:
                await resp.read()
                outcome = str(resp.status)
            else:
                stream = await read_stream(resp.sse_data())
                is_sse = resp.headers.get("content-type", "").startswith("text/event-stream")
                outcome = completion_outcome(stream, record, t0, is_sse=is_sse)
    except (OSError, asyncio.IncompleteReadError, HttpProtocolError, TimeoutError, ValueError) as exc:
        outcome = type(exc).__name__
    if stream.usage is not None:  # the server's count, complete or not, as the native path keeps it
        run.prompt_tokens.append(stream.usage.prompt_tokens)
    run.end(request, record, outcome, t0, stream.gaps_s)


async def run_openai_load(base_url: str, key: str, model: str, requests: Sequence[TextRequest]) -> HttpRun:
    """run_http_load's counterpart: the requests on `/v1/completions`, each at its arrival time."""
    run = HttpRun([], [])
    async with HttpClient(base_url, max_connections=len(requests) + 8) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(_one(client, model, key, r, t0, run) for r in requests))
    return run
