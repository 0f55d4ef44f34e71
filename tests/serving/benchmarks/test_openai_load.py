"""`bench serve --api openai`: streams of /v1/completions read as the load generator must read them to
compare servers fairly: tokens from usage (never chunks), TTFT at the first chunk with text, a stream
complete only with its finish_reason, its usage and [DONE]; and the same figures as the native API."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from serving.benchmarks.http_run import TextRequest
from serving.benchmarks.openai_load import (
    CompletionStream,
    Usage,
    completion_outcome,
    read_stream,
    run_openai_load,
)
from serving.benchmarks.serve_bench import http_report, run_serve_from_options
from serving.benchmarks.serve_workload import summarize
from serving.benchmarks.workload import RequestRecord
from tests.serving.benchmarks.scripted_http import SSE_HEAD, ScriptedServer, chunk


def _event(text: str | None, finish_reason: str | None = None) -> bytes:
    """A completion chunk as vLLM sends one with include_usage ("usage": null until the last)."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    payload = {"id": "cmpl-1", "object": "text_completion", "choices": [choice], "usage": None}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _usage(completion_tokens: int, prompt_tokens: int = 5) -> bytes:
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    return b"data: " + json.dumps({"id": "cmpl-1", "choices": [], "usage": usage}).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def _stream(*pieces: bytes) -> list[bytes]:
    """A 200 event stream, each piece in a chunk of its own (a read of its own at the client)."""
    return [SSE_HEAD, *(chunk(piece) for piece in pieces), b"0\r\n\r\n"]


async def _timed(*events: tuple[bytes, float]) -> AsyncIterator[tuple[bytes, float]]:
    """Events as Response.sse_data yields them (their data, when read), at the times given."""
    for event, read_at in events:
        yield event.removeprefix(b"data: ").removesuffix(b"\n\n"), read_at


async def test_tokens_are_usages_not_chunks() -> None:
    # Both ask for 4 tokens: which reply answers which request is up to the connections.
    requests = [TextRequest("a", 0.0, "x", 4), TextRequest("b", 0.0, "y", 4)]
    replies = [
        # Four tokens, two of which end inside a character (vLLM's empty-text chunks); the last token's
        # chunk carries the finish_reason, as vLLM's does.
        _stream(_event("a"), _event(""), _event(""), _event("é", "length"), _usage(4), DONE),
        # Four tokens in two chunks (a server that fell behind merges them), then a bare finish chunk.
        _stream(_event("ab"), _event("cd"), _event("", "length"), _usage(4, prompt_tokens=9), DONE),
    ]
    server = ScriptedServer(replies)
    async with server.running():
        run = await run_openai_load(server.url, "k", "bench", requests)
    assert run.statuses == Counter({"200": 2})
    assert [(r.num_output_tokens, r.is_complete) for r in run.records] == [(4, True), (4, True)]
    assert sorted(run.prompt_tokens) == [5, 9]
    # Gaps between token chunks: three for the first stream, one for the second (not to its bare finish).
    assert len(run.inter_token_s) == 4
    summary = summarize(run, sla_ttft_s=60.0, sla_tpot_s=60.0)
    assert summary["output_tok_per_s"] == pytest.approx(8 / run.duration_s)


