"""`bench serve`'s load: texts of seeded lengths (fitted to a tokenizer's token counts where one is given),
sent over HTTP as a stream each, and summarized against the SLA."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from serving.benchmarks.http_client import HttpClient, HttpProtocolError
from serving.benchmarks.http_run import REQUEST_TIMEOUT_S, HttpRun, TextRequest, stream_outcome
from serving.benchmarks.workload import nearest_rank, percentile

# A fixed vocabulary of ordinary words, so prompt lengths in tokens vary little between runs.
_WORDS = (
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "models",
    "batch",
    "tokens",
    "across",
    "shared",
    "fleet",
    "every",
    "tenant",
    "keeps",
    "its",
    "latency",
    "promise",
    "under",
    "load",
)


# One token each in most tokenizers: what tops a prompt up to its length in tokens.
_FILLERS = ("a", "the", "I", "and")


WARM_UP_PREFIX = "Warm-up. "  # before a warm-up request's text: no measured prompt begins so


@dataclass(slots=True, frozen=True)
class LoadSpec:
    num_requests: int = 64  # unless duration_s is set
    rate_per_s: float | None = None  # None: every request at t=0 (saturation)
    # Prompt lengths, in words; in tokens as the served model's tokenizer counts them (special tokens
    # included, as the API's usage reports them) when make_text_workload is given count_tokens.
    min_prompt_len: int = 16
    max_prompt_len: int = 128
    min_output_tokens: int = 32
    max_output_tokens: int = 128
    seed: int = 0
    # With a rate: every request that arrives in the first duration_s seconds, instead of num_requests.
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if self.rate_per_s is not None and not self.rate_per_s > 0:  # NaN too
            raise ValueError(
                f"--rate must be a positive number of requests/s, got {self.rate_per_s} "
                "(leave it out to send every request at once)"
            )


def make_text_workload(spec: LoadSpec, count_tokens: Callable[[str], int] | None = None) -> list[TextRequest]:
    if spec.duration_s is not None and not (spec.rate_per_s and 0 < spec.duration_s < math.inf):
        raise ValueError("a duration needs a positive --rate (arrivals over time) and a positive --duration")
    if not 1 <= spec.min_prompt_len <= spec.max_prompt_len:
        raise ValueError(
            f"prompt lengths must be 1 <= low <= high, got {spec.min_prompt_len}-{spec.max_prompt_len}"
        )
    rng = random.Random(spec.seed)
    # Arrivals draw from their own stream, so the same seed gives the same prompts and lengths at any
    # rate, and all at once.
    arrival_rng = random.Random(f"arrivals-{spec.seed}")
    requests, arrival_s, index = [], 0.0, 0
    while spec.duration_s is not None or index < spec.num_requests:
        if spec.rate_per_s and index:
            arrival_s += arrival_rng.expovariate(spec.rate_per_s)
        if spec.duration_s is not None and arrival_s >= spec.duration_s:
            break
        length = rng.randint(spec.min_prompt_len, spec.max_prompt_len)
        words = [rng.choice(_WORDS) for _ in range(length)]
        if count_tokens is not None:
            words = _fit_to_tokens(words, length, count_tokens)
        max_tokens = rng.randint(spec.min_output_tokens, spec.max_output_tokens)
        requests.append(TextRequest(f"req-{index}", arrival_s, " ".join(words), max_tokens))
        index += 1
    return requests


def _fit_to_tokens(words: list[str], num_tokens: int, count_tokens: Callable[[str], int]) -> list[str]:
    """Words whose text is num_tokens tokens where the tokenizer allows: the longest prefix of `words`
    within num_tokens, then short filler words while they still fit. Every word is at least one token,
    so len(words) == num_tokens is enough, and a longer prefix never has fewer tokens than a shorter one,
    so a binary search finds the prefix."""
    low, high = 1, len(words)
    while low < high:
        middle = (low + high + 1) // 2
        if count_tokens(" ".join(words[:middle])) <= num_tokens:
            low = middle
        else:
            high = middle - 1
    words = words[:low]
    count = count_tokens(" ".join(words))
    while count < num_tokens:  # a multi-token word left a gap shorter than itself
        for filler in _FILLERS:
            longer = count_tokens(" ".join([*words, filler]))
            if longer <= num_tokens:
                words, count = [*words, filler], longer
                break
        else:
            break
    return words


async def _one(
    client: HttpClient, path: str, key: str, request: TextRequest, t0: float, run: HttpRun
) -> None:
    record = await run.send_when_due(request, t0)
    body = {"input": request.text, "max_tokens": request.max_tokens, "stream": True, "temperature": 0}
    last_token_at: float | None = None
    gaps: list[float] = []  # between this request's tokens: kept only if it completes
    finish_reason: str | None = None
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            async with client.post(path, body, {"Authorization": f"Bearer {key}"}) as resp:
                if resp.status != 200:
                    await resp.read()
                    outcome = str(resp.status)
                else:
                    async for data, read_at in resp.sse_data():
                        now = read_at - t0
                        event = json.loads(data)
                        if "token" in event:
                            record.num_output_tokens += 1
                            if record.first_token_s is None:
                                record.first_token_s = now
                            elif last_token_at is not None:
                                gaps.append(now - last_token_at)
                            last_token_at = now
                        elif "finish_reason" in event:
                            record.finished_s = now
                            finish_reason = str(event["finish_reason"])
                            timings = event.get("timings") or {}
                            for name, by_id in (
                                ("ttft_s", run.replica_ttft_s),
                                ("queue_s", run.replica_queue_s),
                            ):
                                if isinstance(timings.get(name), (int, float)):
                                    by_id[request.request_id] = float(timings[name])
                            prompt_tokens = (event.get("usage") or {}).get("prompt_tokens")
                            if isinstance(prompt_tokens, int):
                                run.prompt_tokens.append(prompt_tokens)
                    is_sse = resp.headers.get("content-type", "").startswith("text/event-stream")
                    outcome = stream_outcome(record, finish_reason, is_sse=is_sse)
    # ValueError: an event that is not JSON.
    except (OSError, asyncio.IncompleteReadError, HttpProtocolError, TimeoutError, ValueError) as exc:
        outcome = type(exc).__name__
    run.end(request, record, outcome, t0, gaps)


async def run_http_load(base_url: str, key: str, model: str, requests: Sequence[TextRequest]) -> HttpRun:
    run = HttpRun([], [])
    async with HttpClient(base_url, max_connections=len(requests) + 8) as client:
        t0 = time.perf_counter()
        path = f"/v1/models/{model}/infer"
        await asyncio.gather(*(_one(client, path, key, r, t0, run) for r in requests))
    return run


def summarize(run: HttpRun, *, sla_ttft_s: float, sla_tpot_s: float) -> dict[str, float]:
    """Latencies over the complete requests; every throughput (completed requests, their output tokens and
    those of streams served without text, goodput: requests within both SLOs, as vLLM defines it) per
    second of run.duration_s; and the SLA's p99s ("sla_p99_*", nearest rank) over every request sent, one
    that failed or did not complete missing both."""
    complete = [r for r in run.records if r.is_complete]
    num_output_tokens = sum(r.num_output_tokens for r in complete) + run.num_textless_output_tokens
    good = [
        r for r in complete if r.ttft_s <= sla_ttft_s and (r.time_per_output_token_s or 0.0) <= sla_tpot_s
    ]
    ttfts = [r.ttft_s for r in complete]
    tpots = [t for r in complete if (t := r.time_per_output_token_s) is not None]
    missed = [math.inf] * (len(run.records) - len(complete))
    duration_s = run.duration_s

    def per_s(count: float) -> float:
        return count / duration_s if duration_s > 0 else 0.0

    out = {
        "requests": float(len(run.records)),
        "complete": float(len(complete)),
        "good": float(len(good)),
        "duration_s": duration_s,
        "req_per_s": per_s(len(complete)),
        "output_tok_per_s": per_s(num_output_tokens),
        "goodput_req_per_s": per_s(len(good)),
        "sla_p99_ttft_ms": nearest_rank(ttfts + missed, 99) * 1000,
        "sla_p99_tpot_ms": nearest_rank(tpots + missed, 99) * 1000,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", run.inter_token_s)):
        for q in (50, 90, 99):
            out[f"p{q}_{name}_ms"] = percentile(values, q) * 1000
    return out
