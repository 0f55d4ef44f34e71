"""`manage.py bench engine`: one process, one model, one seeded workload, every selected system.

Systems: (a) naive, (b) static batching, (c) transformers' continuous batching (baselines.py) and
(d) this engine (serving.engine.engine, imported lazily: reported as not available until it exists).
Also reported: (e) the engine's KV waste, (f) concurrent sequences a KV budget holds with paged blocks
versus contiguous max-length allocation, (g) this CPU's arithmetic limit for the model, and (h) the
scheduler's own time per step at 256 running sequences (simulated executor)."""

from __future__ import annotations

import argparse
import datetime
import math
import os
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from serving.benchmarks.bench_model import ModelInfo, ensure_bench_model, read_model_info
from serving.benchmarks.engine_results import SYSTEMS, BenchConfig, BenchReport, Log, SystemResult
from serving.benchmarks.engine_system import EngineSystem
from serving.benchmarks.limits import (
    ConditionsMeter,
    concurrency_at_budget,
    measure_cpu_limit,
    measure_scheduler_overhead_ms,
)
from serving.benchmarks.progress import ticking
from serving.benchmarks.report import format_report
from serving.benchmarks.step_breakdown import decode_breakdown
from serving.benchmarks.workload import (
    BenchRequest,
    RunMetrics,
    WorkloadSpec,
    compute_metrics,
    make_workload,
)


