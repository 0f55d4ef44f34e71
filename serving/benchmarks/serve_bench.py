"""`manage.py bench serve`: open-loop load over HTTP with streaming, against a running platform, and a
comparison mode that runs the same workload through gateway + Channels + replica and through the engine
alone, in one run, and prints the ratio.

Prompts are text (the HTTP API takes text); the engine-alone run tokenizes the same text, so both paths
do the same work. Every request is greedy and, through the API, runs to its max_tokens (the bench model
never emits EOS: its special tokens have zero logits)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from serving.benchmarks.http_client import HttpClient, HttpProtocolError
from serving.benchmarks.http_run import REQUEST_TIMEOUT_S, HttpRun, TextRequest, stream_outcome
from serving.benchmarks.openai_load import run_openai_load
from serving.benchmarks.workload import BenchRequest, RequestRecord, compute_metrics, nearest_rank, percentile

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
REPO_ROOT = Path(__file__).resolve().parents[2]


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
    """Latencies over the complete requests; every throughput (completed requests, their output tokens,
    goodput: requests within both SLOs, as vLLM defines it) per second of run.duration_s; and the SLA's
    p99s ("sla_p99_*", nearest rank) over every request sent, one that failed or did not complete missing
    both."""
    complete = [r for r in run.records if r.is_complete]
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
        "output_tok_per_s": per_s(sum(r.num_output_tokens for r in complete)),
        "goodput_req_per_s": per_s(len(good)),
        "sla_p99_ttft_ms": nearest_rank(ttfts + missed, 99) * 1000,
        "sla_p99_tpot_ms": nearest_rank(tpots + missed, 99) * 1000,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", run.inter_token_s)):
        for q in (50, 90, 99):
            out[f"p{q}_{name}_ms"] = percentile(values, q) * 1000
    return out


class EngineAlone:
    """The engine alone, configured as the platform's replica is (the same environment), built and
    warmed up once (on the first few requests, as the platform is before its measured runs) and kept
    for every round: rebuilt each round, it would run at a first run's speed against a replica that
    had served every round before. Prompts are tokenized ahead (the engine alone is timed from its
    add_request, so the replica's tokenizing is part of the path a comparison measures); each run is
    a fresh tenant's (EngineSystem.run), so nothing of one run is in another's prefix cache."""

    def __init__(self, model_dir: Path, engine_env: dict[str, str], warm_up: Sequence[TextRequest]) -> None:
        from serving.benchmarks.engine_system import EngineSystem
        from serving.engine.loading import load_tokenizer

        self._tokenizer = load_tokenizer(model_dir)
        self.system = EngineSystem(
            model_dir,
            max_num_seqs=int(engine_env["SWITCHYARD_MAX_NUM_SEQS"]),
            max_num_batched_tokens=int(engine_env["SWITCHYARD_MAX_NUM_BATCHED_TOKENS"]),
            kv_cache_bytes=int(engine_env["SWITCHYARD_KV_CACHE_MB"]) * 1024 * 1024,
            block_size=16,
            compile=False,
            pack_linear=engine_env["SWITCHYARD_PACK_LINEAR"] == "1",
        )
        self.system.run(self.tokenized(warm_up[:4]))

    def tokenized(self, requests: Sequence[TextRequest]) -> list[BenchRequest]:
        return [
            BenchRequest(r.request_id, r.arrival_s, tuple(self._tokenizer(r.text)["input_ids"]), r.max_tokens)
            for r in requests
        ]

    def run(self, requests: Sequence[TextRequest]) -> tuple[dict[str, float], dict[str, float]]:
        """The summary, and each complete request's TTFT in seconds by request id."""
        records = self.system.run(self.tokenized(requests))
        metrics = compute_metrics(records)
        summary = {
            "output_tok_per_s": metrics.output_tokens_per_s,
            "p50_ttft_ms": metrics.p50_ttft_s * 1000,
            "p99_ttft_ms": metrics.p99_ttft_s * 1000,
            "p50_tpot_ms": metrics.p50_tpot_s * 1000,
            "busy_pct": self.system.last_run.busy_fraction * 100,
        }
        return summary, _ttft_s_by_id(records)


def _median_difference_ms(ttft_s: dict[str, float], baseline_ttft_s: dict[str, float]) -> float:
    """The median over requests of (a TTFT - the baseline's TTFT for that request id); requests without
    a baseline are left out."""
    added = [(t - baseline_ttft_s[i]) * 1000 for i, t in ttft_s.items() if i in baseline_ttft_s]
    return percentile(added, 50) if added else float("nan")


def _ttft_s_by_id(records: Iterable[RequestRecord]) -> dict[str, float]:
    return {r.request_id: r.ttft_s for r in records if r.is_complete}


def path_ttft_ms(run: HttpRun) -> float:
    """The median over requests of (TTFT at the client - the replica's TTFT from the submission): what
    the path outside the replica adds to each request (HTTP, the gateway, two layer hops), read within
    one request and so free of the engine's run-to-run variance. It leaves out what the path costs
    the engine (a gateway sharing its cores slows its steps), which the end-to-end figures include."""
    return _median_difference_ms(_ttft_s_by_id(run.records), run.replica_ttft_s)


def replica_ttft_added_ms(alone_ttft_s: dict[str, float], run: HttpRun) -> float:
    """The median over requests of (the replica's TTFT from the submission - TTFT of the same request on
    the engine alone): what the replica's own work adds, plus what sharing the cores with the gateway
    and the client costs its steps. Grows with load: queueing amplifies any slower step. Reads low by up
    to the time before the submission for a request that arrives during a step: the replica's clock
    starts later, the step it waits for ends when it would have anyway."""
    return _median_difference_ms(run.replica_ttft_s, alone_ttft_s)


def paired_ttft_added_ms(alone_ttft_s: dict[str, float], run: HttpRun) -> float:
    """The median over requests of (TTFT through the API - TTFT of the same request on the engine alone).
    Both runs replay one arrival schedule, so pairing takes out what varies between requests (prompt
    length, what else was running) and leaves what the path adds to each."""
    return _median_difference_ms(_ttft_s_by_id(run.records), alone_ttft_s)


@dataclass(slots=True)
class CompareRound:
    """One workload run on the engine alone and through the API, in either order."""

    seed: int
    alone: dict[str, float]  # EngineAlone.run's summary
    alone_ttft_s: dict[str, float]  # by request id
    run: HttpRun  # through the API
    through: dict[str, float]  # summarize(run)
    api_first: bool = False  # the API run came before the engine alone's

    def figures(self) -> dict[str, float]:
        return {
            "p50 TTFT added": self.through["p50_ttft_ms"] - self.alone["p50_ttft_ms"],
            "paired": paired_ttft_added_ms(self.alone_ttft_s, self.run),
            "outside": path_ttft_ms(self.run),
            "inside": replica_ttft_added_ms(self.alone_ttft_s, self.run),
            "queue_s": percentile(list(self.run.replica_queue_s.values()), 50) * 1000
            if self.run.replica_queue_s
            else float("nan"),
            "TPOT added": self.through["p50_tpot_ms"] - self.alone["p50_tpot_ms"],
            "kept %": 100 * self.through["output_tok_per_s"] / self.alone["output_tok_per_s"],
            "busy %": self.alone["busy_pct"],
        }


def pooled_ttft_added_ms(rounds: Sequence[CompareRound]) -> tuple[float, float]:
    """The issue's figure over every round's requests at once: the p50 of all TTFTs through the API minus
    the p50 of all on the engine alone; and the median of every request's paired difference. One
    round's p50 rests on a few dozen requests, each of which waits for whatever step is running when
    it arrives (a decode step takes ~20 ms here, a prefill of a long prompt ~100 ms), so it moves by
    several ms between runs of the same code; pooled, the rounds' requests sharpen one figure instead
    of giving several noisy ones."""
    through = [t for r in rounds for t in _ttft_s_by_id(r.run.records).values()]
    alone = [t for r in rounds for t in r.alone_ttft_s.values()]
    paired = [
        (t - r.alone_ttft_s[i]) * 1000
        for r in rounds
        for i, t in _ttft_s_by_id(r.run.records).items()
        if i in r.alone_ttft_s
    ]
    return (percentile(through, 50) - percentile(alone, 50)) * 1000, percentile(paired, 50)


def rounds_report(rounds: Sequence[CompareRound]) -> str:
    """A row per round, the median of each column, and the pooled figures."""
    rows = {f"seed {r.seed}{' API 1st' if r.api_first else ''}": r.figures() for r in rounds}
    names = list(next(iter(rows.values())))
    # A figure a round lacks (NaN: no replica timings, say) is left out of its column's median.
    medians = {
        name: percentile([v for row in rows.values() if not math.isnan(v := row[name])], 50) for name in names
    }
    lines = [f"{'(ms unless %)':<18}" + "".join(f"{name:>16}" for name in names)]
    for label, row in {**rows, "median": medians}.items():
        lines.append(
            f"{label:<18}"
            + "".join(f"{row[name]:>16.1f}" if "%" in name else f"{row[name]:>+16.2f}" for name in names)
        )
    pooled, pooled_paired = pooled_ttft_added_ms(rounds)
    num_through = sum(len(_ttft_s_by_id(r.run.records)) for r in rounds)
    num_alone = sum(len(r.alone_ttft_s) for r in rounds)
    lines.append(
        f"pooled over {len(rounds)} rounds ({num_through} requests through the API, {num_alone} alone): "
        f"p50 TTFT added by the API path {pooled:+.1f} ms (median per-request difference: "
        f"{pooled_paired:+.1f} ms)"
    )
    return "\n".join(lines)


# --- one request at a time, on each path in turn ----------------------------------------------------


@dataclass(slots=True, frozen=True)
class Pair:
    """One request run on the engine alone and through the API, back to back, each with the other idle."""

    request_id: str
    alone_ttft_s: float
    api_ttft_s: float
    replica_ttft_s: float | None  # the replica's own, from the gateway's submission (the final event)
    api_first: bool
    replica_queue_s: float | None = None  # of which before its first forward pass (the final event)
    # Its place in its block (run_interleaved's `block`): past 0, each of its two runs came right after
    # a run on the same path, not the other path's.
    position: int = 0

    @property
    def added_ms(self) -> float:
        return (self.api_ttft_s - self.alone_ttft_s) * 1000


async def run_interleaved(
    base_url: str,
    key: str,
    model: str,
    requests: Sequence[TextRequest],
    alone: Callable[[TextRequest], float],
    *,
    mean_gap_s: float,
    seed: int,
    statuses: Counter[str],
    block: int = 1,
) -> list[Pair]:
    """Each request once on the engine alone (`alone` runs it and returns its TTFT in seconds) and once
    through the API, each run followed by an idle gap drawn from [0, 2 * mean_gap_s], so that no run
    keeps step with the replica's heartbeat. With one request at a time no queueing amplifies a slower
    step, and a request's two runs see the machine within a second or two of each other rather than a
    minute apart (its speed drifts by several per cent over that here).

    The requests go in blocks of `block`: the block's requests on one path, then the same requests on
    the other, the API first in every second block. A run that follows the other path's run finds the
    caches full of the other process's data and pays a few ms for it here; one that follows a run on
    its own path does not, as in a deployment, where no second engine runs between two requests. Within
    a block only its first pair has such a run (the other path's side ran last): each pair carries its
    `position` in the block. With `block` 1 (requests alternating one by one) every pair has one such
    run: the report's figures by order show what that costs each path. A request the API failed is left
    out (its status is counted)."""
    if block < 1:
        raise ValueError(f"block must be at least 1, got {block}")
    rng = random.Random(f"gaps-{seed}")
    path = f"/v1/models/{model}/infer"
    pairs = []
    async with HttpClient(base_url, max_connections=2) as client:
        if requests:  # untimed: the connection opens here rather than on the first pair's clock
            # Not requests[0]'s text: its prompt's blocks would then be in the replica's prefix cache
            # when it is measured there, and not in the engine alone's.
            warm_up = dataclasses.replace(
                requests[0], request_id="warm-up", arrival_s=0.0, text=f"{WARM_UP_PREFIX}{requests[0].text}"
            )
            await _one(client, path, key, warm_up, time.perf_counter(), HttpRun([], []))
        for start in range(0, len(requests), block):
            chunk = [dataclasses.replace(r, arrival_s=0.0) for r in requests[start : start + block]]
            api_first = (start // block) % 2 == 1
            run = HttpRun([], [])
            alone_ttft_s: dict[str, float] = {}
            for side in ("api", "alone") if api_first else ("alone", "api"):
                for request in chunk:
                    if side == "alone":
                        alone_ttft_s[request.request_id] = alone(request)
                    else:
                        await _one(client, path, key, request, time.perf_counter(), run)
                    await asyncio.sleep(rng.uniform(0.0, 2 * mean_gap_s))
            statuses.update(run.statuses)
            records = {record.request_id: record for record in run.records}
            for position, request in enumerate(chunk):
                api = records.get(request.request_id)
                if api is None or not api.is_complete:
                    continue
                pairs.append(
                    Pair(
                        request.request_id,
                        alone_ttft_s[request.request_id],
                        api.ttft_s,
                        run.replica_ttft_s.get(request.request_id),
                        api_first,
                        run.replica_queue_s.get(request.request_id),
                        position=position,
                    )
                )
    return pairs


def bootstrap_interval(
    pairs: Sequence[Pair],
    statistic: Callable[[Sequence[Pair]], float],
    *,
    num_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """A percentile bootstrap interval for a statistic of the pairs: resampled whole pairs, so that a
    request's two runs stay together."""
    rng = random.Random(seed)
    values = sorted(statistic(rng.choices(pairs, k=len(pairs))) for _ in range(num_resamples))
    tail = (1 - confidence) / 2 * 100
    return percentile(values, tail), percentile(values, 100 - tail)


def p50_ttft_added_ms(pairs: Sequence[Pair]) -> float:
    """The issue's figure: p50 TTFT through the API minus p50 TTFT on the engine alone."""
    through = percentile([p.api_ttft_s for p in pairs], 50)
    return (through - percentile([p.alone_ttft_s for p in pairs], 50)) * 1000


def median_added_ms(pairs: Sequence[Pair]) -> float:
    """The median over requests of each one's own difference: what the path adds to a request."""
    return percentile([p.added_ms for p in pairs], 50)


def _median_ms(values: Sequence[float], *, sign: bool = False) -> str:
    if not values:
        return "n/a"
    return f"{percentile(values, 50):{'+' if sign else ''}.2f} ms"


def interleaved_report(pairs: Sequence[Pair]) -> str:
    if not pairs:
        return "no request completed through the API: nothing to compare"
    lines = []
    statistics = {
        "p50 TTFT added by the API path": p50_ttft_added_ms,
        "median per-request difference": median_added_ms,
    }
    warm = [p for p in pairs if p.position > 0]
    groups = [("", pairs)]
    if warm:
        groups.append((f"pairs after their block's first ({len(warm)} of {len(pairs)}), ", warm))
    for prefix, group in groups:
        for name, statistic in statistics.items():
            low, high = bootstrap_interval(group, statistic)
            lines.append(
                f"{prefix}{name}: {statistic(group):+.2f} ms (95% interval {low:+.2f} to {high:+.2f})"
            )
    # The replica's own TTFT splits each difference into the path outside the replica and its inside.
    split = [(p, p.replica_ttft_s) for p in pairs if p.replica_ttft_s is not None]
    outside = [(p.api_ttft_s - replica) * 1000 for p, replica in split]
    inside = [(replica - p.alone_ttft_s) * 1000 for p, replica in split]
    # The inside again: the replica's path before its first forward pass (the engine alone starts one at
    # once), and the rest, where the two engines' speeds differ.
    queued = [(p, replica, p.replica_queue_s) for p, replica in split if p.replica_queue_s is not None]
    queue = [q * 1000 for _, _, q in queued]
    model = [(replica - q - p.alone_ttft_s) * 1000 for p, replica, q in queued]
    alone_first = [p.added_ms for p in pairs if not p.api_first]
    api_first = [p.added_ms for p in pairs if p.api_first]
    lines += [
        f"of which outside the replica (client TTFT - replica TTFT, median): {_median_ms(outside)}",
        f"and inside it (replica TTFT - engine-alone TTFT, median): {_median_ms(inside, sign=True)}",
        f"  inside, before the replica's first forward pass (its queue_s, median): {_median_ms(queue)}",
        "  inside, from that forward pass on (replica TTFT - queue_s - engine-alone TTFT, median): "
        f"{_median_ms(model, sign=True)}",
        "per-request difference by order (median): engine alone first "
        f"{_median_ms(alone_first, sign=True)}, API first {_median_ms(api_first, sign=True)}",
        *_by_position(pairs),
        f"{len(pairs)} requests, one at a time; p50 TTFT engine alone "
        f"{percentile([p.alone_ttft_s for p in pairs], 50) * 1000:.1f} ms, through the API "
        f"{percentile([p.api_ttft_s for p in pairs], 50) * 1000:.1f} ms",
    ]
    return "\n".join(lines)


def _by_position(pairs: Sequence[Pair]) -> list[str]:
    """With blocks, the median per-request difference at each place in a block: how many runs on its
    own path a run needs before the other path's stops slowing it."""
    positions = sorted({p.position for p in pairs})
    if positions == [0]:
        return []
    medians = ", ".join(
        f"{position}: {_median_ms([p.added_ms for p in pairs if p.position == position], sign=True)}"
        for position in positions
    )
    return [f"median per-request difference by place in its block: {medians}"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Platform:
    """A throwaway platform in its own state directory: embedded (one process) or on Redis (a gateway
    process and a `run_replica` process)."""

    def __init__(self, model_dir: Path, *, layer: str, engine_env: dict[str, str], redis_url: str) -> None:
        self.state = Path(tempfile.mkdtemp(prefix="switchyard-bench-"))
        # Nothing of the caller's own configuration: a SWITCHYARD_* setting of the shell (a per-tenant
        # cap, compilation, embedded replicas beside Redis ones) would make the replica other than the
        # engine alone it is compared with, whose configuration is engine_env's alone.
        inherited = {
            name: value
            for name, value in os.environ.items()
            if not name.startswith("SWITCHYARD_")
            and name not in {"DATABASE_URL", "REDIS_URL", "SECRET_KEY", "ARTIFACT_ROOT"}
        }
        self.env = {**inherited, **engine_env, "SWITCHYARD_STATE_DIR": str(self.state)}
        if layer == "redis":
            self.env["REDIS_URL"] = redis_url
        self.layer = layer
        self.model_dir = model_dir
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.processes: list[subprocess.Popen[bytes]] = []
        self._logs: list[Any] = []
        self.key = ""

    def _manage(self, *args: str) -> str:
        return subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=REPO_ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    def _spawn(self, *args: str) -> None:
        log = (self.state / f"{args[0]}.log").open("wb")
        self._logs.append(log)
        self.processes.append(
            subprocess.Popen(
                [sys.executable, "manage.py", *args],
                cwd=REPO_ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )

    def start(self) -> None:
        self._manage("migrate", "--noinput", "-v0")
        self._manage("register_model", "bench", "v1", "--from", str(self.model_dir))
        self._manage(
            "create_tenant",
            "bench",
            "--requests-per-second",
            "10000",
            "--tokens-per-minute",
            "100000000",
            "--max-concurrent",
            "10000",
        )
        self.key = self._manage("create_api_key", "--tenant", "bench").strip().splitlines()[-1]
        self._spawn("serve", "--port", str(self.port))
        if self.layer == "redis":
            self._spawn("run_replica", "--model", "bench", "--version", "v1")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                ready = httpx.get(f"{self.url}/readyz", timeout=2)
                # A gateway in front of replica processes is ready before any replica is: wait for one.
                if ready.status_code == 200 and ready.json()["num_ready_replicas"] >= 1:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the platform did not become ready; logs in {self.state}")

    def stop(self, *, keep_state: bool = False) -> None:
        """End every process started, ready or not; remove the state directory (a copy of the model,
        ~90 MB) unless `keep_state` (a run that failed: its logs are there)."""
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for log in self._logs:
            log.close()
        if keep_state:
            print(f"the platform's logs are in {self.state}", file=sys.stderr)
        else:
            shutil.rmtree(self.state, ignore_errors=True)


async def quota_flood(
    base_url: str, key: str, model: str, *, duration_s: float, concurrency: int
) -> dict[str, float]:
    """Requests from a tenant far over its quota: how many refusals one gateway process answers per second."""
    statuses: Counter[str] = Counter()
    path = f"/v1/models/{model}/infer"
    body = {"input": "hello", "max_tokens": 4}
    deadline = time.perf_counter() + duration_s

    async def worker(client: HttpClient) -> None:
        while time.perf_counter() < deadline:
            headers = {"Authorization": f"Bearer {key}"}
            async with asyncio.timeout(30.0), client.post(path, body, headers) as response:
                await response.read()
                statuses[str(response.status)] += 1

    async with HttpClient(base_url, max_connections=concurrency) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "rate_429_per_s": statuses["429"] / wall,
        **{f"status_{k}": float(v) for k, v in statuses.items()},
    }


def add_serve_arguments(parser: object) -> None:
    add = parser.add_argument  # type: ignore[attr-defined]
    add("--url", help="a running platform (with --key); omit to start a throwaway one for --compare")
    add("--key", default=os.environ.get("SWITCHYARD_API_KEY", ""))
    add("--model", default="bench")
    add(
        "--engine-alone",
        metavar="MODEL_DIR",
        default=None,
        help="with --url: afterwards run the same requests through the engine alone on MODEL_DIR (the "
        "served model's files), as bench engine runs it, and print the share of its throughput kept",
    )
    add(
        "--api",
        choices=["native", "openai"],
        default="native",
        help="with --url: the platform's own /v1/models/{model}/infer stream, or an OpenAI-compatible "
        "/v1/completions stream (ours or a peer's, e.g. vLLM's; tokens counted from its usage)",
    )
    add("--rate", type=float, default=None, help="Poisson requests/s; default: all at once (saturation)")
    add("--num-requests", type=int, default=None, help="default 64; or --duration with a --rate")
    add(
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --rate: every request that arrives in this many seconds, instead of --num-requests",
    )
    add(
        "--prompt-len",
        default=None,
        metavar="LOW-HIGH",
        help="prompt lengths in tokens, as the served model's tokenizer counts them (with --url, give "
        "--tokenizer); default: --prompt-words 16-128",
    )
    add("--prompt-words", default=None, metavar="LOW-HIGH", help="prompt lengths in words (default 16-128)")
    add(
        "--tokenizer",
        default=None,
        help="for --url with --prompt-len: the served model's tokenizer directory",
    )
    add("--output-len", default="32-128", metavar="LOW-HIGH", help="each request's max_tokens, drawn from")
    add("--seed", type=int, default=0)
    add("--sla-ttft-ms", type=float, default=2000.0, help="the SLA's TTFT bound (goodput, and at p99)")
    add("--sla-tpot-ms", type=float, default=200.0, help="the SLA's TPOT bound (goodput, and at p99)")
    add("--compare", action="store_true", help="engine alone vs. gateway + Channels + replica, one run")
    add(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="for --compare: N rounds on one platform, seeds --seed, --seed+1, ..., each the engine alone "
        "and the API (the API first in every second round); prints every round, the medians and the "
        "figures pooled over all rounds",
    )
    add(
        "--interleaved",
        action="store_true",
        help="for --compare: the requests one at a time, each on the engine alone and through the API in "
        "turn (the path's own cost, free of queueing and of the engine's drift between runs); "
        "--num-requests of them, no --rate",
    )
    add(
        "--gap-ms",
        type=float,
        default=50.0,
        help="for --interleaved: the mean idle time after each run (drawn from 0 to twice this)",
    )
    add(
        "--block",
        type=int,
        default=1,
        metavar="K",
        help="for --interleaved: K requests on one path, then the same K on the other (the API first in "
        "every second block); pairs after a block's first are reported apart as warm: neither of their "
        "runs follows the other path's",
    )
    add("--layer", choices=["embedded", "redis"], default="embedded")
    add("--redis-url", default="redis://127.0.0.1:6379/12")
    add("--model-dir", default=None, help="for --compare (default: the engine benchmark's model)")
    add("--max-num-seqs", type=int, default=64)
    add("--max-num-batched-tokens", type=int, default=2048)
    add("--kv-cache-mb", type=int, default=512)
    add(
        "--pack-linear",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="for --compare: oneDNN-packed Linear layers on a CPU, in the replica and the engine alone "
        "(default: if timing both here says it pays; decided once, for both)",
    )
    add(
        "--torch-threads",
        type=int,
        default=None,
        help="for --compare: the replica's and the engine-alone run's torch threads (default: all cores "
        "for a replica process, cores - 1 embedded); fewer leaves cores to the gateway and the client",
    )
    add(
        "--quota-flood",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="also measure 429s/s from an over-quota tenant for this long (needs --compare's platform)",
    )


def _interleave(  # type: ignore[no-untyped-def]
    platform: Platform,
    model_dir: Path,
    engine_env: dict[str, str],
    requests: Sequence[TextRequest],
    options: dict[str, object],
    statuses: Counter[str],
    *,
    block: int,
    log=print,
) -> list[Pair]:
    """run_interleaved against the platform, with one engine alone kept warm for the whole run."""
    engine_alone = EngineAlone(model_dir, engine_env, requests)
    by_id = {r.request_id: r for r in engine_alone.tokenized(requests)}

    def alone(request: TextRequest) -> float:
        (record,) = engine_alone.system.run([dataclasses.replace(by_id[request.request_id], arrival_s=0.0)])
        return float(record.ttft_s)

    log(f"{len(requests)} requests, one at a time, each on the engine alone and through the API in turn ...")
    return asyncio.run(
        run_interleaved(
            platform.url,
            platform.key,
            "bench",
            requests,
            alone,
            mean_gap_s=float(options.get("gap_ms") or 0.0) / 1000,  # type: ignore[arg-type]
            seed=int(options["seed"]),  # type: ignore[call-overload]
            statuses=statuses,
            block=block,
        )
    )


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    return int(low), int(high or low)


def _table(rows: dict[str, dict[str, float]]) -> str:
    keys = sorted({k for row in rows.values() for k in row})
    lines = [f"{'':<28}" + "".join(f"{name:>22}" for name in rows)]
    for key in keys:
        lines.append(f"{key:<28}" + "".join(f"{row.get(key, float('nan')):>22.2f}" for row in rows.values()))
    return "\n".join(lines)


def _load_spec(options: dict[str, object]) -> LoadSpec:
    """The workload the options describe; what they leave out keeps LoadSpec's defaults."""
    duration, num_requests = options.get("duration"), options.get("num_requests")
    if duration is not None and num_requests is not None:
        raise ValueError("give --duration or --num-requests, not both")
    if options.get("prompt_len") and options.get("prompt_words"):
        raise ValueError("give --prompt-len (tokens) or --prompt-words, not both")
    output_len = _range(str(options["output_len"]))
    spec = LoadSpec(
        rate_per_s=options["rate"],  # type: ignore[arg-type]
        min_output_tokens=output_len[0],
        max_output_tokens=output_len[1],
        seed=int(options["seed"]),  # type: ignore[call-overload]
        duration_s=None if duration is None else float(duration),  # type: ignore[arg-type]
    )
    if num_requests is not None:
        spec = dataclasses.replace(spec, num_requests=int(num_requests))  # type: ignore[call-overload]
    if prompt_len := options.get("prompt_len") or options.get("prompt_words"):
        low, high = _range(str(prompt_len))
        spec = dataclasses.replace(spec, min_prompt_len=low, max_prompt_len=high)
    return spec


def _packing_pays(model_dir: Path, *, log=print) -> bool:  # type: ignore[no-untyped-def]
    import torch

    from serving.engine.loading import load_causal_lm
    from serving.engine.packing import can_pack, packing_pays

    device, dtype = torch.device("cpu"), torch.float32
    if not can_pack(device, dtype):
        return False
    verdict = packing_pays(load_causal_lm(model_dir, device=device, dtype=dtype))
    log(f"Linear layers: {verdict.describe()}")
    return verdict.pack


def _engine_alone_report(  # type: ignore[no-untyped-def]
    model_dir: Path, requests: Sequence[TextRequest], through_api: dict[str, float], *, log=print
) -> str:
    """After a run against a platform (--url), the same requests through the engine alone in this
    process, configured as `bench engine` runs it (every core, 64 sequences, 2,048 tokens a step, a KV
    cache that holds the whole workload), and the share of its throughput the platform kept. The
    platform idles meanwhile; this process's own client work is not in the engine's figure."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    engine_env = {
        "SWITCHYARD_MAX_NUM_SEQS": "64",
        "SWITCHYARD_MAX_NUM_BATCHED_TOKENS": "2048",
        "SWITCHYARD_KV_CACHE_MB": "2048",
        "SWITCHYARD_PACK_LINEAR": "1" if _packing_pays(model_dir, log=log) else "0",
    }
    threads = torch.get_num_threads()
    log(f"the same {len(requests)} requests through the engine alone ({threads} torch threads) ...")
    alone, _ = EngineAlone(model_dir, engine_env, requests).run(requests)
    kept = (
        through_api["output_tok_per_s"] / alone["output_tok_per_s"] if alone["output_tok_per_s"] else math.nan
    )
    return (
        f"engine alone (as bench engine runs it, {model_dir}): {alone['output_tok_per_s']:.1f} output tok/s, "
        f"p50 TTFT {alone['p50_ttft_ms']:.0f} ms; the platform kept {kept:.1%} of it"
    )


def _token_counter(tokenizer_dir: Path) -> Callable[[str], int]:
    from serving.engine.loading import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    return lambda text: len(tokenizer(text)["input_ids"])


def http_report(run: HttpRun, summary: dict[str, float], *, sla_ttft_s: float, sla_tpot_s: float) -> str:
    """What `bench serve --url` prints: the latency table, whether the run met the SLA at p99 over every
    request sent, each request's outcome, the prompts' lengths as the server counted them, and the path's
    share outside the replica."""
    p99_ttft_ms, p99_tpot_ms = summary["sla_p99_ttft_ms"], summary["sla_p99_tpot_ms"]
    met = p99_ttft_ms <= sla_ttft_s * 1000 and p99_tpot_ms <= sla_tpot_s * 1000  # False when NaN
    sent, good = int(summary["requests"]), int(summary["good"])
    lines = [
        _table({"through the API": summary}),
        f"SLA p99 TTFT <= {sla_ttft_s * 1000:.0f} ms and p99 TPOT <= {sla_tpot_s * 1000:.0f} ms over all "
        f"{sent} requests sent (one that failed or did not complete misses both): "
        f"{'met' if met else 'NOT met'} (p99 TTFT {p99_ttft_ms:.1f} ms, p99 TPOT {p99_tpot_ms:.1f} ms); "
        f"{good}/{sent} ({good / sent if sent else 0.0:.0%}) within both "
        f"(goodput {summary['goodput_req_per_s']:.2f} req/s)",
        f"req/s, tok/s and goodput are per second of the run's {summary['duration_s']:.2f} s: from the "
        "first send to the last request's end, whatever its outcome",
        f"outcomes (one per request): {dict(run.statuses)}",
    ]
    if run.prompt_tokens:
        lines.append(
            f"prompt tokens (the server's count): min {min(run.prompt_tokens)}, "
            f"p50 {percentile(run.prompt_tokens, 50):.0f}, max {max(run.prompt_tokens)}"
        )
    if run.num_ended_early:
        lines.append(f"{run.num_ended_early} streams ended (EOS or a stop string) before their max_tokens")
    if run.replica_ttft_s:  # the native API's final events carry the replica's timings; OpenAI's do not
        lines.append(f"TTFT outside the replica (client - replica, median): {path_ttft_ms(run):.1f} ms")
    return "\n".join(lines)


def run_serve_from_options(options: dict[str, object], *, default_model_dir: Path, log=print) -> str:  # type: ignore[no-untyped-def]
    spec = _load_spec(options)
    interleaved = bool(options.get("interleaved"))
    if interleaved and (not options["compare"] or spec.rate_per_s or int(options.get("repeat") or 1) > 1):  # type: ignore[call-overload]
        raise ValueError(
            "--interleaved goes with --compare, and sends one request at a time: no --rate or --repeat"
        )
    block = 1 if options.get("block") is None else int(options["block"])  # type: ignore[call-overload]
    if block < 1 or (block > 1 and not interleaved):
        raise ValueError("--block is a positive number of requests, for --interleaved")
    sla = {
        "sla_ttft_s": float(options["sla_ttft_ms"]) / 1000,
        "sla_tpot_s": float(options["sla_tpot_ms"]) / 1000,
    }  # type: ignore[arg-type]
    count_tokens = None
    api = str(options.get("api") or "native")
    if api != "native" and options["compare"]:
        raise ValueError("--api openai goes with --url: --compare runs the platform's native API")
    if not options["compare"]:
        if not options["url"]:
            raise ValueError("give --url and --key of a running platform, or --compare")
        if options.get("prompt_len"):
            if not options.get("tokenizer"):
                raise ValueError(
                    "--prompt-len counts tokens: give --tokenizer (the served model's tokenizer directory), "
                    "or size prompts with --prompt-words"
                )
            count_tokens = _token_counter(Path(str(options["tokenizer"])))
        requests = make_text_workload(spec, count_tokens)
        load = run_openai_load if api == "openai" else run_http_load
        run = asyncio.run(load(str(options["url"]), str(options["key"]), str(options["model"]), requests))
        summary = summarize(run, **sla)
        report = http_report(run, summary, **sla)
        if options.get("engine_alone"):
            report += "\n" + _engine_alone_report(
                Path(str(options["engine_alone"])), requests, summary, log=log
            )
        return report

    from serving.benchmarks.bench_model import ensure_bench_model

    model_dir = (
        Path(str(options["model_dir"]))
        if options["model_dir"]
        else ensure_bench_model(default_model_dir, log=log)
    )
    if options.get("prompt_len"):
        count_tokens = _token_counter(model_dir)
    requests = make_text_workload(spec, count_tokens)
    engine_env = {
        "SWITCHYARD_MAX_NUM_SEQS": str(options["max_num_seqs"]),
        "SWITCHYARD_MAX_NUM_BATCHED_TOKENS": str(options["max_num_batched_tokens"]),
        "SWITCHYARD_KV_CACHE_MB": str(options["kv_cache_mb"]),
    }
    import logging

    import torch
    from django.conf import settings

    logging.getLogger("httpx").setLevel(logging.WARNING)
    # The same torch threads as the replica gets: an embedded replica shares the cores with the server's
    # event loop (settings.EMBEDDED_TORCH_THREADS); a replica process has them all.
    threads = int(options.get("torch_threads") or 0) or (  # type: ignore[call-overload]
        settings.EMBEDDED_TORCH_THREADS if options["layer"] == "embedded" else (os.cpu_count() or 1)
    )
    engine_env["SWITCHYARD_TORCH_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    pack = options.get("pack_linear")
    if pack is None:
        # Decided here, once, rather than by each engine at its load: on a noisy machine two timings
        # could choose differently, and the comparison would measure that.
        pack = _packing_pays(model_dir, log=log)
    engine_env["SWITCHYARD_PACK_LINEAR"] = "1" if pack else "0"
    platform = Platform(
        model_dir, layer=str(options["layer"]), engine_env=engine_env, redis_url=str(options["redis_url"])
    )
    log(f"starting a platform ({options['layer']}) in {platform.state} ...")
    rounds: list[CompareRound] = []
    pairs: list[Pair] = []
    statuses: Counter[str] = Counter()
    num_rounds = max(1, int(options.get("repeat") or 1))  # type: ignore[call-overload]
    has_failed = True
    try:
        platform.start()  # in the try: a start that fails (not ready in time) must not leave its processes
        asyncio.run(
            run_http_load(
                platform.url,
                platform.key,
                "bench",
                [  # texts no seed draws: none of its prompts' blocks in the prefix cache for the runs
                    dataclasses.replace(r, text=f"{WARM_UP_PREFIX}{r.text}")
                    for r in make_text_workload(
                        LoadSpec(num_requests=4, min_output_tokens=4, max_output_tokens=4, seed=99)
                    )
                ],
            )
        )  # warm-up
        if interleaved:
            pairs = _interleave(
                platform, model_dir, engine_env, requests, options, statuses, block=block, log=log
            )
        else:
            # The engine alone runs while the platform idles (heartbeats every 0.5 s), so that the rounds
            # alternate; and every second round runs the API first, so that a steady drift of the machine's
            # speed over the session falls on both sides alike rather than always on the second.
            engine_alone = EngineAlone(model_dir, engine_env, requests)
            for index in range(num_rounds):
                seed = spec.seed + index
                workload = (
                    requests
                    if index == 0
                    else make_text_workload(dataclasses.replace(spec, seed=seed), count_tokens)
                )
                api_first = index % 2 == 1
                first = "API" if api_first else "engine alone"
                log(f"round {index + 1}/{num_rounds}, seed {seed}, {first} first")
                if api_first:
                    log("through gateway + Channels + replica ...")
                    run = asyncio.run(run_http_load(platform.url, platform.key, "bench", workload))
                log(f"engine alone ({threads} torch threads) ...")
                alone, alone_ttft_s = engine_alone.run(workload)
                if not api_first:
                    log("through gateway + Channels + replica ...")
                    run = asyncio.run(run_http_load(platform.url, platform.key, "bench", workload))
                rounds.append(CompareRound(seed, alone, alone_ttft_s, run, summarize(run, **sla), api_first))
        flood = {}
        if float(options["quota_flood"]) > 0:  # type: ignore[arg-type]
            subprocess.run(
                [sys.executable, "manage.py", "create_tenant", "flooder", "--requests-per-second", "0.001"],
                cwd=REPO_ROOT,
                env=platform.env,
                check=True,
                capture_output=True,
            )
            flood_key = (
                subprocess.run(
                    [sys.executable, "manage.py", "create_api_key", "--tenant", "flooder"],
                    cwd=REPO_ROOT,
                    env=platform.env,
                    check=True,
                    capture_output=True,
                    text=True,
                )
                .stdout.strip()
                .splitlines()[-1]
            )
            flood = asyncio.run(
                quota_flood(
                    platform.url,
                    flood_key,
                    "bench",
                    duration_s=float(options["quota_flood"]),
                    # The client costs CPU per request too, and on 2 cores it shares them with the
                    # server: a few connections keep it from saturating first (httpx, earlier: 32
                    # connections 450/s, 64 184/s, 8 594/s).
                    concurrency=8,
                )
            )  # type: ignore[arg-type]
        has_failed = False
    finally:
        platform.stop(keep_state=has_failed)
    statuses += sum((r.run.statuses for r in rounds), Counter())
    if interleaved:
        lines = [interleaved_report(pairs), f"outcomes (one per request): {dict(statuses)}"]
    elif num_rounds > 1:
        lines = [rounds_report(rounds), f"outcomes (one per request): {dict(statuses)}"]
    else:
        (only,) = rounds
        figures = only.figures()
        lines = [
            _table({"engine alone": only.alone, f"API ({options['layer']})": only.through}),
            f"outcomes (one per request): {dict(statuses)}",
            f"throughput kept through the API: {figures['kept %'] / 100:.1%} of engine alone",
            f"p50 TTFT added by the API path: {figures['p50 TTFT added']:+.1f} ms "
            f"(median per-request difference: {figures['paired']:+.1f} ms)",
            f"of which outside the replica (client TTFT - replica TTFT, median): {figures['outside']:.1f} ms",
            f"and inside it (replica TTFT - engine-alone TTFT, median): {figures['inside']:+.1f} ms",
            f"the client sent its requests {percentile(only.run.send_lateness_s, 50) * 1000:.1f} ms after "
            "their arrival times (median; TTFT counts from the send)",
            f"load: the engine alone was busy {only.alone['busy_pct']:.0f}% of its run "
            "(light load, where TTFT is the path's cost rather than queueing, is well under 50%)",
        ]
    if flood:
        lines.append(
            f"over-quota refusals: {flood['rate_429_per_s']:.0f} 429s/s from one gateway process ({flood})"
        )
    return "\n".join(lines)
