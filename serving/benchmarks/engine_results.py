"""`manage.py bench engine`'s records: the run's configuration, each system's result and the report
that report.py prints (apart, so that the printer and the runner both import them)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from serving.benchmarks.bench_model import ModelInfo
from serving.benchmarks.engine_system import EngineRunStats
from serving.benchmarks.limits import (
    ConcurrencyReport,
    CpuLimit,
    RunConditions,
)
from serving.benchmarks.step_breakdown import StepBreakdown
from serving.benchmarks.workload import (
    RequestRecord,
    RunMetrics,
    WorkloadSpec,
)

SYSTEMS = {"a": "naive", "b": "static", "c": "hf-continuous", "d": "engine"}
Log = Callable[[str], None]


@dataclass(slots=True, frozen=True)
class BenchConfig:
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    systems: tuple[str, ...] = ("a", "b", "c", "d")
    max_num_seqs: int = 64  # engine and transformers' continuous batching
    max_num_batched_tokens: int = 2048  # engine and transformers' continuous batching, per step
    static_batch_size: int = 32  # the best of 16, 32 and 64 measured here (docs/benchmarks.md)
    block_size: int = 16
    kv_cache_bytes: int | None = None  # None: max_num_seqs sequences at the workload's longest length
    compile: bool = False
    pack_linear: bool | None = None  # (d) only: oneDNN-format Linear weights on a CPU; None: if it pays
    forward: str = "auto"  # (d) only: the engine's fused Llama forward, or transformers' modules
    attention: str = "auto"  # (d) only: the native paged kernel, or gather + SDPA
    half_block_tails: bool = True  # (d) only: a tail of up to half a block in half a block
    repeat: int = 1
    warmup: bool = True
    measure_cpu_limit: bool = True
    measure_scheduler: bool = True

    def validate(self) -> None:
        self.workload.validate()
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown or not self.systems:
            raise ValueError(f"systems must be a non-empty subset of {','.join(SYSTEMS)}, got {self.systems}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "static_batch_size", "block_size", "repeat"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


@dataclass(slots=True)
class SystemResult:
    key: str
    name: str
    unavailable_reason: str | None = None
    runs: list[RunMetrics] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)  # the last run's
    setup_s: float = 0.0  # load and warm-up, outside the measured runs
    conditions: list[RunConditions] = field(default_factory=list)  # one per run

    @property
    def median_cpu_share(self) -> float:
        return statistics.median(c.cpu_share for c in self.conditions) if self.conditions else math.nan

    @property
    def median_cpu_pressure(self) -> float | None:
        values = [c.cpu_pressure for c in self.conditions if c.cpu_pressure is not None]
        return statistics.median(values) if values else None

    @property
    def median(self) -> RunMetrics | None:
        if not self.runs:
            return None
        values: dict[str, Any] = {
            f.name: statistics.median(getattr(r, f.name) for r in self.runs) for f in fields(RunMetrics)
        }
        # The same workload every run: the counts are equal, keep them integers.
        values["num_requests"] = self.runs[0].num_requests
        values["num_output_tokens"] = self.runs[0].num_output_tokens
        return RunMetrics(**values)


@dataclass(slots=True)
class BenchReport:
    config: BenchConfig
    model: ModelInfo
    num_torch_threads: int
    started_at: str
    results: dict[str, SystemResult]
    concurrency: ConcurrencyReport
    engine_run: EngineRunStats | None = None  # the last run's
    engine_paths: str = ""  # (d)'s forward, attention and Linear layers (ModelRunner.describe)
    cpu_limit: CpuLimit | None = None
    breakdowns: list[StepBreakdown] = field(default_factory=list)  # (d)'s decode step after each run
    scheduler_ms_per_step: float | None = None
    scheduler_unavailable_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # what every system must produce: the sum of max_tokens
    total_s: float = 0.0
