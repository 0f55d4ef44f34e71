"""The int8 sibling of the bench model against its parent (docs/benchmarks.md, "Quantized siblings"):
weight bytes, engine throughput on one seeded workload (the parent on its default forward, the fused
Llama one, and on transformers' modules, the path the sibling takes; rounds interleaved, medians), and
the sibling's perplexity and greedy agreement against the parent on the shipped held-out text.

    .venv/bin/python -m serving.benchmarks.quantized_bench [--rounds 3] [--num-requests 32]

The engine alone, in this process: no Django, no registry (`manage.py quantize` is what registers a
sibling; this measures the same files)."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from serving.benchmarks.bench_model import ensure_bench_model, read_model_info
from serving.benchmarks.engine_system import EngineSystem
from serving.benchmarks.workload import WorkloadSpec, compute_metrics, make_workload
from serving.engine.quality import DEFAULT_TEXT, evaluate
from serving.engine.quantize import write_int8_sibling

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[2] / "var" / "bench-model"


@dataclass(slots=True)
class SystemRuns:
    label: str
    tokens_per_s: list[float] = field(default_factory=list)
    tpot_p50_ms: list[float] = field(default_factory=list)
    describe: str = ""

    @property
    def median_tokens_per_s(self) -> float:
        return statistics.median(self.tokens_per_s)


def run(model_dir: Path, *, rounds: int, spec: WorkloadSpec, quality: bool, log=print) -> str:  # type: ignore[no-untyped-def]
    torch.set_num_threads(os.cpu_count() or 1)
    ensure_bench_model(model_dir, log=log)
    info = read_model_info(model_dir)
    lines = [f"model: {info.describe()}; torch threads {torch.get_num_threads()}; torch {torch.__version__}"]
    with tempfile.TemporaryDirectory(prefix="quantized-bench-") as tmp:
        began = time.perf_counter()
        written = write_int8_sibling(model_dir, Path(tmp) / "int8")
        lines.append(
            f"int8 sibling written in {time.perf_counter() - began:.1f} s: {len(written.modules)} Linear "
            f"layers int8, {', '.join(written.kept)} kept fp32; weights "
            f"{written.weight_bytes / 2**20:.1f} MiB vs {written.source_weight_bytes / 2**20:.1f} MiB fp32 "
            f"= {written.weight_ratio:.1%} (target <= 30%)"
        )
        log(lines[-1])
        requests = make_workload(spec, vocab_size=info.vocab_size, special_token_ids=info.special_ids)
        kv_bytes = (
            32 * -(-(spec.max_prompt_tokens + spec.max_output_tokens) // 16) * 16 * info.kv_bytes_per_token
        )
        options = {
            "max_num_seqs": 32,
            "max_num_batched_tokens": 512,
            "kv_cache_bytes": kv_bytes,
            "block_size": 16,
            "compile": False,
        }
        systems = {
            "parent (fp32, default forward)": EngineSystem(model_dir, **options),  # type: ignore[arg-type]
            "parent (fp32, generic forward)": EngineSystem(model_dir, forward="generic", **options),  # type: ignore[arg-type]
            "int8 sibling (generic forward)": EngineSystem(written.directory, **options),  # type: ignore[arg-type]
        }
        results = {
            label: SystemRuns(label, describe=system.describe_paths()) for label, system in systems.items()
        }
        for system in systems.values():
            system.run(requests[:3])  # warm-up
        for round_index in range(rounds):  # interleaved: a shared machine's drift spreads over all three
            for label, system in systems.items():
                metrics = compute_metrics(system.run(requests))
                results[label].tokens_per_s.append(metrics.output_tokens_per_s)
                results[label].tpot_p50_ms.append(metrics.p50_tpot_s * 1000)
                rate = metrics.output_tokens_per_s
                log(f"round {round_index + 1}/{rounds} {label}: {rate:.1f} output tok/s")
        parent = results["parent (fp32, default forward)"].median_tokens_per_s
        lines.append(
            f"workload: {spec.num_requests} requests at once, prompts {spec.min_prompt_tokens}-"
            f"{spec.max_prompt_tokens}, outputs {spec.min_output_tokens}-{spec.max_output_tokens} tokens; "
            f"{rounds} rounds interleaved, medians"
        )
        for label, runs in results.items():
            rates = ", ".join(f"{r:.0f}" for r in runs.tokens_per_s)
            median = runs.median_tokens_per_s
            lines.append(
                f"  {label}: {median:.1f} output tok/s ({median / parent:.0%} of the parent's default)"
                f", TPOT p50 {statistics.median(runs.tpot_p50_ms):.1f} ms; "
                f"rounds {rates} [{runs.describe}]"
            )
        if quality:
            began = time.perf_counter()
            report = evaluate(model_dir, written.directory, text=DEFAULT_TEXT.read_text())
            lines.append(
                f"quality on {DEFAULT_TEXT.name} ({report.num_tokens} tokens, "
                f"{time.perf_counter() - began:.0f} s): "
                f"perplexity {report.perplexity:.3f} vs parent {report.parent_perplexity:.3f} "
                f"({report.perplexity_increase:+.3%}), greedy agreement {report.greedy_agreement:.2%}"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-quality", action="store_true")
    args = parser.parse_args()
    if args.rounds < 3:
        parser.error("--rounds must be at least 3 (medians)")
    spec = WorkloadSpec(
        num_requests=args.num_requests,
        seed=args.seed,
        min_prompt_tokens=16,
        max_prompt_tokens=128,
        min_output_tokens=16,
        max_output_tokens=64,
    )
    print(run(args.model_dir, rounds=args.rounds, spec=spec, quality=not args.skip_quality))


if __name__ == "__main__":
    main()
