"""`manage.py bench lora` (or `python -m serving.benchmarks.lora_bench`): what serving LoRA adapters
in one continuous batch costs the engine.

(a) Throughput: the engine workload of `bench engine` (seeded, greedy, every request at t=0, the bench
model, the same engine settings) run on one engine with its requests spread evenly over `--adapters`
random rank-`--rank` adapters (all seven projections), against the same requests on the base alone.
Rounds alternate which goes first, each run as its own tenant (so no run reuses another's prefix-cache
blocks); the figure is the median of the rounds' own ratios (target >= 0.70), in wall time and in this
process's CPU time (which a machine shared with other work disturbs less). The adapters are installed
before the first round, by a few short requests, so the rounds time serving them, not loading them.
(b) An adapter's load on first use: read_adapter of its PEFT directory plus its install into the
engine's layout (runner.prepare_adapter), the median and worst over the adapters (target < 200 ms).
(c) One site's update (the fused QKV of one layer) at a batch of decodes spread over the adapters, as
the engine groups rows by adapter, against a bmm over A and B gathered per row: the choice
lora_batch.py made.

The adapters are random (A with the scale of PEFT's init, B small and non-zero) and written as PEFT
writes them (adapter_config.json + adapter_model.safetensors) under the state directory, once."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serving.benchmarks.bench_model import ensure_bench_model, read_model_info
from serving.benchmarks.engine_bench import default_kv_cache_bytes
from serving.benchmarks.engine_results import BenchConfig, Log
from serving.benchmarks.workload import WorkloadSpec, make_workload

# serving.engine.lora's TARGET_MODULES, spelled out: importing it loads torch, which `manage.py bench
# --help` need not.
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

if TYPE_CHECKING:
    import torch

    from serving.engine.engine import Engine
    from serving.engine.lora import LoraAdapter
    from serving.engine.lora_batch import SiteWeights


@dataclass
class LoraBenchResult:
    rounds: list[tuple[Speed, Speed]] = field(default_factory=list)  # (base, mixed)
    load_ms: list[float] = field(default_factory=list)  # read + install, per adapter
    site_us: dict[str, float] = field(default_factory=dict)  # (c): grouped and gathered-bmm, per call

    @property
    def ratio(self) -> float:
        return statistics.median(mixed.wall / base.wall for base, mixed in self.rounds)

    @property
    def cpu_ratio(self) -> float:
        return statistics.median(mixed.cpu / base.cpu for base, mixed in self.rounds)


@dataclass(frozen=True)
class Speed:
    """A run's output tokens per second of wall time, and per second of this process's CPU time (on a
    machine shared with other work the wall clock counts their time too; the CPU clock mostly not)."""

    wall: float
    cpu: float


def _run(engine: Engine, requests: list[Any], adapters: list[LoraAdapter | None], tenant: str) -> Speed:
    """Every request at once, stepped to the end."""
    started, cpu_started = time.perf_counter(), time.process_time()
    for index, request in enumerate(requests):
        adapter = adapters[index % len(adapters)]
        engine.add_request(
            f"{tenant}-{index}",
            list(request.prompt_token_ids),
            request.params,
            tenant_id=tenant,
            adapter=adapter,
        )
    num_tokens = 0
    while engine.has_unfinished():
        num_tokens += sum(len(out.new_token_ids) for out in engine.step())
    return Speed(
        num_tokens / (time.perf_counter() - started), num_tokens / (time.process_time() - cpu_started)
    )


def _block_diagonal(site: SiteWeights, num_out: int) -> torch.Tensor:
    """The site's B as one [n x rank, out] matrix, zeros off its targets' blocks."""
    import torch

    b = torch.zeros(site.a.shape[1], num_out)
    for index, (start, end, part) in enumerate(site.b):
        b[index * site.rank : (index + 1) * site.rank, start:end] = part
    return b


def _site_timings(
    adapters: list[LoraAdapter], engine: Engine, batch: int, repeats: int = 50
) -> dict[str, float]:
    """(c): µs per call of one layer's QKV update for `batch` decode rows spread over the adapters."""
    import numpy as np
    import torch

    from serving.engine.lora_batch import LoraStep, SiteWeights

    weights = [engine.runner.prepare_adapter(a) for a in adapters]
    sites = [w[0][0] for w in weights]
    assert all(isinstance(s, SiteWeights) for s in sites)
    num_in = sites[0].a.shape[0] if sites[0] is not None else 0
    num_out = engine.runner.fused.q_size + 2 * engine.runner.fused.kv_size if engine.runner.fused else 0
    x, out = torch.randn(batch, num_in), torch.zeros(batch, num_out)
    step = LoraStep(
        [weights[i % len(weights)] for i in range(batch)], np.ones(batch, np.int64), torch.device("cpu")
    )
    a_stack = torch.stack([s.a for s in sites if s is not None])  # [N, in, n x r]
    b_stack = torch.stack([_block_diagonal(s, num_out) for s in sites if s is not None])  # [N, n x r, out]
    slot = torch.arange(batch) % len(sites)

    def grouped() -> None:
        step.add(out, x, 0, 0)

    def gathered() -> None:
        xa = torch.bmm(x.unsqueeze(1), a_stack.index_select(0, slot))
        out.add_(torch.bmm(xa, b_stack.index_select(0, slot)).squeeze(1))

    timings = {}
    with torch.inference_mode():
        for name, call in (("grouped", grouped), ("gathered bmm", gathered)):
            call()
            times = []
            for _ in range(repeats):
                began = time.perf_counter()
                call()
                times.append(time.perf_counter() - began)
            timings[name] = statistics.median(times) * 1e6
    return timings


