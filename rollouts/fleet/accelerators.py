"""Accelerators a capacity plan can be made for: memory, memory bandwidth, dense 16-bit FLOP/s and an
hourly price, as the vendors' data sheets give them (peak figures; docs/capacity.md says what that
assumes). Prices are illustrative on-demand list prices for one GPU; pass `--usd-per-hour` for yours.

There is no preset for this machine's CPU: `bench engine` measures a step's cost, not the bandwidth and
FLOP/s this model needs (serving/benchmarks/limits.py measures matmul throughput only), so a CPU plan
takes its figures from the flags."""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 10**9  # decimal, as the data sheets count (an "80 GB" card's 80 GiB is 7% more: the plan errs low)


@dataclass(frozen=True, slots=True)
class Accelerator:
    name: str
    memory_gb: float
    bandwidth_gb_s: float  # HBM/GDDR bandwidth, GB/s
    tflops: float  # dense fp16/bf16 tensor throughput, 10^12 FLOP/s
    usd_per_hour: float

    def __post_init__(self) -> None:
        for field_name in ("memory_gb", "bandwidth_gb_s", "tflops"):
            value = getattr(self, field_name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(
                    f"the accelerator's {field_name.replace('_', ' ')} must be > 0, got {value!r}"
                )
        if not (math.isfinite(self.usd_per_hour) and self.usd_per_hour >= 0):
            raise ValueError(f"the accelerator's price must be >= 0 $/hour, got {self.usd_per_hour!r}")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * GB

    @property
    def bandwidth_bytes_s(self) -> float:
        return self.bandwidth_gb_s * GB

    @property
    def flop_s(self) -> float:
        return self.tflops * 1e12


ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        # A100 SXM4 40 GB: 1,555 GB/s HBM2, 312 TFLOP/s dense fp16.
        Accelerator("a100-40gb", memory_gb=40, bandwidth_gb_s=1555, tflops=312, usd_per_hour=3.67),
        # A100 SXM4 80 GB: 2,039 GB/s HBM2e.
        Accelerator("a100-80gb", memory_gb=80, bandwidth_gb_s=2039, tflops=312, usd_per_hour=5.07),
        # H100 SXM5 80 GB: 3,350 GB/s HBM3, 989 TFLOP/s dense bf16.
        Accelerator("h100-80gb", memory_gb=80, bandwidth_gb_s=3350, tflops=989, usd_per_hour=11.06),
        # L4 24 GB: 300 GB/s GDDR6, 121 TFLOP/s dense fp16.
        Accelerator("l4", memory_gb=24, bandwidth_gb_s=300, tflops=121, usd_per_hour=0.71),
    )
}


def accelerator_named(name: str) -> Accelerator:
    """A preset by name; ValueError naming the presets otherwise."""
    try:
        return ACCELERATORS[name]
    except KeyError:
        raise ValueError(f"no accelerator preset {name!r}; presets: {', '.join(ACCELERATORS)}") from None
