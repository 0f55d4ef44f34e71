"""Smoke tests of the engine benchmark on the tiny demo model: every system yields complete records and
exactly each request's max_tokens; the workload is deterministic; `manage.py bench engine` runs."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from collections import Counter
from io import StringIO
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from django.core.management import CommandError, call_command

from serving.benchmarks.bench_model import read_model_info
from serving.benchmarks.engine_bench import _build_system
from serving.benchmarks.engine_results import BenchConfig
from serving.benchmarks.engine_system import EngineSystem
from serving.benchmarks.limits import concurrency_at_budget
from serving.benchmarks.workload import (
    BenchRequest,
    RequestRecord,
    WorkloadSpec,
    compute_metrics,
    make_workload,
)
from tests.serving.benchmarks.scripted_http import SSE_HEAD, ScriptedServer, chunk

if TYPE_CHECKING:
    from serving.benchmarks.serve_compare import CompareRound

SMALL = WorkloadSpec(
    num_requests=4,
    seed=3,
    min_prompt_tokens=4,
    max_prompt_tokens=24,
    min_output_tokens=3,
    max_output_tokens=9,
)
HAS_ENGINE = importlib.util.find_spec("serving.engine.engine") is not None


def _record(request_id: str, arrival_s: float, first_token_s: float, complete: bool = True) -> RequestRecord:
    """A request as the load client records it: two tokens (one when incomplete), 0.1 s apart."""
    return RequestRecord(
        request_id,
        arrival_s,
        max_tokens=2,
        first_token_s=first_token_s,
        finished_s=first_token_s + 0.1,
        num_output_tokens=2 if complete else 1,
    )


def test_the_workload_is_deterministic_under_a_seed() -> None:
    spec = WorkloadSpec(num_requests=32, seed=7, arrival="poisson", rate_per_s=4.0)
    first = make_workload(spec, vocab_size=500, special_token_ids=[0, 1, 2])
    assert first == make_workload(spec, vocab_size=500, special_token_ids=[0, 1, 2])
    other_seed = WorkloadSpec(num_requests=32, seed=8, arrival="poisson", rate_per_s=4.0)
    assert first != make_workload(other_seed, vocab_size=500, special_token_ids=[0, 1, 2])
    for request in first:
        assert 16 <= len(request.prompt_token_ids) <= 256
        assert 32 <= request.max_tokens <= 256
        assert not {0, 1, 2} & set(request.prompt_token_ids)
        assert max(request.prompt_token_ids) < 500
        assert request.params.is_greedy
        assert request.params.ignore_eos
    arrivals = [r.arrival_s for r in first]
    assert arrivals[0] == 0.0
    assert arrivals == sorted(arrivals)
    assert arrivals[-1] > 0
    all_at_once = make_workload(
        WorkloadSpec(num_requests=32, seed=7), vocab_size=500, special_token_ids=[0, 1, 2]
    )
    assert {r.arrival_s for r in all_at_once} == {0.0}
    # Only the arrivals differ between the two arrival patterns.
    assert [(r.prompt_token_ids, r.max_tokens) for r in all_at_once] == [
        (r.prompt_token_ids, r.max_tokens) for r in first
    ]


def test_a_bad_workload_spec_is_refused() -> None:
    with pytest.raises(ValueError, match="poisson"):
        make_workload(WorkloadSpec(arrival="poisson"), vocab_size=100)
    with pytest.raises(ValueError, match="prompt"):
        make_workload(WorkloadSpec(min_prompt_tokens=10, max_prompt_tokens=5), vocab_size=100)


def _systems() -> list[str]:
    return ["a", "b", "c"] + (["d"] if HAS_ENGINE else [])


@pytest.mark.parametrize("key", _systems())
def test_each_system_yields_every_requests_max_tokens(key: str, demo_model_dir: Path) -> None:
    model = read_model_info(demo_model_dir)
    requests = make_workload(SMALL, vocab_size=model.vocab_size, special_token_ids=model.special_ids)
    config = BenchConfig(workload=SMALL, max_num_seqs=4, max_num_batched_tokens=32, static_batch_size=3)
    system = _build_system(key, demo_model_dir, config, kv_cache_bytes=64 * 16 * model.kv_bytes_per_token)
    records = system.run(requests)
    assert sorted(r.request_id for r in records) == sorted(r.request_id for r in requests)
    by_id = {r.request_id: r for r in requests}
    for record in records:
        assert record.is_complete, record
        assert record.num_output_tokens == by_id[record.request_id].max_tokens
    metrics = compute_metrics(records)
    assert metrics.num_output_tokens == sum(r.max_tokens for r in requests)
    assert metrics.output_tokens_per_s > 0
    assert metrics.p50_ttft_s <= metrics.p99_ttft_s
    if isinstance(system, EngineSystem):
        assert system.last_run.num_kv_samples > 0
        assert 0 <= system.last_run.mean_kv_waste <= system.last_run.max_kv_waste < 1
        assert 0 < system.last_run.run_kv_waste <= system.last_run.max_kv_waste


def test_paged_blocks_fit_more_sequences_than_max_length_reservations(demo_model_dir: Path) -> None:
    model = read_model_info(demo_model_dir)
    requests = [
        BenchRequest("r0", 0.0, tuple(range(3, 23)), 12),  # 32 tokens: 2 blocks of 16
        BenchRequest("r1", 0.0, tuple(range(3, 13)), 7),  # 17 tokens: 2 blocks
    ]
    budget_slots = 4 * model.max_position_embeddings
    report = concurrency_at_budget(requests, model, budget_slots * model.kv_bytes_per_token, 16)
    assert report.budget_slots == budget_slots
    assert report.num_contiguous == 4
    assert report.num_paged == budget_slots // 32
    assert report.ratio == report.num_paged / 4


def test_the_bench_command_prints_the_table(demo_model_dir: Path) -> None:
    out, err = StringIO(), StringIO()
    call_command(
        "bench",
        "engine",
        "--model-dir",
        str(demo_model_dir),
        "--num-requests",
        "2",
        "--prompt-tokens",
        "4-8",
        "--output-tokens",
        "2-4",
        "--systems",
        "a,b",
        "--repeat",
        "2",
        stdout=out,
        stderr=err,
    )
    text = out.getvalue()
    for expected in ("(a) naive", "(b) static", "out tok/s", "(f) KV budget", "(g) CPU", "(h) scheduler"):
        assert expected in text
    assert "torch threads:" in text
    assert "run 2/2" in err.getvalue()


def test_each_engine_run_reports_its_share_of_the_limit_and_its_decode_steps_breakdown(
    demo_model_dir: Path,
) -> None:
    out, err = StringIO(), StringIO()
    call_command(
        "bench",
        "engine",
        *("--model-dir", str(demo_model_dir), "--num-requests", "2", "--prompt-tokens", "4-8"),
        *("--output-tokens", "2-4", "--systems", "d", "--repeat", "2", "--max-num-seqs", "4"),
        *("--kv-cache-mib", "16"),
        "--skip-scheduler",
        stdout=out,
        stderr=err,
    )
    # The bench's KV budget is sized to this tiny workload: the profile takes what it holds.
    per_run = [line for line in err.getvalue().splitlines() if "decode step at batch" in line]
    assert len(per_run) == 2  # one profile after each run
    assert all("of the CPU limit counting prompt tokens" in line for line in per_run)
    assert all("0.0 MiB copied from the KV pool" in line for line in per_run)  # the native kernel copies none
    text = out.getvalue()
    assert "(i) (d)'s decode step at batch" in text and "host ops per layer" in text
    assert "torch.matmul" in text and "oneDNN" in text  # (g) names both kernels' rates
    assert "engine: fused Llama forward (C row ops); native paged kernel" in text


def test_the_bench_command_refuses_unknown_systems(demo_model_dir: Path) -> None:
    with pytest.raises(CommandError, match="systems"):
        call_command("bench", "engine", "--model-dir", str(demo_model_dir), "--systems", "a,z")


def test_paired_ttft_added_pairs_requests_by_id_and_ignores_incomplete_ones() -> None:
    from serving.benchmarks.http_run import HttpRun
    from serving.benchmarks.serve_compare import paired_ttft_added_ms, path_ttft_ms, replica_ttft_added_ms

    # Prompts of very different cost: a difference of medians would mix them, the pairing does not.
    alone = {"a": 0.010, "b": 0.200, "c": 0.050}
    run = HttpRun(
        records=[
            _record("a", 1.0, 1.013),  # +3 ms
            _record("b", 2.0, 2.204),  # +4 ms
            _record("c", 3.0, 3.055),  # +5 ms
            _record("d", 4.0, 4.5),  # never ran alone: not paired
            _record("e", 5.0, 5.9, complete=False),
        ],
        inter_token_s=[],
    )
    alone["e"] = 0.001
    assert paired_ttft_added_ms(alone, run) == pytest.approx(4.0, abs=1e-6)
    assert math.isnan(paired_ttft_added_ms({}, run))
    # The replica's own TTFTs split each request's added time into inside and outside the replica.
    run.replica_ttft_s.update({"a": 0.011, "b": 0.201, "c": 0.052})
    assert replica_ttft_added_ms(alone, run) == pytest.approx(1.0, abs=1e-6)  # +1, +1, +2
    assert path_ttft_ms(run) == pytest.approx(3.0, abs=1e-6)  # +2, +3, +3


def round_of(
    seed: int, alone_ttft_s: dict[str, float], api_ttft_s: dict[str, float], *, queue: bool = True
) -> CompareRound:
    """A round whose replica waited `seed` ms before each request's first forward pass (no such timings
    without `queue`)."""
    from serving.benchmarks.http_run import HttpRun
    from serving.benchmarks.serve_compare import CompareRound

    records = [_record(i, 0.0, t) for i, t in api_ttft_s.items()]
    run = HttpRun(records=records, inter_token_s=[], replica_ttft_s=dict(alone_ttft_s))
    if queue:
        run.replica_queue_s.update({i: 0.001 * seed for i in api_ttft_s})
    summary = {"p50_ttft_ms": 0.0, "p50_tpot_ms": 0.0, "output_tok_per_s": 1.0, "busy_pct": 50.0}
    return CompareRound(seed, summary, alone_ttft_s, run, summary)


def test_repeated_rounds_pool_their_requests_into_one_figure() -> None:
    from serving.benchmarks.serve_compare import pooled_ttft_added_ms, rounds_report

    # Request ids repeat between rounds (each round's workload numbers its own): pairing stays per round.
    rounds = [
        round_of(1, {"req-0": 0.010, "req-1": 0.030}, {"req-0": 0.012, "req-1": 0.032}),
        round_of(2, {"req-0": 0.020, "req-1": 0.040, "req-2": 0.050}, {"req-0": 0.023, "req-1": 0.043}),
    ]
    pooled, paired = pooled_ttft_added_ms(rounds)
    # All TTFTs at once: the API's (12, 23, 32, 43 ms) p50 27.5 ms against the engine alone's (10, 20, 30,
    # 40, 50 ms) 30 ms; paired differences +2, +2, +3, +3 ms.
    assert pooled == pytest.approx(-2.5, abs=1e-6)
    assert paired == pytest.approx(2.5, abs=1e-6)
    report = rounds_report(rounds)
    assert "seed 1" in report and "seed 2" in report and "median" in report
    assert "pooled over 2 rounds (4 requests through the API, 5 alone)" in report
    assert "+2.5 ms)" in report
    # Each round's median wait before the replica's first forward pass, and their median.
    header, *rows = report.splitlines()
    end = header.index("queue_s") + len("queue_s")  # the columns are right-aligned, 16 wide
    assert [row[end - 16 : end].strip() for row in rows[:3]] == ["+1.00", "+2.00", "+1.50"]


def test_a_figure_a_round_lacks_is_left_out_of_its_median() -> None:
    from serving.benchmarks.serve_compare import rounds_report

    # The first round's replica sent no queue_s: its column is NaN there, and the median is the others'.
    rounds = [
        round_of(1, {"req-0": 0.010}, {"req-0": 0.012}, queue=False),
        round_of(2, {"req-0": 0.010}, {"req-0": 0.012}),
        round_of(3, {"req-0": 0.010}, {"req-0": 0.012}),
    ]
    header, *rows = rounds_report(rounds).splitlines()
    end = header.index("queue_s") + len("queue_s")
    assert [row[end - 16 : end].strip() for row in rows[:4]] == ["+nan", "+2.00", "+3.00", "+2.50"]


@pytest.mark.skipif(not HAS_ENGINE, reason="needs the engine")
def test_the_engine_alone_reports_how_busy_a_run_kept_it(demo_model_dir: Path) -> None:
    model = read_model_info(demo_model_dir)
    system = EngineSystem(
        demo_model_dir,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        kv_cache_bytes=64 * 16 * model.kv_bytes_per_token,
        block_size=16,
        compile=False,
    )
    # Two short requests 0.4 s apart: the engine waits for the second far longer than it works.
    system.run([BenchRequest("r0", 0.0, (5, 6, 7), 2), BenchRequest("r1", 0.4, (5, 6, 8), 2)])
    assert system.last_run.wall_s >= 0.4
    assert 0 < system.last_run.busy_fraction < 0.5


@pytest.mark.skipif(not HAS_ENGINE, reason="needs the engine")
def test_the_engine_alone_ends_a_request_where_the_model_ends_it(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """bench serve's engine alone asks as the API does (EOS honoured), so a stream the model ends early
    ends there too and both sides run the same batches; bench engine's own requests still ignore EOS."""
    from serving.benchmarks.http_run import TextRequest
    from serving.benchmarks.serve_compare import EngineAlone

    shutil.copytree(demo_model_dir, tmp_path, dirs_exist_ok=True)
    config_path = tmp_path / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = list(range(read_model_info(tmp_path).vocab_size))  # every token ends it
    config_path.write_text(json.dumps(config))
    engine_env = {
        "SWITCHYARD_MAX_NUM_SEQS": "4",
        "SWITCHYARD_MAX_NUM_BATCHED_TOKENS": "64",
        "SWITCHYARD_KV_CACHE_MB": "16",
        "SWITCHYARD_PACK_LINEAR": "0",
    }
    requests = [TextRequest("a", 0.0, "once upon a time", 6), TextRequest("b", 0.0, "the cat", 6)]
    alone = EngineAlone(tmp_path, engine_env, requests)
    summary, ttft_s = alone.run(requests)
    assert summary["ended_early"] == 2
    assert sorted(ttft_s) == ["a", "b"]  # complete at the one token each reached
    assert alone.system.last_run.num_batched_tokens == sum(
        len(r.prompt_token_ids) for r in alone.tokenized(requests)
    )  # the prompts' forward passes, then no decode step
    (record,) = alone.system.run([BenchRequest("c", 0.0, (5, 6, 7), 4)])
    assert (record.num_output_tokens, record.is_complete) == (4, True)
    assert alone.system.last_run.num_ended_early == 0