def default_kv_cache_bytes(config: BenchConfig, model: ModelInfo) -> int:
    spec = config.workload
    max_len = spec.max_prompt_tokens + spec.max_output_tokens
    num_blocks = config.max_num_seqs * -(-max_len // config.block_size)
    return num_blocks * config.block_size * model.kv_bytes_per_token


def _build_system(key: str, model_dir: Path, config: BenchConfig, kv_cache_bytes: int) -> Any:
    from serving.benchmarks.baselines import HFContinuousSystem, NaiveSystem, StaticBatchSystem

    spec = config.workload
    if key == "a":
        return NaiveSystem(model_dir)
    if key == "b":
        return StaticBatchSystem(model_dir, max_batch_size=config.static_batch_size)
    if key == "c":
        return HFContinuousSystem(
            model_dir,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=spec.max_prompt_tokens + spec.max_output_tokens,
        )
    return EngineSystem(
        model_dir,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_cache_bytes=kv_cache_bytes,
        block_size=config.block_size,
        compile=config.compile,
        pack_linear=config.pack_linear,
        forward=config.forward,
        attention=config.attention,
        half_block_tails=config.half_block_tails,
    )


def _warmup_requests(vocab_size: int, special_ids: Sequence[int]) -> list[BenchRequest]:
    spec = WorkloadSpec(
        num_requests=3, seed=12345, max_prompt_tokens=48, min_output_tokens=4, max_output_tokens=8
    )
    return make_workload(spec, vocab_size=vocab_size, special_token_ids=special_ids)


def run_benchmark(model_dir: str | Path, config: BenchConfig, *, log: Log = lambda _: None) -> BenchReport:
    import torch

    config.validate()
    began = time.perf_counter()
    torch.set_num_threads(os.cpu_count() or 1)
    model_dir = Path(model_dir)
    model = read_model_info(model_dir)
    requests = make_workload(
        config.workload, vocab_size=model.vocab_size, special_token_ids=model.special_ids
    )
    kv_cache_bytes = config.kv_cache_bytes or default_kv_cache_bytes(config, model)
    report = BenchReport(
        config=replace(config, kv_cache_bytes=kv_cache_bytes),
        model=model,
        num_torch_threads=torch.get_num_threads(),
        started_at=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        results={key: SystemResult(key, SYSTEMS[key]) for key in config.systems},
        concurrency=concurrency_at_budget(requests, model, kv_cache_bytes, config.block_size),
        num_prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
        num_output_tokens=sum(r.max_tokens for r in requests),
    )
    log(f"torch threads: {report.num_torch_threads}; model: {model.describe()}")
    if config.measure_cpu_limit:  # first, so that each run's line can say its share of it
        report.cpu_limit = measure_cpu_limit(model.num_matmul_params)
    systems: dict[str, Any] = {}
    for key in config.systems:
        result = report.results[key]
        setup_began = time.perf_counter()
        try:
            systems[key] = _build_system(key, model_dir, config, kv_cache_bytes)
        except ImportError as exc:  # the engine facade is not written yet
            result.unavailable_reason = f"not available ({exc})"
            log(f"({key}) {result.name}: {result.unavailable_reason}")
            continue
        if isinstance(systems[key], EngineSystem):
            report.engine_paths = systems[key].describe_paths()
        if config.warmup:
            systems[key].run(_warmup_requests(model.vocab_size, model.special_ids))
        result.setup_s = time.perf_counter() - setup_began
        log(f"({key}) {result.name}: loaded and warmed up in {result.setup_s:.1f} s")
    # Rounds interleave the systems, so slow drift in a shared machine's load spreads over all of them.
    last_run_s: dict[str, float] = {}
    for round_index in range(config.repeat):
        for key, system in systems.items():
            result = report.results[key]
            run_began = time.perf_counter()
            meter = ConditionsMeter()
            what = f"({key}) {result.name} run {round_index + 1}/{config.repeat}"
            with ticking(log, what, expected_s=last_run_s.get(key)):
                records = system.run(requests)
            result.conditions.append(meter.read())
            result.records = sorted(records, key=lambda r: r.arrival_s)
            result.runs.append(compute_metrics(records))
            run_s = last_run_s[key] = time.perf_counter() - run_began
            conditions = result.conditions[-1]
            pressure = (
                "" if conditions.cpu_pressure is None else f", CPU pressure {conditions.cpu_pressure:.0%}"
            )
            m = result.runs[-1]
            log(
                f"{what}: "
                f"{m.output_tokens_per_s:.1f} output tok/s in {run_s:.1f} s, TTFT p50/p99 "
                f"{m.p50_ttft_s:.2f}/{m.p99_ttft_s:.2f} s, TPOT p50/p99 {m.p50_tpot_s * 1000:.1f}/"
                f"{m.p99_tpot_s * 1000:.1f} ms "
                f"(this process used {conditions.cpu_share:.0%} of the CPUs{pressure})"
            )
            if isinstance(system, EngineSystem):
                report.engine_run = system.last_run
                # After the run, never inside it: profiling slows what it watches.
                try:
                    breakdown = decode_breakdown(system.engine, batch=config.max_num_seqs)
                except ValueError as exc:  # a KV budget too small to hold a batch of decodes
                    log(f"    {_share_of_limit(report, m)}no decode step profiled: {exc}")
                else:
                    report.breakdowns.append(breakdown)
                    log(f"    {_share_of_limit(report, m)}{breakdown.describe()}")
    if config.measure_scheduler:
        report.scheduler_ms_per_step, report.scheduler_unavailable_reason = measure_scheduler_overhead_ms()
    report.total_s = time.perf_counter() - began
    return report


def _share_of_limit(report: BenchReport, metrics: RunMetrics) -> str:
    """This run's tokens/s as a share of the CPU's arithmetic limit (g), counting prompt tokens too."""
    limit = report.cpu_limit
    if limit is None or metrics.makespan_s <= 0:
        return ""
    share = limit.share_counting_prompt_tokens(report.num_prompt_tokens, metrics)
    return f"{share:.1%} of the CPU limit counting prompt tokens; "


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = BenchConfig()
    spec = defaults.workload
    parser.add_argument("--num-requests", type=int, default=spec.num_requests)
    parser.add_argument("--seed", type=int, default=spec.seed)
    parser.add_argument("--arrival", choices=("all", "poisson"), default=spec.arrival)
    parser.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second")
    parser.add_argument("--prompt-tokens", default=f"{spec.min_prompt_tokens}-{spec.max_prompt_tokens}")
    parser.add_argument("--output-tokens", default=f"{spec.min_output_tokens}-{spec.max_output_tokens}")
    parser.add_argument("--systems", default=",".join(defaults.systems), help="a subset of a,b,c,d")
    parser.add_argument("--model-dir", default=None, help="default: the bench model, built if missing")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    parser.add_argument("--static-batch-size", type=int, default=defaults.static_batch_size)
    parser.add_argument("--kv-cache-mib", type=float, default=None)
    parser.add_argument("--block-size", type=int, default=defaults.block_size, help="engine KV block, tokens")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=defaults.compile)
    parser.add_argument(
        "--pack-linear",
        action=argparse.BooleanOptionalAction,
        default=defaults.pack_linear,
        help="(d): Linear weights in oneDNN's format on a CPU (default: if timing both at load says it "
        "pays); the baselines run transformers as shipped",
    )
    parser.add_argument(
        "--forward",
        choices=("auto", "fused", "generic"),
        default=defaults.forward,
        help="(d): the engine's own Llama forward (fused) or transformers' modules (generic)",
    )
    parser.add_argument(
        "--attention",
        choices=("auto", "native", "gather"),
        default=defaults.attention,
        help="(d): the native paged kernel or gather + SDPA",
    )
    parser.add_argument(
        "--half-block-tails",
        action=argparse.BooleanOptionalAction,
        default=defaults.half_block_tails,
        help="(d): a sequence's tail of up to half a block kept in half a block (with the native kernel)",
    )
    parser.add_argument(
        "--repeat", type=int, default=defaults.repeat, help="runs per system; medians reported"
    )
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--skip-cpu-limit", action="store_true")
    parser.add_argument("--skip-scheduler", action="store_true")


