"""Figures the benchmark reports beside the systems' runs: how many sequences a KV budget holds (paged
versus contiguous), this CPU's arithmetic limit for the model, and the scheduler's own time per step."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from serving.benchmarks.bench_model import ModelInfo
from serving.benchmarks.workload import BenchRequest, RunMetrics


@dataclass(slots=True, frozen=True)
class ConcurrencyReport:
    """Sequences of this workload that fit `kv_cache_bytes` at once, each at its final length (prompt +
    max_tokens, its peak), taken in workload order and cycling through it until the next does not fit."""

    kv_cache_bytes: int
    budget_slots: int  # token slots the budget holds
    block_size: int
    max_model_len: int
    num_contiguous: int  # each sequence reserves max_model_len slots up front
    num_paged: int  # each sequence holds ceil(length / block_size) blocks
    num_contiguous_exact: int  # each reserves exactly prompt + max_tokens (needs max_tokens known up front)

    @property
    def ratio(self) -> float:
        return self.num_paged / self.num_contiguous if self.num_contiguous else float("inf")


def _num_fitting(slots_per_seq: Sequence[int], budget_slots: int) -> int:
    if not slots_per_seq or min(slots_per_seq) <= 0:
        return 0
    num, used = 0, 0
    while used + slots_per_seq[num % len(slots_per_seq)] <= budget_slots:
        used += slots_per_seq[num % len(slots_per_seq)]
        num += 1
    return num


def concurrency_at_budget(
    requests: Sequence[BenchRequest], model: ModelInfo, kv_cache_bytes: int, block_size: int
) -> ConcurrencyReport:
    budget_slots = kv_cache_bytes // model.kv_bytes_per_token
    lengths = [len(r.prompt_token_ids) + r.max_tokens for r in requests]
    paged = [-(-n // block_size) * block_size for n in lengths]
    return ConcurrencyReport(
        kv_cache_bytes=kv_cache_bytes,
        budget_slots=budget_slots,
        block_size=block_size,
        max_model_len=model.max_position_embeddings,
        num_contiguous=budget_slots // model.max_position_embeddings,
        num_paged=_num_fitting(paged, budget_slots),
        num_contiguous_exact=_num_fitting(lengths, budget_slots),
    )


@dataclass(slots=True, frozen=True)
class CpuLimit:
    """The machine's fp32 matmul rate: the better of torch's default CPU matmul (the BLAS torch was built
    with) and oneDNN's (the kernel the engine's packed Linear layers use, serving/engine/packing.py),
    whose rates differ by 2x or more on some CPUs (docs/benchmarks.md, "Engine step cost")."""

    matmul_size: int
    best_flops_per_s: float  # the better kernel's best run
    median_flops_per_s: float  # the better kernel's median
    num_matmul_params: int
    blas_best_flops_per_s: float  # torch.matmul's best run
    onednn_best_flops_per_s: float | None  # None where oneDNN's linear is not available

    @property
    def decode_tokens_per_s_bound(self) -> float:
        """Each token multiplies by every weight once: 2 FLOPs per parameter. Attention is left out, so
        this is an upper bound on output tokens/s if the CPU did nothing but decode at peak."""
        return self.best_flops_per_s / (2 * self.num_matmul_params)

    def share_counting_prompt_tokens(self, num_prompt_tokens: int, metrics: RunMetrics) -> float:
        """A run's share of the decode bound counting every token it computed: its prompt tokens too."""
        processed = (num_prompt_tokens + metrics.num_output_tokens) / metrics.makespan_s
        return processed / self.decode_tokens_per_s_bound


def measure_cpu_limit(num_matmul_params: int, *, size: int = 2048, num_repeats: int = 5) -> CpuLimit:
    """FLOP/s of one big fp32 product on this machine, now, with the current torch threads: through
    torch.matmul and through oneDNN's linear over a packed weight, each after a warm-up."""
    import torch

    from serving.engine.packing import LinearWeight, can_pack

    a = torch.randn(size, size)
    b = torch.randn(size, size)
    out = torch.empty(size, size)

    def rates(product: Callable[[], object]) -> list[float]:
        product()  # warm-up: thread pool, allocator, kernels
        flops = []
        for _ in range(num_repeats):
            began = time.perf_counter()
            product()
            flops.append(2 * size**3 / (time.perf_counter() - began))
        return flops

    blas = rates(lambda: torch.matmul(a, b, out=out))
    onednn = None
    if can_pack(torch.device("cpu"), torch.float32):
        packed = LinearWeight(b, None, packed=True)
        onednn = rates(lambda: packed(a))
    best = blas if onednn is None or max(blas) >= max(onednn) else onednn
    return CpuLimit(
        size,
        max(best),
        statistics.median(best),
        num_matmul_params,
        blas_best_flops_per_s=max(blas),
        onednn_best_flops_per_s=None if onednn is None else max(onednn),
    )


def measure_scheduler_overhead_ms(num_seqs: int = 256) -> tuple[float | None, str | None]:
    """(median ms per step in schedule() + update() at `num_seqs` running, None) or (None, why not)."""
    try:
        from serving.engine.simulated import measure_scheduler_overhead
    except ImportError as exc:
        return None, f"not available ({exc})"
    return measure_scheduler_overhead(num_seqs=num_seqs), None


@dataclass(slots=True, frozen=True)
class RunConditions:
    """How much of the machine a run had: on a shared CPU the figures mean little without this."""

    cpu_share: float  # this process's CPU seconds over (wall seconds x cores)
    cpu_pressure: float | None  # Linux PSI: fraction of wall time some runnable task waited for a CPU


def _cpu_pressure_total_us() -> int | None:
    try:
        with open("/proc/pressure/cpu") as f:
            some = f.readline()  # "some avg10=… avg60=… avg300=… total=<microseconds>"
    except OSError:
        return None
    return int(some.rsplit("total=", 1)[1]) if "total=" in some else None


class ConditionsMeter:
    def __init__(self) -> None:
        self._wall = time.perf_counter()
        self._cpu = time.process_time()
        self._pressure_us = _cpu_pressure_total_us()

    def read(self) -> RunConditions:
        wall_s = max(time.perf_counter() - self._wall, 1e-9)
        cpu_s = time.process_time() - self._cpu
        pressure_us = _cpu_pressure_total_us()
        pressure = None
        if pressure_us is not None and self._pressure_us is not None:
            pressure = (pressure_us - self._pressure_us) / 1e6 / wall_s
        return RunConditions(cpu_s / (wall_s * (os.cpu_count() or 1)), pressure)
