"""How many bytes a replica's KV cache gets when its configuration names no size.

On a GPU, as vLLM sizes it: a share (`gpu_memory_fraction`) of the memory still free once the weights
are loaded. On a CPU, likewise a share (`cpu_memory_fraction`) of the host memory available now
(`MemAvailable`, or the cgroup's limit when that is tighter), but never more than the engine could ever
fill, `max_num_seqs` sequences at the model's whole context: more would only be held for nothing. A
fixed 128 MiB had capped the batch through the API (docs/benchmarks.md, "Engine step cost"): a 24M model
holds 8,000 tokens in it, and a 64-stream load lost ~40% of its throughput to preemptions.

On a CPU the pool is zero pages until a sequence writes its blocks (runner.py allocates it so), so a
large budget costs no memory until it is used."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

MIN_CPU_KV_CACHE_BYTES = 128 << 20  # the budget whatever the share says, unless even that is not available


@dataclass(frozen=True, slots=True)
class KVBudget:
    num_bytes: int
    reason: str  # how it was decided, for the replica's start-up log


def available_host_memory_bytes(
    meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """Memory the host can give this process now: MemAvailable, or the room left under the cgroup v2
    limit when that is smaller (a container's limit); None where neither can be read."""
    available = None
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            room = int(limit) - int((cgroup / "memory.current").read_text().strip())
            available = room if available is None else min(available, room)
    except (OSError, ValueError):
        pass
    return None if available is None else max(0, available)


def kv_cache_budget(
    *,
    device: torch.device,
    max_useful_bytes: int,
    gpu_memory_fraction: float,
    cpu_memory_fraction: float,
    available_bytes: int | None = None,
) -> KVBudget:
    """The KV budget for a replica on `device`. `max_useful_bytes`: what the engine could ever fill.
    `available_bytes` (a CPU's; tests pass it) defaults to `available_host_memory_bytes()`."""
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        share = int(free_bytes * gpu_memory_fraction)
        return KVBudget(share, f"{gpu_memory_fraction:g} of {free_bytes >> 20} MiB free on {device}")
    if not 0 < cpu_memory_fraction <= 1:
        raise ValueError(f"cpu_memory_fraction must be in (0, 1], got {cpu_memory_fraction}")
    available = available_host_memory_bytes() if available_bytes is None else available_bytes
    if available is None:
        size = min(MIN_CPU_KV_CACHE_BYTES, max_useful_bytes)
        return KVBudget(size, "available memory unknown: the fixed minimum")
    share = math.floor(available * cpu_memory_fraction)
    size = min(max(share, min(MIN_CPU_KV_CACHE_BYTES, available)), max_useful_bytes)
    if size == max_useful_bytes:
        reason = f"all the engine could fill (max_num_seqs x context); {cpu_memory_fraction:g} of"
        reason += f" {available >> 20} MiB available would be {share >> 20} MiB"
    elif size > share:
        reason = f"the minimum; {cpu_memory_fraction:g} of {available >> 20} MiB available is less"
    else:
        reason = f"{cpu_memory_fraction:g} of {available >> 20} MiB available"
    return KVBudget(size, reason)
