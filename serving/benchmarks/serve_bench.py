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
import math
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from serving.benchmarks.http_run import HttpRun, TextRequest
from serving.benchmarks.openai_load import run_openai_load
from serving.benchmarks.serve_compare import CompareRound, EngineAlone, path_ttft_ms, rounds_report
from serving.benchmarks.serve_interleaved import Pair, interleaved_report, run_interleaved
from serving.benchmarks.serve_platform import REPO_ROOT, Platform, quota_flood
from serving.benchmarks.serve_workload import (
    WARM_UP_PREFIX,
    LoadSpec,
    make_text_workload,
    run_http_load,
    summarize,
)
from serving.benchmarks.workload import percentile

# --- one request at a time, on each path in turn ----------------------------------------------------


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
    add(
        "--server",
        choices=["uvicorn", "daphne"],
        default="uvicorn",
        help="for --compare: the web server the throwaway platform runs (manage.py serve --server)",
    )
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
        lines.append(f"{key:<28}" + "".join(f"{_cell(row.get(key)):>22}" for row in rows.values()))
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    """A figure the column does not have (the engine alone has no ITL; a run with none to measure) is a
    dash, not `nan`."""
    return "-" if value is None or math.isnan(value) else f"{value:.2f}"


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
        f"p50 TTFT {alone['p50_ttft_ms']:.0f} ms, {alone['ended_early']:.0f} ended by EOS; "
        f"the platform kept {kept:.1%} of it"
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
    if run.num_textless_output_tokens:  # in output_tok_per_s, as the engine alone counts them
        lines.append(f"{run.num_textless_output_tokens} tokens of streams without text in output_tok_per_s")
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
        model_dir,
        layer=str(options["layer"]),
        engine_env=engine_env,
        redis_url=str(options["redis_url"]),
        server=str(options.get("server") or "uvicorn"),
    )
    log(f"starting a platform ({options['layer']}, {platform.server}) in {platform.state} ...")
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
