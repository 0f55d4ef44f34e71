"""The benchmark's seeded workload, and the per-request records and metrics every system shares.

Every request is greedy with `ignore_eos`, so every system does exactly the same work: each request
yields exactly `max_tokens` output tokens. The one exception is the engine alone that `bench serve`
measures the API against (serve_compare.py): it asks as the API's requests ask, EOS honoured, so that
both do the same work there. Times in records are seconds since the system's run began (the instant
the first request may arrive), so metrics are computed the same way for every system."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from serving.engine.sequence import SamplingParams

ARRIVALS = ("all", "poisson")


@dataclass(slots=True, frozen=True)
class WorkloadSpec:
    num_requests: int = 64
    seed: int = 0
    min_prompt_tokens: int = 16
    max_prompt_tokens: int = 256
    min_output_tokens: int = 32
    max_output_tokens: int = 256
    arrival: str = "all"  # "all": every request at t=0; "poisson": exponential gaps at rate_per_s
    rate_per_s: float | None = None

    def validate(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not 1 <= self.min_prompt_tokens <= self.max_prompt_tokens:
            raise ValueError("prompt lengths must satisfy 1 <= min_prompt_tokens <= max_prompt_tokens")
        if not 1 <= self.min_output_tokens <= self.max_output_tokens:
            raise ValueError("output lengths must satisfy 1 <= min_output_tokens <= max_output_tokens")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if self.arrival == "poisson" and (self.rate_per_s is None or not self.rate_per_s > 0):
            raise ValueError("poisson arrivals need a rate_per_s > 0")


@dataclass(slots=True, frozen=True)
class BenchRequest:
    request_id: str
    arrival_s: float  # offset from the start of the run
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool = True

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=self.ignore_eos)


def make_workload(
    spec: WorkloadSpec, *, vocab_size: int, special_token_ids: Iterable[int] = ()
) -> list[BenchRequest]:
    """Requests in arrival order. Prompt ids are drawn uniformly from the vocabulary minus the special
    ids; lengths are uniform over the spec's inclusive ranges. Same spec and vocabulary, same workload."""
    spec.validate()
    special = set(special_token_ids)
    allowed = [token_id for token_id in range(vocab_size) if token_id not in special]
    if not allowed:
        raise ValueError("the vocabulary has no ordinary tokens to draw prompts from")
    rng = random.Random(spec.seed)
    # Arrivals draw from their own stream, so the same seed gives the same requests (prompts and
    # lengths) whether they arrive all at once or as a Poisson process.
    arrival_rng = random.Random(f"arrivals-{spec.seed}")
    requests = []
    arrival_s = 0.0
    for index in range(spec.num_requests):
        if spec.arrival == "poisson" and index:
            assert spec.rate_per_s is not None
            arrival_s += arrival_rng.expovariate(spec.rate_per_s)
        num_prompt_tokens = rng.randint(spec.min_prompt_tokens, spec.max_prompt_tokens)
        prompt = tuple(rng.choice(allowed) for _ in range(num_prompt_tokens))
        max_tokens = rng.randint(spec.min_output_tokens, spec.max_output_tokens)
        requests.append(BenchRequest(f"req-{index}", arrival_s, prompt, max_tokens))
    return requests


@dataclass(slots=True)
class RequestRecord:
    """What one system observed for one request; seconds since the start of that system's run."""

    request_id: str
    arrival_s: float
    max_tokens: int
    first_token_s: float | None = None
    finished_s: float | None = None
    num_output_tokens: int = 0
    # Static batching cannot see when a request inside a batch finishes; its TPOT is the batch's.
    tpot_s: float | None = None

    @property
    def is_complete(self) -> bool:
        return (
            self.first_token_s is not None
            and self.finished_s is not None
            and self.first_token_s >= self.arrival_s
            and self.finished_s >= self.first_token_s
            and self.num_output_tokens == self.max_tokens
        )

    def end_where_the_model_ended(self) -> bool:
        """The model ended the request (EOS, a stop string) before its max_tokens: it is complete at the
        length it reached, so its latencies count rather than only the longest requests'. Returns
        whether it ended early."""
        if 0 < self.num_output_tokens < self.max_tokens:
            self.max_tokens = self.num_output_tokens
            return True
        return False

    @property
    def ttft_s(self) -> float:
        assert self.first_token_s is not None
        return self.first_token_s - self.arrival_s

    @property
    def time_per_output_token_s(self) -> float | None:
        """Mean time per output token after the first; None with a single output token."""
        if self.tpot_s is not None:
            return self.tpot_s
        if self.num_output_tokens < 2:
            return None
        assert self.first_token_s is not None
        assert self.finished_s is not None
        return (self.finished_s - self.first_token_s) / (self.num_output_tokens - 1)


def new_records(requests: Sequence[BenchRequest]) -> dict[str, RequestRecord]:
    return {r.request_id: RequestRecord(r.request_id, r.arrival_s, r.max_tokens) for r in requests}


@dataclass(slots=True, frozen=True)
class RunMetrics:
    num_requests: int
    num_output_tokens: int
    makespan_s: float  # start of the run (first possible arrival) to the last finish
    output_tokens_per_s: float
    p50_ttft_s: float
    p99_ttft_s: float
    p50_tpot_s: float
    p99_tpot_s: float
    p50_e2e_s: float
    p99_e2e_s: float


def compute_metrics(records: Iterable[RequestRecord]) -> RunMetrics:
    done = list(records)
    incomplete = [r.request_id for r in done if not r.is_complete]
    if incomplete:
        raise ValueError(f"incomplete records: {incomplete[:5]}")
    num_output_tokens = sum(r.num_output_tokens for r in done)
    makespan_s = max(r.finished_s or 0.0 for r in done)
    ttfts = [r.ttft_s for r in done]
    tpots = [t for r in done if (t := r.time_per_output_token_s) is not None]
    e2es = [(r.finished_s or 0.0) - r.arrival_s for r in done]
    return RunMetrics(
        num_requests=len(done),
        num_output_tokens=num_output_tokens,
        makespan_s=makespan_s,
        output_tokens_per_s=num_output_tokens / makespan_s if makespan_s > 0 else math.nan,
        p50_ttft_s=percentile(ttfts, 50),
        p99_ttft_s=percentile(ttfts, 99),
        p50_tpot_s=percentile(tpots, 50),
        p99_tpot_s=percentile(tpots, 99),
        p50_e2e_s=percentile(e2es, 50),
        p99_e2e_s=percentile(e2es, 99),
    )


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The ceil(q/100 * n)-th smallest value (nearest rank), NaN for no values: a value that was
    observed, so a failure (infinite) and a request far over a bound count alike. With interpolation,
    one failure in 100 made a p99 infinite while one request 50 times over a bound barely moved it."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered) - 1e-9))) - 1]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN for no values. Infinite values
    (requests that missed an SLA) are taken: a rank at or between infinite ones is infinite."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    if rank == low or ordered[high] == ordered[low]:  # no 0 * inf, no inf - inf
        return ordered[low]
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