def _token_range(text: str, name: str) -> tuple[int, int]:
    low, sep, high = text.partition("-")
    try:
        return (int(low), int(high)) if sep else (int(low), int(low))
    except ValueError:
        raise ValueError(f"{name} must look like 16-256, got {text!r}") from None


def config_from_options(options: dict[str, Any]) -> BenchConfig:
    min_prompt, max_prompt = _token_range(str(options["prompt_tokens"]), "--prompt-tokens")
    min_output, max_output = _token_range(str(options["output_tokens"]), "--output-tokens")
    kv_mib = options.get("kv_cache_mib")
    return BenchConfig(
        workload=WorkloadSpec(
            num_requests=options["num_requests"],
            seed=options["seed"],
            min_prompt_tokens=min_prompt,
            max_prompt_tokens=max_prompt,
            min_output_tokens=min_output,
            max_output_tokens=max_output,
            arrival=options["arrival"],
            rate_per_s=options.get("rate"),
        ),
        systems=tuple(s.strip() for s in str(options["systems"]).split(",") if s.strip()),
        max_num_seqs=options["max_num_seqs"],
        max_num_batched_tokens=options["max_num_batched_tokens"],
        static_batch_size=options["static_batch_size"],
        block_size=options.get("block_size") or BenchConfig.block_size,
        kv_cache_bytes=None if kv_mib is None else math.ceil(kv_mib * 2**20),
        compile=options["compile"],
        pack_linear=options.get("pack_linear"),
        forward=options.get("forward") or BenchConfig.forward,
        attention=options.get("attention") or BenchConfig.attention,
        half_block_tails=options.get("half_block_tails", BenchConfig.half_block_tails),
        repeat=options["repeat"],
        warmup=not options.get("no_warmup", False),
        measure_cpu_limit=not options.get("skip_cpu_limit", False),
        measure_scheduler=not options.get("skip_scheduler", False),
    )


def run_from_options(options: dict[str, Any], *, default_model_dir: Path, log: Log = print) -> str:
    """Parse options, build the bench model if needed, run, and return the formatted report."""
    config = config_from_options(options)
    config.validate()
    model_dir = Path(options["model_dir"]) if options.get("model_dir") else default_model_dir
    if not options.get("model_dir"):
        ensure_bench_model(model_dir, log=log)
    return format_report(run_benchmark(model_dir, config, log=log))