def run_lora_benchmark(
    model_dir: Path,
    adapter_root: Path,
    *,
    num_adapters: int,
    rank: int,
    rounds: int,
    spec: WorkloadSpec,
    log: Log,
    targets: tuple[str, ...] = ALL_TARGETS,
) -> LoraBenchResult:
    import torch

    from serving.engine.demo_adapter import write_random_adapter
    from serving.engine.engine import Engine, EngineConfig
    from serving.engine.lora import read_adapter

    bench = BenchConfig(workload=spec)
    model = read_model_info(model_dir)
    engine = Engine(
        model_dir,
        config=EngineConfig(
            max_num_seqs=bench.max_num_seqs,
            max_num_batched_tokens=bench.max_num_batched_tokens,
            kv_cache_bytes=default_kv_cache_bytes(bench, model),
            block_size=bench.block_size,
            max_loras=num_adapters,
            max_lora_rank=rank,
        ),
    )
    engine.warmup()
    log(f"engine: {engine.runner.describe()}; {torch.get_num_threads()} torch threads")
    result = LoraBenchResult()
    dirs = [
        write_random_adapter(
            model_dir, adapter_root / f"r{rank}-{_short(targets)}-{i}", rank=rank, seed=i, targets=targets
        )
        for i in range(num_adapters)
    ]
    adapters: list[LoraAdapter] = []
    for index, directory in enumerate(dirs):
        began = time.perf_counter()
        adapter = read_adapter(directory, f"bench-r{rank}-{index}", engine.runner.model.config, max_rank=rank)
        engine.runner.prepare_adapter(adapter)
        result.load_ms.append((time.perf_counter() - began) * 1000)
        adapters.append(adapter)
    log(
        f"(b) load on first use, read + install: median {statistics.median(result.load_ms):.1f} ms, "
        f"worst {max(result.load_ms):.1f} ms"
    )
    requests = make_workload(spec, vocab_size=model.vocab_size, special_token_ids=model.special_ids)
    warm = make_workload(
        WorkloadSpec(num_requests=num_adapters, seed=99, max_prompt_tokens=32, max_output_tokens=32),
        vocab_size=model.vocab_size,
        special_token_ids=model.special_ids,
    )
    _run(engine, warm, list(adapters), "warm-adapters")  # installs every adapter, outside the rounds
    _run(engine, warm, [None], "warm-base")
    for index in range(rounds):
        order = ("base", "mixed") if index % 2 == 0 else ("mixed", "base")
        speeds: dict[str, Speed] = {}
        for kind in order:
            chosen: list[LoraAdapter | None] = [None] if kind == "base" else list(adapters)
            speeds[kind] = _run(engine, requests, chosen, f"round{index}-{kind}")
        result.rounds.append((speeds["base"], speeds["mixed"]))
        base, mixed = speeds["base"], speeds["mixed"]
        log(
            f"(a) round {index + 1}/{rounds}: base {base.wall:.0f} tok/s ({base.cpu:.0f} per CPU second), "
            f"{num_adapters} adapters {mixed.wall:.0f} tok/s ({mixed.cpu:.0f}), ratio "
            f"{mixed.wall / base.wall:.3f} (CPU time {mixed.cpu / base.cpu:.3f})"
        )
    stats = engine.stats()
    log(
        f"adapters resident {len(stats.adapters_resident)}, loads {stats.num_adapter_loads}, "
        f"evictions {stats.num_adapter_evictions}"
    )
    result.site_us = _site_timings(adapters, engine, batch=bench.max_num_seqs)
    return result


