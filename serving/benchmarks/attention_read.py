"""`manage.py bench attention`: how fast the paged-attention kernel reads the KV cache in a decode step,
against this machine's streaming read rate measured in the same run.

A decode step's attention reads every running sequence's keys and values once per layer, from blocks
scattered over a pool far larger than the caches: at batch 64 and context 128 on the bench model, 16 MiB
a layer, 128 MiB a step. That read, not the arithmetic, bounds the kernel (docs/architecture.md, "The
kernel asks for the next block as it goes"). This command times the kernel alone on such a step (cold:
each layer its own pool, as the engine's step reads them), the same step with one layer's pool read
again at once (warm: its arithmetic, with the data in the caches), and torch summing a contiguous
buffer (the rate a plain streaming read gets here), and prints the kernel's share of that rate."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from serving.benchmarks.bench_model import BENCH_MODEL_SPEC
from serving.engine.kv_cache import num_blocks_for_budget
from serving.engine.native_attention import NativeAttention, key_pool_view, load_native_attention, plan_items
from serving.engine.native_library import KernelUnavailable

FLOAT_BYTES = 4
STREAM_BYTES = 256 << 20  # the baseline's buffer: far larger than the caches of the CPUs measured
WARM_UP_STEPS = 2


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """One decode step: `rows` sequences, each attending `context` positions, over `layers` layers."""

    rows: int = 64
    context: int = 128
    layers: int = BENCH_MODEL_SPEC.num_layers
    num_heads: int = BENCH_MODEL_SPEC.num_heads
    num_kv_heads: int = BENCH_MODEL_SPEC.num_kv_heads
    head_dim: int = BENCH_MODEL_SPEC.hidden_size // BENCH_MODEL_SPEC.num_heads
    block_size: int = 16

    @property
    def blocks_per_row(self) -> int:
        return -(-self.context // self.block_size)

    @property
    def bytes_per_step(self) -> int:
        """Keys and values the step's attention reads: every row's context, every layer."""
        return 2 * self.rows * self.context * self.num_kv_heads * self.head_dim * FLOAT_BYTES * self.layers

    def describe(self) -> str:
        return (
            f"{self.rows} decode rows at context {self.context}, {self.layers} layers, {self.num_heads} "
            f"heads over {self.num_kv_heads} KV heads, head_dim {self.head_dim}, "
            f"{self.block_size}-token blocks"
        )


@dataclass(frozen=True, slots=True)
class AttentionRead:
    shape: AttentionShape
    pool_bytes: int
    threads: int
    steps: int
    cold_s: float  # median step, each layer its own pool
    warm_s: float  # median step, one layer's pool read `layers` times over
    stream_bytes_per_s: float  # torch.sum over STREAM_BYTES, median of `steps`

    @property
    def cold_bytes_per_s(self) -> float:
        return self.shape.bytes_per_step / self.cold_s

    @property
    def warm_bytes_per_s(self) -> float:
        return self.shape.bytes_per_step / self.warm_s

    def report(self) -> str:
        mib = self.shape.bytes_per_step / (1 << 20)
        return "\n".join(
            [
                f"attention read: the paged kernel, {self.shape.describe()}; pools "
                f"{self.pool_bytes >> 20} MiB in all, {self.threads} threads, medians of {self.steps} steps",
                "  cold (each layer its own pool, as an engine step reads them): "
                f"{self.cold_s * 1e3:.2f} ms a step, {mib:.1f} MiB at {self.cold_bytes_per_s / 1e9:.1f} GB/s",
                f"  warm (one layer's pool read again at once): {self.warm_s * 1e3:.2f} ms a step "
                f"({self.warm_bytes_per_s / 1e9:.1f} GB/s)",
                f"  streaming read here (torch.sum over {STREAM_BYTES >> 20} MiB, contiguous): "
                f"{self.stream_bytes_per_s / 1e9:.1f} GB/s",
                f"  the kernel's cold read: {self.cold_bytes_per_s / self.stream_bytes_per_s:.0%} of the "
                "streaming rate",
            ]
        )


class _Step:
    """The kernel, its pools and one decode step's arguments, built once."""

    def __init__(self, kernel: NativeAttention, shape: AttentionShape, pool_bytes: int, seed: int) -> None:
        self.kernel, self.shape = kernel, shape
        num_blocks = num_blocks_for_budget(
            kv_cache_bytes=pool_bytes,
            num_layers=shape.layers,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            dtype_bytes=FLOAT_BYTES,
            block_size=shape.block_size,
        )
        needed = shape.rows * shape.blocks_per_row
        if num_blocks < needed:
            raise ValueError(
                f"pools of {pool_bytes >> 20} MiB hold {num_blocks} blocks a layer; the step needs {needed}"
            )
        generator = torch.Generator().manual_seed(seed)
        block_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
        # Written in full, so that no page is touched for the first time while timed.
        self.pools = [
            (torch.rand(block_shape, generator=generator), torch.rand(block_shape, generator=generator))
            for _ in range(shape.layers)
        ]
        # Scattered, as a pool's blocks are once sequences have come and gone.
        tables = torch.randperm(num_blocks, generator=generator)[:needed].view(shape.rows, -1).contiguous()
        last = shape.context - 1
        slots = (
            tables[:, last // shape.block_size] * shape.block_size + last % shape.block_size
        ).contiguous()
        ones = np.ones(shape.rows, dtype=np.int64)
        items = plan_items(ones, ones * shape.context, np.arange(shape.rows), shape.num_heads)
        self.args = kernel.step(
            slot_mapping=slots,
            block_tables=tables,
            items=items,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            block_size=shape.block_size,
        )
        self.q = torch.rand(shape.rows, shape.num_heads, shape.head_dim, generator=generator)
        self.k_new = torch.rand(shape.rows, shape.num_kv_heads, shape.head_dim, generator=generator)
        self.v_new = torch.rand(shape.rows, shape.num_kv_heads, shape.head_dim, generator=generator)
        self.out = torch.empty_like(self.q)
        self.scale = shape.head_dim**-0.5

    def run(self, layers: list[int]) -> float:
        start = time.perf_counter()
        for layer in layers:
            keys, values = self.pools[layer]
            self.kernel(
                self.args,
                q=self.q,
                k_new=self.k_new,
                v_new=self.v_new,
                k_pool=key_pool_view(keys),
                v_pool=values,
                out=self.out,
                scale=self.scale,
            )
        return time.perf_counter() - start


def _stream_read(buffer: torch.Tensor) -> float:
    start = time.perf_counter()
    buffer.sum()
    return time.perf_counter() - start


def measure(shape: AttentionShape, *, pool_bytes: int, steps: int, seed: int = 0) -> AttentionRead:
    """The kernel's cold and warm step and the streaming baseline, alternated step by step so that a
    change in the machine's speed during the run falls on all three alike."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    step = _Step(load_native_attention(), shape, pool_bytes, seed)
    buffer = torch.rand(STREAM_BYTES // FLOAT_BYTES)
    every_layer = list(range(shape.layers))
    first_layer_again = [0] * shape.layers
    cold, warm, stream = [], [], []
    for _ in range(WARM_UP_STEPS):
        step.run(every_layer)
        _stream_read(buffer)
    for _ in range(steps):
        cold.append(step.run(every_layer))
        step.run(first_layer_again)  # brings it into the caches
        warm.append(step.run(first_layer_again))
        stream.append(_stream_read(buffer))
    return AttentionRead(
        shape=shape,
        pool_bytes=pool_bytes,
        threads=torch.get_num_threads(),
        steps=steps,
        cold_s=statistics.median(cold),
        warm_s=statistics.median(warm),
        stream_bytes_per_s=STREAM_BYTES / statistics.median(stream),
    )


def add_attention_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = AttentionShape()
    parser.add_argument("--rows", type=int, default=defaults.rows, help="decode rows in the step")
    parser.add_argument("--context", type=int, default=defaults.context, help="positions each row attends")
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--pool-mib", type=int, default=512, help="all layers' KV pools, MiB")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)


def run_attention_from_options(
    options: Mapping[str, object], *, default_model_dir: Path, log: Callable[[str], None]
) -> str:
    """`bench attention`; the model directory is not read (the bench model's shapes are built in)."""
    shape = AttentionShape(
        rows=int(options["rows"]),  # type: ignore[call-overload]
        context=int(options["context"]),  # type: ignore[call-overload]
        layers=int(options["layers"]),  # type: ignore[call-overload]
    )
    if min(shape.rows, shape.context, shape.layers) < 1:
        raise ValueError("--rows, --context and --layers are positive")
    try:
        result = measure(
            shape,
            pool_bytes=int(options["pool_mib"]) << 20,  # type: ignore[call-overload]
            steps=int(options["steps"]),  # type: ignore[call-overload]
            seed=int(options["seed"]),  # type: ignore[call-overload]
        )
    except KernelUnavailable as exc:
        raise ValueError(f"the paged-attention kernel is not available here: {exc}") from exc
    return result.report() + "\n"