async def test_the_request_is_an_openai_completion_with_usage_asked_for() -> None:
    server = ScriptedServer([_stream(_event("a", "length"), _usage(1), DONE)] * 2)
    async with server.running():
        await run_openai_load(server.url, "sy-key", "bench", [TextRequest("r", 0.0, "hello there", 1)])
        await run_openai_load(server.url, "", "bench", [TextRequest("r", 0.0, "hello", 1)])
    with_key, without_key = server.requests
    head, _, body = with_key.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/completions HTTP/1.1")
    assert b"Authorization: Bearer sy-key" in head
    assert json.loads(body) == {
        "model": "bench",
        "prompt": "hello there",
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert b"authorization" not in without_key.lower()  # vLLM takes no key


async def test_ttft_is_the_first_chunk_with_text_and_tpot_runs_to_the_last_token() -> None:
    stream = await read_stream(
        _timed(
            (_event(""), 10.5),  # a token, but nothing a user sees yet
            (_event("a"), 11.0),
            (_event(""), 11.2),
            (_event("b"), 11.5),
            (_event("", "length"), 11.9),  # a bare finish chunk: no token, not the end of the last
            (_usage(4), 11.9),
            (DONE, 12.0),
        )
    )
    assert stream.first_text_at == 11.0
    assert stream.gaps_s == pytest.approx([0.2, 0.3])
    record = RequestRecord("r", arrival_s=0.5, max_tokens=4)
    assert completion_outcome(stream, record, t0=10.0, is_sse=True) == "200"
    assert record.ttft_s == pytest.approx(0.5)  # sent at 10.5, first text at 11.0
    assert record.num_output_tokens == 4
    assert record.time_per_output_token_s == pytest.approx(0.5 / 3)  # 11.0 to 11.5, three more tokens


async def test_a_stream_without_done_or_usage_or_text_is_incomplete() -> None:
    requests = [TextRequest(f"req-{i}", 0.0, "x", 2) for i in range(5)]
    replies = [
        _stream(_event("a"), _event("b", "length"), _usage(2), DONE),  # complete
        _stream(_event("a"), _event("b", "length"), _usage(2)),  # cut before [DONE]
        _stream(_event("a"), _event("b", "length"), DONE),  # no usage: its tokens are unknown
        _stream(_event("a"), _event("b"), _usage(2), DONE),  # no finish_reason
        _stream(_event(""), _event("", "length"), _usage(2), DONE),  # tokens, but no text ever
    ]
    server = ScriptedServer(replies)
    async with server.running():
        run = await run_openai_load(server.url, "k", "bench", requests)
    assert run.statuses == Counter(
        {
            "200": 1,
            "incomplete_no_done": 1,
            "incomplete_no_usage": 1,
            "incomplete_no_final_event": 1,
            "incomplete_no_text": 1,
        }
    )
    assert sum(r.is_complete for r in run.records) == 1
    assert [r.finished_s is None for r in run.records].count(True) == 4
    assert len(run.inter_token_s) == 1  # the complete stream's one gap; the others' are dropped
    # The stream with no text was served all the same: its tokens count in the throughput (the engine
    # alone's figure counts them too), not in any latency.
    summary = summarize(run, sla_ttft_s=60.0, sla_tpot_s=60.0)
    assert summary["output_tok_per_s"] == pytest.approx((2 + 2) / run.duration_s)
    assert summary["complete"] == 1


async def test_usage_short_of_max_tokens_is_incomplete_unless_the_model_stopped() -> None:
    requests = [TextRequest("cut", 0.0, "x", 3), TextRequest("eos", 0.0, "y", 3)]
    replies = [
        # Chunks for three tokens, but usage says two: usage is what counts.
        _stream(_event("a"), _event("b"), _event("c", "length"), _usage(2), DONE),
        _stream(_event("a"), _event("b", "stop"), _usage(2), DONE),
    ]
    server = ScriptedServer(replies)
    async with server.running():
        run = await run_openai_load(server.url, "k", "bench", requests)
    assert run.statuses == Counter({"incomplete_finished_length": 1, "200": 1})
    assert run.num_ended_early == 1


async def test_refusals_and_errors_are_outcomes() -> None:
    requests = [TextRequest(f"req-{i}", 0.0, "x", 1) for i in range(4)]
    replies = [
        [b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 2\r\n\r\n", b"{}"],
        # vLLM's error mid-stream: an `error` object, then [DONE].
        _stream(_event("a"), b'data: {"error": {"message": "boom", "code": 500}}\n\n', DONE),
        # Ours: a choice that finishes with "error", and its error object.
        _stream(
            b'data: {"choices": [{"text": "", "finish_reason": "error"}], "error": {"message": "x"}}\n\n',
            DONE,
        ),
        _stream(b"data: not json\n\n"),
    ]
    server = ScriptedServer(replies)
    async with server.running():
        run = await run_openai_load(server.url, "k", "bench", requests)
    assert run.statuses == Counter({"429": 1, "stream_error": 2, "JSONDecodeError": 1})
    assert not any(r.is_complete for r in run.records)
    report = http_report(run, summarize(run, sla_ttft_s=1.0, sla_tpot_s=1.0), sla_ttft_s=1.0, sla_tpot_s=1.0)
    assert "'429': 1" in report and "NOT met" in report


def test_completion_outcome_takes_tokens_only_with_a_finish() -> None:
    stream = CompletionStream(first_text_at=1.0, token_times=[1.0], usage=Usage(3, 1), is_done=True)
    record = RequestRecord("r", 0.0, max_tokens=1)
    assert completion_outcome(stream, record, t0=0.0, is_sse=True) == "incomplete_no_final_event"
    assert not record.is_complete


@pytest.fixture
def scripted_in_thread() -> Iterator[ScriptedServer]:
    """A ScriptedServer on a loop of its own thread, for code that runs asyncio.run itself."""
    usage_stream = _stream(_event("a"), _event("b", "length"), _usage(2), DONE)
    server = ScriptedServer([usage_stream] * 3)
    loop = asyncio.new_event_loop()
    started, stop = threading.Event(), asyncio.Event()

    async def serve() -> None:
        async with server.running():
            started.set()
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(10)
    yield server
    loop.call_soon_threadsafe(stop.set)
    thread.join(10)
    loop.close()


def _url_options(url: str, **overrides: object) -> dict[str, object]:
    """bench serve's options for 3 short requests against `url` through the OpenAI API."""
    return {
        "url": url,
        "key": "",
        "model": "bench",
        "api": "openai",
        "num_requests": 3,
        "prompt_words": "2-4",
        "output_len": "2-2",
        "rate": None,
        "seed": 0,
        "sla_ttft_ms": 60_000.0,
        "sla_tpot_ms": 60_000.0,
        "compare": False,
        **overrides,
    }


def test_bench_serve_dispatches_api_openai_and_prints_the_native_figures(
    scripted_in_thread: ScriptedServer,
) -> None:
    options = _url_options(scripted_in_thread.url)
    report = run_serve_from_options(options, default_model_dir=Path("unused"))
    assert all(b"POST /v1/completions " in request for request in scripted_in_thread.requests)
    assert "output_tok_per_s" in report and "p99_ttft_ms" in report
    assert "outcomes (one per request): {'200': 3}" in report
    assert "prompt tokens (the server's count): min 5, p50 5, max 5" in report
    assert "TTFT outside the replica" not in report  # no replica timings in OpenAI's stream
    with pytest.raises(ValueError, match="--api openai goes with --url"):
        run_serve_from_options({**options, "compare": True}, default_model_dir=Path("unused"))


def test_engine_alone_runs_the_same_requests_afterwards_and_says_the_share_kept(
    scripted_in_thread: ScriptedServer, demo_model_dir: Path
) -> None:
    options = _url_options(scripted_in_thread.url, engine_alone=str(demo_model_dir))
    lines: list[str] = []
    report = run_serve_from_options(options, default_model_dir=Path("unused"), log=lines.append)
    assert any("the same 3 requests through the engine alone" in line for line in lines)
    kept = report.splitlines()[-1]
    assert kept.startswith("engine alone (as bench engine runs it") and "the platform kept" in kept
    assert float(kept.rsplit("kept ", 1)[1].removesuffix("% of it")) > 0
