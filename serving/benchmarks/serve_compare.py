"""`bench serve --compare`: the engine alone in this process, the same requests through the API, and what the
API path adds to each request's time to first token."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from serving.benchmarks.http_run import HttpRun, TextRequest
from serving.benchmarks.workload import BenchRequest, RequestRecord, compute_metrics, percentile


class EngineAlone:
    """The engine alone, configured as the platform's replica is (the same environment), built and
    warmed up once (on the first few requests, as the platform is before its measured runs) and kept
    for every round: rebuilt each round, it would run at a first run's speed against a replica that
    had served every round before. Prompts are tokenized ahead (the engine alone is timed from its
    add_request, so the replica's tokenizing is part of the path a comparison measures); each run is
    a fresh tenant's (EngineSystem.run), so nothing of one run is in another's prefix cache. Each request
    asks what the API's request asks (greedy, EOS honoured, not `bench engine`'s ignore_eos): where the
    model ends a stream early through the API it ends it here too, and both run the same batches."""

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
            BenchRequest(
                r.request_id,
                r.arrival_s,
                tuple(self._tokenizer(r.text)["input_ids"]),
                r.max_tokens,
                ignore_eos=False,
            )
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
            "ended_early": self.system.last_run.num_ended_early,
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