def format_lora_report(
    result: LoraBenchResult, *, num_adapters: int, rank: int, targets: tuple[str, ...] = ALL_TARGETS
) -> str:
    base = statistics.median(b.wall for b, _ in result.rounds)
    mixed = statistics.median(m.wall for _, m in result.rounds)
    ratios = ", ".join(f"{m.wall / b.wall:.3f}" for b, m in result.rounds)
    cpu_ratios = ", ".join(f"{m.cpu / b.cpu:.3f}" for b, m in result.rounds)
    lines = [
        f"(a) {num_adapters} rank-{rank} adapters ({_short(targets)}) mixed evenly / the base alone: "
        f"{result.ratio:.3f} "
        f"(median of rounds {ratios}; medians {mixed:.0f} against {base:.0f} output tok/s; target >= 0.70)",
        f"    per second of this process's CPU time: {result.cpu_ratio:.3f} (rounds {cpu_ratios})",
        f"(b) adapter load on first use (read + install), rank {rank}: median "
        f"{statistics.median(result.load_ms):.1f} ms, worst {max(result.load_ms):.1f} ms (target < 200 ms)",
        "(c) one layer's QKV update, a batch of decodes over the adapters: "
        + ", ".join(f"{name} {us:.0f} µs" for name, us in result.site_us.items()),
    ]
    return "\n".join(lines) + "\n"


def _short(targets: tuple[str, ...]) -> str:
    return "all" if set(targets) == set(ALL_TARGETS) else "-".join(t.removesuffix("_proj") for t in targets)


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    spec = WorkloadSpec()
    parser.add_argument("--model-dir", default=None, help="default: the bench model, built if missing")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=spec.num_requests)
    parser.add_argument("--seed", type=int, default=spec.seed)
    parser.add_argument("--torch-threads", type=int, default=0, help="0: every core")
    parser.add_argument(
        "--targets", default="all", help="the adapters' target modules, comma-separated (all: the seven)"
    )


def run_lora_from_options(options: dict[str, Any], *, default_model_dir: Path, log: Log = print) -> str:
    import torch

    for name in ("adapters", "rank", "rounds", "num_requests"):
        if int(options[name]) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    model_dir = (
        Path(options["model_dir"])
        if options.get("model_dir")
        else ensure_bench_model(default_model_dir, log=log)
    )
    spec = WorkloadSpec(num_requests=int(options["num_requests"]), seed=int(options["seed"]))
    named = str(options.get("targets") or "all")
    targets = ALL_TARGETS if named == "all" else tuple(t.strip() for t in named.split(","))
    if not targets or set(targets) - set(ALL_TARGETS):
        raise ValueError(f"--targets must be 'all' or names of {', '.join(ALL_TARGETS)}")
    torch.set_num_threads(int(options.get("torch_threads") or 0) or os.cpu_count() or 1)
    result = run_lora_benchmark(
        model_dir,
        default_model_dir.parent / "bench-lora-adapters" / model_dir.name,
        num_adapters=int(options["adapters"]),
        rank=int(options["rank"]),
        rounds=int(options["rounds"]),
        spec=spec,
        log=log,
        targets=targets,
    )
    return format_lora_report(
        result, num_adapters=int(options["adapters"]), rank=int(options["rank"]), targets=targets
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_lora_arguments(parser)
    state_dir = Path(os.environ.get("SWITCHYARD_STATE_DIR", "var"))
    print(
        run_lora_from_options(
            vars(parser.parse_args()), default_model_dir=state_dir.resolve() / "bench-model"
        )
    )
