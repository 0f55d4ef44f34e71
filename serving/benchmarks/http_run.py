"""A load run over HTTP, whatever the API: the requests sent, each one's record and outcome, and the
run's spans, which `bench serve`'s report summarises (serve_bench.py for the platform's own streaming
API, openai_load.py for an OpenAI-compatible one)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

from serving.benchmarks.workload import RequestRecord

REQUEST_TIMEOUT_S = 600.0

# A stream that ended as a served one does (its finish_reason, usage and [DONE]) whose tokens decoded to
# no text at all: a model that emits bytes which never make a character (a random one can, greedily, for
# a whole stream; vLLM sends the same empty chunks for them). It has no first token a user saw, so no
# latency, but the server did generate every token its usage counts.
SERVED_WITHOUT_TEXT = "incomplete_no_text"


@dataclass(slots=True, frozen=True)
class TextRequest:
    request_id: str
    arrival_s: float
    text: str
    max_tokens: int


@dataclass(slots=True)
class HttpRun:
    records: list[RequestRecord]  # one per request sent, whatever its outcome; complete ones were "200"
    inter_token_s: list[float]  # the gaps between tokens of complete requests
    # One outcome per request: "200" for a complete stream; otherwise the status refused, the exception
    # that ended it, "stream_error" (a final event with finish_reason "error"), or why a 200 stream
    # ended incomplete (stream_outcome).
    statuses: Counter[str] = field(default_factory=Counter)
    # (sent, ended) per request, whatever its outcome, in seconds since the run's start.
    spans_s: list[tuple[float, float]] = field(default_factory=list)
    # The replica's own TTFT per request id (from the gateway's submission to the first token), which
    # the final event's timings carry.
    replica_ttft_s: dict[str, float] = field(default_factory=dict)
    # And its wait before the first forward pass that held the request, from the same submission.
    replica_queue_s: dict[str, float] = field(default_factory=dict)
    send_lateness_s: list[float] = field(default_factory=list)  # sent - scheduled arrival, per request
    prompt_tokens: list[int] = field(default_factory=list)  # as the final event's usage counts them
    num_ended_early: int = 0  # streams the model ended (EOS, a stop string) before their max_tokens
    # The output tokens (by usage) of streams SERVED_WITHOUT_TEXT: counted in the throughput as the
    # engine alone counts them, so that the share kept compares the same work.
    num_textless_output_tokens: int = 0

    async def send_when_due(self, request: TextRequest, t0: float) -> RequestRecord:
        """Waits for the request's arrival time, then starts its record. TTFT counts from the moment it
        is sent, as vLLM's serving benchmark counts it: a timer that fires late on a loaded machine
        delays the load generator, not the platform."""
        await asyncio.sleep(max(0.0, t0 + request.arrival_s - time.perf_counter()))
        record = RequestRecord(request.request_id, time.perf_counter() - t0, request.max_tokens)
        self.send_lateness_s.append(record.arrival_s - request.arrival_s)
        self.records.append(record)
        return record

    def end(
        self, request: TextRequest, record: RequestRecord, outcome: str, t0: float, gaps_s: list[float]
    ) -> None:
        """The request's one outcome, once its response ended: its inter-token gaps count only if it
        completed, and a request that did not complete has no finish, whatever it received."""
        self.spans_s.append((record.arrival_s, time.perf_counter() - t0))
        self.statuses[outcome] += 1  # once per request: a 200 whose stream then failed counts as its failure
        if outcome == SERVED_WITHOUT_TEXT:
            self.num_textless_output_tokens += record.num_output_tokens
        if outcome != "200":
            record.finished_s = None
            return
        self.inter_token_s.extend(gaps_s)
        if record.max_tokens < request.max_tokens:
            self.num_ended_early += 1

    @property
    def duration_s(self) -> float:
        """The run's duration, which every throughput divides by: from the first send to the end of the
        last request to end, whatever its outcome."""
        if not self.spans_s:
            return 0.0
        return max(end for _, end in self.spans_s) - min(sent for sent, _ in self.spans_s)


def stream_outcome(record: RequestRecord, finish_reason: str | None, *, is_sse: bool = True) -> str:
    """A 200 stream's outcome once read to its end: "200" when it completed, or why it did not. A stream
    the model ended ("stop": EOS or a stop string) before its max_tokens completes at the length it
    reached (record.max_tokens becomes that), so that its latencies count rather than only the longest
    streams'; a stream cut by the context's end ("length") or aborted does not."""
    if finish_reason is None:
        return "incomplete_no_final_event" if is_sse else "incomplete_not_sse"
    if finish_reason == "error":
        return "stream_error"
    if finish_reason == "stop":
        record.end_where_the_model_ended()
    if record.is_complete:
        return "200"
    if record.num_output_tokens < record.max_tokens:
        return f"incomplete_finished_{finish_reason}"  # before its max_tokens
    if record.num_output_tokens > record.max_tokens:
        return "incomplete_too_many_tokens"
    return "incomplete_out_of_order"  # the final event before a token