def test_the_step_profile_reports_each_batch_size(
    demo_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from serving.benchmarks.step_profile import main

    args = ["--model-dir", str(demo_model_dir), "--device", "cpu", "--batch", "1", "3", "--prompt-len", "8"]
    main([*args, "--steps", "2", "--repeats", "1", "--top", "2"])
    lines = capsys.readouterr().out.splitlines()
    steps = [line for line in lines if ": decode step at batch " in line]
    assert [line.split(":")[0].split()[-1] for line in steps] == ["1", "3"]
    assert all(float(line.split(": ")[2].split(" ms")[0]) > 0 for line in steps)
    assert all("host ops per layer" in line and "copied from the KV pool" in line for line in steps)
    assert sum("ms/step host" in line for line in lines) == 4  # --top 2, per batch size


def _sse_reply(replica_ttft_s: float) -> list[bytes]:
    timings = b'{"queue_s": %f, "ttft_s": %f}' % (replica_ttft_s / 4, replica_ttft_s)
    events = b'data: {"token": "a"}\n\ndata: {"finish_reason": "length", "timings": %s}\n\n' % timings
    return [SSE_HEAD, chunk(events), b"0\r\n\r\n"]


async def test_interleaved_requests_alternate_which_path_runs_first_and_pair_up_by_request() -> None:
    from serving.benchmarks.http_run import TextRequest
    from serving.benchmarks.serve_interleaved import run_interleaved

    requests = [TextRequest(f"req-{i}", float(i), f"prompt {i}", 1) for i in range(4)]
    refusal = [b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2\r\n\r\n", b"{}"]
    warm_up = _sse_reply(0.009)  # untimed, before the pairs: it opens the connection
    server = ScriptedServer([warm_up, _sse_reply(0.001), _sse_reply(0.002), refusal, _sse_reply(0.004)])
    seen: list[tuple[str, int]] = []  # (request id, API requests the server had received) per engine run

    def alone(request: TextRequest) -> float:
        seen.append((request.request_id, len(server.requests)))
        return 0.5

    statuses: Counter[str] = Counter()
    async with server.running():
        pairs = await run_interleaved(
            server.url, "k", "bench", requests, alone, mean_gap_s=0.0, seed=1, statuses=statuses
        )
    # The engine alone first, then the API first, in turn: each request's two runs back to back.
    assert seen == [("req-0", 1), ("req-1", 3), ("req-2", 3), ("req-3", 5)]
    # The refused request is counted, not paired.
    assert statuses == Counter({"200": 3, "503": 1})
    assert [(p.request_id, p.api_first, p.alone_ttft_s) for p in pairs] == [
        ("req-0", False, 0.5),
        ("req-1", True, 0.5),
        ("req-3", True, 0.5),
    ]
    assert [p.replica_ttft_s for p in pairs] == [0.001, 0.002, 0.004]
    assert [p.replica_queue_s for p in pairs] == [0.00025, 0.0005, 0.001]
    assert all(0 < p.api_ttft_s < 5 for p in pairs)


async def test_interleaved_blocks_run_each_path_in_turn_and_mark_pairs_no_other_run_came_between() -> None:
    from serving.benchmarks.http_run import TextRequest
    from serving.benchmarks.serve_interleaved import run_interleaved

    requests = [TextRequest(f"req-{i}", float(i), f"prompt {i}", 1) for i in range(5)]
    server = ScriptedServer([_sse_reply(0.009)] + [_sse_reply(0.001 * (i + 1)) for i in range(5)])
    order: list[str] = []  # "alone req-i" / "api n" (API requests the server had received by then)

    def alone(request: TextRequest) -> float:
        order.append(f"alone {request.request_id} after {len(server.requests)} api")
        return 0.5

    async with server.running():
        pairs = await run_interleaved(
            server.url, "k", "bench", requests, alone, mean_gap_s=0.0, seed=1, statuses=Counter(), block=2
        )
    # Block 0: alone req-0, req-1, then the API (warm-up + 2); block 1, the API first: req-2, req-3
    # through the API, then alone; block 2 (req-4 alone) is the engine alone's again.
    assert order == [
        "alone req-0 after 1 api",
        "alone req-1 after 1 api",
        "alone req-2 after 5 api",
        "alone req-3 after 5 api",
        "alone req-4 after 5 api",
    ]
    assert [(p.request_id, p.api_first, p.position) for p in pairs] == [
        ("req-0", False, 0),
        ("req-1", False, 1),
        ("req-2", True, 0),
        ("req-3", True, 1),
        ("req-4", False, 0),
    ]
    assert [p.replica_ttft_s for p in pairs] == [0.001, 0.002, 0.003, 0.004, 0.005]


def test_the_interleaved_report_separates_a_shift_of_every_request_from_outliers() -> None:
    from serving.benchmarks.serve_interleaved import (
        Pair,
        bootstrap_interval,
        interleaved_report,
        median_added_ms,
        p50_ttft_added_ms,
    )

    # Prompts of very different cost, each 3 ms slower through the API: 1 ms outside the replica, 2 inside,
    # of which 1.5 before the replica's first forward pass (the engine alone starts its own at once).
    pairs = [
        Pair(f"req-{i}", alone, alone + 0.003, alone + 0.002, api_first=i % 2 == 1, replica_queue_s=0.0015)
        for i, alone in enumerate([0.020, 0.100, 0.050, 0.300, 0.075, 0.040, 0.210])
    ]
    assert median_added_ms(pairs) == pytest.approx(3.0)
    assert p50_ttft_added_ms(pairs) == pytest.approx(3.0)
    assert bootstrap_interval(pairs, median_added_ms) == pytest.approx((3.0, 3.0))
    report = interleaved_report(pairs)
    assert "p50 TTFT added by the API path: +3.00 ms (95% interval +3.00 to +3.00)" in report
    assert "outside the replica (client TTFT - replica TTFT, median): 1.00 ms" in report
    assert "inside it (replica TTFT - engine-alone TTFT, median): +2.00 ms" in report
    assert "before the replica's first forward pass (its queue_s, median): 1.50 ms" in report
    assert "from that forward pass on (replica TTFT - queue_s - engine-alone TTFT, median): +0.50" in report
    assert "engine alone first +3.00 ms, API first +3.00 ms" in report
    # Two requests far slower through the API move the median difference little and widen its interval.
    slow = [Pair(p.request_id, p.alone_ttft_s, p.api_ttft_s + 0.5, None, p.api_first) for p in pairs[:2]]
    mixed = slow + pairs[2:]
    assert median_added_ms(mixed) == pytest.approx(3.0)
    low, high = bootstrap_interval(mixed, median_added_ms)
    assert low == pytest.approx(3.0) and high > 100
    assert interleaved_report([]) == "no request completed through the API: nothing to compare"
    # One pair, without the replica's timings: what cannot be computed says so.
    report = interleaved_report([Pair("req-0", 0.010, 0.013, None, api_first=False)])
    assert "outside the replica (client TTFT - replica TTFT, median): n/a" in report
    assert "before the replica's first forward pass (its queue_s, median): n/a" in report
    assert "engine alone first +3.00 ms, API first n/a" in report
    assert "block" not in report


def test_the_interleaved_report_reads_the_warm_pairs_apart() -> None:
    from serving.benchmarks.serve_interleaved import Pair, interleaved_report

    # The first pair of each block pays 8 ms for a run that followed the other path's; the rest 2 ms.
    pairs = [
        Pair(f"req-{i}", 0.100, 0.100 + (0.002 if i % 4 else 0.008), None, api_first=False, position=i % 4)
        for i in range(8)
    ]
    report = interleaved_report(pairs)
    assert "after their block's first (6 of 8), median per-request difference: +2.00 ms" in report
    assert "after their block's first (6 of 8), p50 TTFT added by the API path: +2.00 ms" in report
    assert "by place in its block: 0: +8.00 ms, 1: +2.00 ms, 2: +2.00 ms, 3: +2.00 ms" in report


def test_interleaved_refuses_a_rate_or_rounds() -> None:
    from serving.benchmarks.serve_bench import run_serve_from_options

    options = {
        "prompt_words": "4-8",
        "output_len": "2-4",
        "num_requests": 4,
        "rate": 2.0,
        "seed": 0,
        "sla_ttft_ms": 1000.0,
        "sla_tpot_ms": 100.0,
        "compare": True,
        "interleaved": True,
    }
    with pytest.raises(ValueError, match="one request at a time"):
        run_serve_from_options(options, default_model_dir=Path("unused"))
    with pytest.raises(ValueError, match="one request at a time"):
        run_serve_from_options({**options, "rate": None, "repeat": 3}, default_model_dir=Path("unused"))
    unused = Path("unused")
    for block in (0, -2):
        with pytest.raises(ValueError, match="--block is a positive number"):
            run_serve_from_options({**options, "rate": None, "block": block}, default_model_dir=unused)
    with pytest.raises(ValueError, match="--block is a positive number of requests, for --interleaved"):
        run_serve_from_options(
            {**options, "rate": None, "interleaved": False, "block": 4}, default_model_dir=Path("unused")
        )


def test_a_duration_sends_every_request_that_arrives_in_it() -> None:
    from serving.benchmarks.serve_workload import LoadSpec, make_text_workload

    timed = make_text_workload(LoadSpec(rate_per_s=4.0, duration_s=10.0, seed=5))
    assert 20 < len(timed) < 60  # ~40 at 4/s
    assert all(r.arrival_s < 10.0 for r in timed)
    # The same seed by count: the same requests, and the next one would arrive after the window.
    counted = make_text_workload(LoadSpec(num_requests=len(timed) + 1, rate_per_s=4.0, seed=5))
    assert counted[:-1] == timed
    assert counted[-1].arrival_s >= 10.0
    with pytest.raises(ValueError, match="--rate"):
        make_text_workload(LoadSpec(duration_s=10.0))  # all at once has no duration
    with pytest.raises(ValueError, match="--duration"):
        make_text_workload(LoadSpec(rate_per_s=4.0, duration_s=math.inf))  # it would never end


def _count_like_a_tokenizer(text: str) -> int:
    """A start token, then a token per word of up to 4 letters and two per longer word."""
    return 1 + sum(1 if len(word) <= 4 else 2 for word in text.split())


def test_prompt_lengths_in_tokens_are_met_exactly_where_the_words_allow() -> None:
    from serving.benchmarks.serve_workload import LoadSpec, make_text_workload

    spec = LoadSpec(num_requests=40, min_prompt_len=3, max_prompt_len=50, seed=2)
    by_words = make_text_workload(spec)
    by_tokens = make_text_workload(spec, _count_like_a_tokenizer)
    for words, tokens in zip(by_words, by_tokens, strict=True):
        target = len(words.text.split())  # the same draw: the length asked for
        assert _count_like_a_tokenizer(tokens.text) == target
        assert (tokens.arrival_s, tokens.max_tokens) == (words.arrival_s, words.max_tokens)


def test_prompt_lengths_in_tokens_on_a_real_tokenizer(demo_model_dir: Path) -> None:
    from serving.benchmarks.serve_bench import _token_counter
    from serving.benchmarks.serve_workload import LoadSpec, make_text_workload

    count_tokens = _token_counter(demo_model_dir)
    requests = make_text_workload(
        LoadSpec(num_requests=30, min_prompt_len=8, max_prompt_len=40), count_tokens
    )
    assert all(8 <= count_tokens(r.text) <= 40 for r in requests)


def test_bench_serve_options_that_contradict_each_other_are_refused() -> None:
    from serving.benchmarks.serve_bench import run_serve_from_options

    options: dict[str, object] = {
        "url": "http://127.0.0.1:9",
        "key": "k",
        "model": "m",
        "output_len": "2-4",
        "rate": 2.0,
        "seed": 0,
        "sla_ttft_ms": 1000.0,
        "sla_tpot_ms": 100.0,
        "compare": False,
    }
    unused = Path("unused")
    with pytest.raises(ValueError, match="--duration or --num-requests"):
        run_serve_from_options({**options, "duration": 5.0, "num_requests": 8}, default_model_dir=unused)
    with pytest.raises(ValueError, match=r"--prompt-len .* or --prompt-words"):
        run_serve_from_options({**options, "prompt_len": "8", "prompt_words": "8"}, default_model_dir=unused)
    with pytest.raises(ValueError, match="--tokenizer"):
        run_serve_from_options({**options, "prompt_len": "8-16"}, default_model_dir=unused)


async def test_a_stream_the_model_ends_early_counts_at_its_length() -> None:
    from serving.benchmarks.http_run import HttpRun, TextRequest
    from serving.benchmarks.serve_bench import http_report
    from serving.benchmarks.serve_workload import run_http_load, summarize

    sla = {"sla_ttft_s": 60.0, "sla_tpot_s": 60.0}

    def reply(num_tokens: int, finish_reason: str) -> list[bytes]:
        events = b'data: {"token": "a"}\n\n' * num_tokens
        events += b'data: {"finish_reason": "%s", "usage": {"prompt_tokens": 7}}\n\n' % finish_reason.encode()
        return [SSE_HEAD, chunk(events), b"0\r\n\r\n"]

    requests = [
        TextRequest("full", 0.0, "x", 3),
        TextRequest("eos", 0.0, "y", 3),
        TextRequest("cut", 0.0, "z", 3),
    ]
    # The third ran into the model's context ("length" before its max_tokens): not complete.
    server = ScriptedServer([reply(3, "length"), reply(1, "stop"), reply(2, "length")])
    async with server.running():
        run = await run_http_load(server.url, "k", "m", requests)
    assert sorted((r.num_output_tokens, r.is_complete) for r in run.records) == [
        (1, True),
        (2, False),
        (3, True),
    ]
    assert run.num_ended_early == 1  # the EOS one: its latencies count
    assert run.prompt_tokens == [7, 7, 7]
    assert run.statuses == Counter({"200": 2, "incomplete_finished_length": 1})
    summary = summarize(run, sla_ttft_s=60.0, sla_tpot_s=60.0)
    assert summary["complete"] == 2
    report = http_report(run, summary, sla_ttft_s=60.0, sla_tpot_s=60.0)
    # The cut stream misses the SLA: one of three is far more than 1%.
    assert "and p99 TPOT <= 60000 ms over all 3 requests sent (one that failed" in report
    assert ": NOT met (p99 TTFT inf ms, p99 TPOT inf ms); 2/3 (67%) within both" in report
    assert "prompt tokens (the server's count): min 7, p50 7, max 7" in report
    assert "1 streams ended (EOS or a stop string) before their max_tokens" in report
    two = HttpRun([r for r in run.records if r.is_complete], [])
    assert ": met (" in http_report(two, summarize(two, sla_ttft_s=60.0, sla_tpot_s=60.0), **sla)
    strict = summarize(two, sla_ttft_s=0.0, sla_tpot_s=60.0)
    assert ": NOT met (" in http_report(two, strict, sla_ttft_s=0.0, sla_tpot_s=60.0)


def _failed(request_id: str, sent_s: float) -> RequestRecord:
    """A request that got no token (a 503, a timeout): its record as the load client keeps it."""
    return RequestRecord(request_id, sent_s, max_tokens=2)


def test_requests_that_failed_count_against_the_sla() -> None:
    from serving.benchmarks.http_run import HttpRun
    from serving.benchmarks.serve_bench import http_report
    from serving.benchmarks.serve_workload import summarize

    sla = {"sla_ttft_s": 1.0, "sla_tpot_s": 1.0}
    # 60 fast requests and 40 that failed (503, 429, timeouts): far from meeting the SLA at p99.
    fast = [_record(f"ok-{i}", float(i), i + 0.01) for i in range(60)]
    run = HttpRun(fast + [_failed(f"failed-{i}", 60.0 + i) for i in range(40)], [])
    run.statuses.update({"200": 60, "503": 30, "429": 5, "TimeoutError": 5})
    summary = summarize(run, **sla)
    assert (summary["requests"], summary["complete"], summary["good"]) == (100, 60, 60)
    assert summary["p99_ttft_ms"] == pytest.approx(10.0)  # the completed requests' own latencies
    assert summary["sla_p99_ttft_ms"] == math.inf
    report = http_report(run, summary, **sla)
    assert "over all 100 requests sent (one that failed or did not complete misses both): NOT met" in report
    assert "60/100 (60%) within both" in report
    assert "outcomes (one per request): {'200': 60, '503': 30, '429': 5, 'TimeoutError': 5}" in report
    # One failure in 200 is within the 1% that p99 leaves over.
    many = [_record(f"ok-{i}", float(i), i + 0.01) for i in range(199)]
    one_failed = HttpRun([*many, _failed("failed", 199.0)], [])
    summary = summarize(one_failed, **sla)
    assert summary["sla_p99_ttft_ms"] == pytest.approx(10.0)
    assert ": met (p99 TTFT 10.0 ms, p99 TPOT 100.0 ms); 199/200 (100%) within both" in http_report(
        one_failed, summary, **sla
    )
    # At 100 requests, a failure counts as a request 50 times over the bound does: each is the 1% that
    # p99 leaves over (interpolated, the failure made the p99 infinite, the slow one barely moved it).
    ninety_nine = [_record(f"ok-{i}", float(i), i + 0.01) for i in range(99)]
    failed, slow = (
        HttpRun([*ninety_nine, _failed("failed", 99.0)], []),
        HttpRun([*ninety_nine, _record("slow", 99.0, 99.0 + 50.0)], []),
    )
    verdicts = [summarize(one, **sla)["sla_p99_ttft_ms"] for one in (failed, slow)]
    assert verdicts == [pytest.approx(10.0), pytest.approx(10.0)]


def test_every_throughput_divides_by_one_run_duration() -> None:
    from serving.benchmarks.http_run import HttpRun
    from serving.benchmarks.serve_bench import http_report
    from serving.benchmarks.serve_workload import summarize

    # Sent at 0.5 s and 1.0 s: the first completes at 4.1 s (2 tokens), the second times out at 10.5 s.
    run = HttpRun([_record("ok", 0.5, 4.0), _failed("late", 1.0)], [], spans_s=[(0.5, 4.1), (1.0, 10.5)])
    summary = summarize(run, sla_ttft_s=10.0, sla_tpot_s=1.0)
    assert run.duration_s == summary["duration_s"] == pytest.approx(10.0)
    assert summary["req_per_s"] == pytest.approx(0.1)
    assert summary["goodput_req_per_s"] == pytest.approx(0.1)
    assert summary["output_tok_per_s"] == pytest.approx(0.2)
    report = http_report(run, summary, sla_ttft_s=10.0, sla_tpot_s=1.0)
    assert "per second of the run's 10.00 s: from the first send to the last request's end" in report


def _stream(*pieces: bytes) -> list[bytes]:
    """A 200 event stream, each piece in a chunk of its own (a read of its own at the client)."""
    return [SSE_HEAD, *(chunk(piece) for piece in pieces), b"0\r\n\r\n"]


TOKEN = b'data: {"token": "a"}\n\n'
DONE = b'data: {"finish_reason": "length"}\n\n'


async def test_a_stream_that_ends_incomplete_is_counted_by_why() -> None:
    from serving.benchmarks.http_run import TextRequest
    from serving.benchmarks.serve_workload import run_http_load

    requests = [TextRequest(f"req-{i}", 0.0, "x", 2) for i in range(4)]
    replies = [
        _stream(TOKEN, TOKEN, DONE),  # complete
        _stream(TOKEN, TOKEN),  # a clean end, but no final event
        _stream(TOKEN, DONE),  # finished ("length") one token short
        [b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"],
    ]
    server = ScriptedServer(replies)
    async with server.running():
        run = await run_http_load(server.url, "k", "m", requests)
    assert run.statuses == Counter(
        {
            "200": 1,
            "incomplete_no_final_event": 1,
            "incomplete_finished_length": 1,
            "incomplete_not_sse": 1,
        }
    )
    assert sum(r.is_complete for r in run.records) == 1
    assert len(run.records) == len(run.spans_s) == 4 and run.duration_s > 0


async def test_each_request_counts_once_under_its_outcome() -> None:
    from serving.benchmarks.http_run import TextRequest
    from serving.benchmarks.serve_workload import run_http_load

    requests = [TextRequest(f"req-{i}", 0.0, "x", 1) for i in range(4)]
    replies = [
        _stream(TOKEN, DONE),
        _stream(TOKEN, b'data: {"finish_reason": "error"}\n\n'),  # a 200 that failed after all
        _stream(b"data: not json\n\n"),
        [b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2\r\n\r\n", b"{}"],
    ]
    server = ScriptedServer(replies)
    async with server.running():
        run = await run_http_load(server.url, "k", "m", requests)
    assert run.statuses == Counter({"200": 1, "stream_error": 1, "JSONDecodeError": 1, "503": 1})
    # The errored stream received every token and its final event, but it is not complete.
    assert sum(r.is_complete for r in run.records) == 1


async def test_inter_token_gaps_count_only_for_requests_that_complete() -> None:
    from serving.benchmarks.http_run import TextRequest
    from serving.benchmarks.serve_workload import run_http_load

    requests = [TextRequest("complete", 0.0, "x", 3), TextRequest("cut", 0.0, "y", 3)]
    # Two gaps between tokens in each stream; the second ends without its final event.
    replies = [
        _stream(TOKEN, TOKEN, TOKEN, DONE),
        _stream(TOKEN, TOKEN, TOKEN),
    ]
    server = ScriptedServer(replies)
    async with server.running():
        run = await run_http_load(server.url, "k", "m", requests)
    assert run.statuses == Counter({"200": 1, "incomplete_no_final_event": 1})
    assert len(run.inter_token_s) == 2


def test_the_seed_fixes_prompts_and_lengths_at_any_rate() -> None:
    from serving.benchmarks.serve_workload import LoadSpec, make_text_workload

    def drawn(rate: float | None) -> list[tuple[str, int]]:
        requests = make_text_workload(LoadSpec(num_requests=20, rate_per_s=rate, seed=4))
        return [(r.text, r.max_tokens) for r in requests]

    assert drawn(None) == drawn(2.0) == drawn(50.0)
    arrivals = [r.arrival_s for r in make_text_workload(LoadSpec(num_requests=20, rate_per_s=2.0, seed=4))]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and arrivals[-1] > 0


def test_a_rate_that_is_not_positive_is_refused() -> None:
    from serving.benchmarks.serve_bench import run_serve_from_options
    from serving.benchmarks.serve_workload import LoadSpec, make_text_workload

    for rate in (0.0, -2.0, math.nan):
        with pytest.raises(ValueError, match="--rate must be a positive number"):
            LoadSpec(rate_per_s=rate)
    options: dict[str, object] = {
        "url": "http://127.0.0.1:9",
        "key": "k",
        "model": "m",
        "output_len": "2-4",
        "rate": 0.0,
        "seed": 0,
        "sla_ttft_ms": 1000.0,
        "sla_tpot_ms": 100.0,
        "compare": False,
    }
    with pytest.raises(ValueError, match="leave it out to send every request at once"):
        run_serve_from_options(options, default_model_dir=Path("unused"))
    # Left out, it still means every request at once.
    assert {r.arrival_s for r in make_text_workload(LoadSpec(num_requests=5))} == {0.0}


def test_the_embed_bench_runs_both_systems_and_batches_a_burst(demo_embedding_model_dir: Path) -> None:
    out = StringIO()
    call_command(
        "bench",
        "embed",
        "--model-dir",
        str(demo_embedding_model_dir),
        "--rates",
        "5000",
        "--num-requests",
        "24",
        "--repeat",
        "2",
        "--max-batch-size",
        "8",
        stdout=out,
        stderr=StringIO(),
    )
    rows = {
        line.split()[1]: line.split() for line in out.getvalue().splitlines() if line.startswith("   5000")
    }
    assert set(rows) == {"batch", "dynamic"}
    # ... inputs/s, p50 ms, p99 ms, mean batch, padding, closes
    assert rows["batch"][-3:-1] == ["1.0", "1.00"]  # one input per pass: nothing padded
    assert float(rows["dynamic"][-3]) > 1.0  # 24 arrivals within ~5 ms share passes
    assert "dynamic / batch size 1: throughput x" in out.getvalue()
    with pytest.raises(CommandError, match="--rates must be positive"):
        call_command("bench", "embed", "--model-dir", str(demo_embedding_model_dir), "--rates", "0")


def test_the_bench_platform_takes_none_of_the_shells_own_configuration_and_leaves_nothing(
    tmp_path, monkeypatch
) -> None:
    """A per-tenant cap or compilation set in the shell would make the replica other than the engine alone
    it is compared with; a platform that did not start must not leave its processes, nor one that ran
    its copy of the model (~90 MB a run) in /tmp."""
    import subprocess
    import sys

    from serving.benchmarks.serve_platform import Platform

    monkeypatch.setenv("SWITCHYARD_MAX_RUNNING_PER_TENANT", "16")
    monkeypatch.setenv("SWITCHYARD_COMPILE", "1")
    monkeypatch.setenv("ARTIFACT_ROOT", str(tmp_path))
    platform = Platform(tmp_path, layer="embedded", engine_env={"SWITCHYARD_KV_CACHE_MB": "64"}, redis_url="")
    assert (
        "SWITCHYARD_MAX_RUNNING_PER_TENANT" not in platform.env and "SWITCHYARD_COMPILE" not in platform.env
    )
    assert "ARTIFACT_ROOT" not in platform.env and platform.env["SWITCHYARD_KV_CACHE_MB"] == "64"
    assert platform.env["SWITCHYARD_STATE_DIR"] == str(platform.state) and "PATH" in platform.env
    # As if its start had spawned a process and then failed: stop ends it, and keeps the logs.
    platform.processes.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    platform.stop(keep_state=True)
    assert platform.processes[0].poll() is not None and platform.state.is_dir()
    platform.stop()
    assert not platform.state.exists()
