"""The benchmark's printed report: one table of the systems, ratios, then (e) to (h)."""

from __future__ import annotations

import os
import statistics

from serving.benchmarks.engine_results import BenchReport


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def _ratios_per_round(report: BenchReport) -> list[str]:
    """Ratios within each round (the systems ran back to back), with the round's worst CPU pressure:
    load on a shared machine slows some systems far more than others (one request at a time suffers
    most), so only a quiet round's ratios say much."""
    engine = report.results["d"]
    lines = []
    for index, engine_run in enumerate(engine.runs):
        ratios, pressures = [], []
        for key, result in report.results.items():
            if index < len(result.conditions) and result.conditions[index].cpu_pressure is not None:
                pressures.append(result.conditions[index].cpu_pressure or 0.0)
            if key != "d" and index < len(result.runs) and result.runs[index].output_tokens_per_s > 0:
                ratio = engine_run.output_tokens_per_s / result.runs[index].output_tokens_per_s
                ratios.append(f"{ratio:.2f}x ({key})")
        worst = f"max psi {max(pressures):.0%}" if pressures else "psi unknown"
        lines.append(f"    round {index + 1} ({worst}): " + ", ".join(ratios))
    return lines


def format_report(report: BenchReport) -> str:
    config = report.config
    spec = config.workload
    lines = [
        f"Switchyard engine benchmark, {report.started_at}",
        f"model: {report.model.describe()}",
        f"torch threads: {report.num_torch_threads} (os.cpu_count() = {os.cpu_count()})",
    ]
    arrival = "all at t=0" if spec.arrival == "all" else f"Poisson at {spec.rate_per_s:g}/s"
    lines.append(
        f"workload: {spec.num_requests} requests, seed {spec.seed}, prompts {spec.min_prompt_tokens}-"
        f"{spec.max_prompt_tokens} tokens ({report.num_prompt_tokens} in all), outputs "
        f"{spec.min_output_tokens}-{spec.max_output_tokens} tokens, arrivals {arrival}; greedy, ignore_eos"
    )
    kv_mib = (config.kv_cache_bytes or 0) / 2**20
    lines.append(
        f"limits: engine and hf-continuous max_num_seqs {config.max_num_seqs}, max_num_batched_tokens "
        f"{config.max_num_batched_tokens}; engine block {config.block_size}, KV budget {kv_mib:.0f} MiB, "
        f"compile {'on' if config.compile else 'off'}; static batch size {config.static_batch_size}"
    )
    lines.append(f"engine: {report.engine_paths or 'n/a'}")
    lines.append(f"runs per system: {config.repeat} (medians of each figure over the runs)")
    lines.append("")
    header = (
        f"{'system':<19}{'out tok/s':>10}{'p50 TTFT s':>12}{'p99 TTFT s':>12}{'p50 TPOT ms':>13}"
        f"{'p99 TPOT ms':>13}{'p50 e2e s':>11}{'setup s':>9}{'cpu':>6}{'psi':>6}  tok/s per run"
    )
    lines += [header, "-" * len(header)]
    for key, result in report.results.items():
        label = f"({key}) {result.name}"
        median = result.median
        if median is None:
            lines.append(f"{label:<19}{result.unavailable_reason or 'not run'}")
            continue
        per_run = ", ".join(f"{r.output_tokens_per_s:.1f}" for r in result.runs)
        pressure = result.median_cpu_pressure
        psi = "-" if pressure is None else f"{pressure:.0%}"
        lines.append(
            f"{label:<19}{median.output_tokens_per_s:>10.1f}{median.p50_ttft_s:>12.2f}{median.p99_ttft_s:>12.2f}"
            f"{_ms(median.p50_tpot_s):>13}{_ms(median.p99_tpot_s):>13}{median.p50_e2e_s:>11.2f}"
            f"{result.setup_s:>9.1f}{result.median_cpu_share:>6.0%}{psi:>6}  {per_run}"
        )
    lines.append(
        f"(output tokens per run: {report.num_output_tokens}; "
        f"cpu: CPU time this process got over wall time x {os.cpu_count()} cores; "
        "psi: share of wall time some task on the machine waited for a CPU)"
    )
    lines.append("")
    engine = report.results.get("d")
    engine_median = engine.median if engine is not None else None
    if engine is None or engine_median is None:
        lines.append("ratios: (d) engine not measured")
    else:
        ratios = []
        for key, result in report.results.items():
            median = result.median
            if key != "d" and median is not None and median.output_tokens_per_s > 0:
                ratio = engine_median.output_tokens_per_s / median.output_tokens_per_s
                ratios.append(f"{ratio:.2f}x ({key}) {result.name}")
        lines.append("(d) engine throughput: " + (", ".join(ratios) if ratios else "no baseline measured"))
        if config.repeat > 1 and ratios:
            lines += _ratios_per_round(report)
    run = report.engine_run
    # Every token but each request's last output goes through the model once.
    num_workload_tokens = report.num_prompt_tokens + report.num_output_tokens - spec.num_requests
    if run is None or run.num_kv_samples == 0:
        lines.append("(e) KV waste: engine not measured")
    else:
        lines.append(
            f"(e) KV waste (allocated slots not holding a token) over the run's slot-steps "
            f"{run.run_kv_waste:.1%}; after each of {run.num_kv_samples} steps: max {run.max_kv_waste:.1%}, "
            f"mean {run.mean_kv_waste:.1%} (block size {config.block_size}, "
            f"{'tails in half blocks' if run.half_block_tails else 'whole blocks only'}); "
            f"engine steps {run.num_steps}, "
            f"mean {run.mean_num_batched_tokens:.0f} tokens/step, max running {run.max_num_running}, "
            f"preemptions {run.num_preemptions}; {run.num_batched_tokens} tokens computed for a workload "
            f"of {num_workload_tokens} (fewer: prefix-cache hits; more: recomputation after preemption)"
        )
    c = report.concurrency
    lines.append(
        f"(f) KV budget {c.kv_cache_bytes / 2**20:.0f} MiB = {c.budget_slots} token slots, "
        f"sequences at their final length: contiguous max-length ({c.max_model_len}/seq) "
        f"fits {c.num_contiguous}, paged ({c.block_size}-token blocks) fits {c.num_paged}: {c.ratio:.1f}x "
        f"(contiguous sized exactly to prompt + max_tokens: {c.num_contiguous_exact})"
    )
    limit = report.cpu_limit
    if limit is None:
        lines.append("(g) CPU arithmetic limit: not measured")
    else:
        bound = limit.decode_tokens_per_s_bound
        onednn = limit.onednn_best_flops_per_s
        line = (
            f"(g) CPU limit: fp32 matmul {limit.matmul_size}^3 "
            f"best {limit.best_flops_per_s / 1e9:.1f} GFLOP/s "
            f"(median {limit.median_flops_per_s / 1e9:.1f}; "
            f"torch.matmul {limit.blas_best_flops_per_s / 1e9:.1f}, "
            f"oneDNN {'n/a' if onednn is None else f'{onednn / 1e9:.1f}'}); "
            f"2 x {limit.num_matmul_params / 1e6:.2f}M FLOPs/token -> decode bound {bound:.0f} tok/s"
        )
        if engine_median is not None:
            share = limit.share_counting_prompt_tokens(report.num_prompt_tokens, engine_median)
            line += (
                f"; engine {engine_median.output_tokens_per_s / bound:.1%} of it in output tokens, "
                f"{share:.1%} counting prompt tokens too"
            )
        lines.append(line)
    if report.breakdowns:
        # One profile after each run of (d); the median of each figure.
        step_ms = statistics.median(b.step_ms for b in report.breakdowns)
        ops = statistics.median(b.host_ops_per_layer for b in report.breakdowns)
        share = statistics.median(b.attention_share for b in report.breakdowns)
        copied = statistics.median(b.bytes_copied_per_step for b in report.breakdowns)
        first = report.breakdowns[0]
        lines.append(
            f"(i) (d)'s decode step at batch {first.batch}, context {first.context_len} (median of "
            f"{len(report.breakdowns)} profiles, one after each run): {step_ms:.2f} ms, {ops:.1f} host ops "
            f"per layer, attention {share:.0%} of the step, {copied / 2**20:.1f} MiB copied from the KV pool "
            f"per step; the step's heaviest host ops: "
            + ", ".join(f"{name} {ms:.2f} ms" for name, ms, _ in first.top_ops[:4])
        )
    if report.scheduler_ms_per_step is not None:
        lines.append(
            f"(h) scheduler time per step at 256 running sequences (simulated executor): "
            f"{report.scheduler_ms_per_step:.3f} ms (median)"
        )
    else:
        lines.append(f"(h) scheduler overhead: {report.scheduler_unavailable_reason or 'not measured'}")
    lines.append(f"total benchmark time: {report.total_s:.0f} s")
    return "\n".join(lines)
