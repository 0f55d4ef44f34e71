"""The KV cache's size when a replica's configuration names none (serving/engine/kv_budget.py), and a
CPU pool that takes memory only as sequences fill it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from serving.engine.engine import Engine, EngineConfig
from serving.engine.kv_budget import MIN_CPU_KV_CACHE_BYTES, available_host_memory_bytes, kv_cache_budget
from serving.engine.runner import ModelRunner

CPU = torch.device("cpu")
GIB = 1 << 30


def _budget(available: int | None, useful: int = 64 * GIB, fraction: float = 0.5) -> int:
    return kv_cache_budget(
        device=CPU,
        max_useful_bytes=useful,
        gpu_memory_fraction=0.8,
        cpu_memory_fraction=fraction,
        available_bytes=available,
    ).num_bytes


def test_a_cpu_budget_is_a_share_of_the_available_memory_up_to_what_the_engine_can_fill() -> None:
    assert _budget(8 * GIB) == 4 * GIB
    assert _budget(8 * GIB, fraction=0.25) == 2 * GIB
    assert _budget(8 * GIB, useful=GIB) == GIB  # more would be held for nothing
    assert _budget(100 << 20) == 100 << 20  # the minimum, but no more than there is
    assert _budget(200 << 20) == MIN_CPU_KV_CACHE_BYTES


def test_the_budget_says_how_it_was_decided() -> None:
    capped = kv_cache_budget(
        device=CPU,
        max_useful_bytes=GIB,
        gpu_memory_fraction=0.8,
        cpu_memory_fraction=0.5,
        available_bytes=8 * GIB,
    )
    assert "all the engine could fill" in capped.reason and "8192 MiB available" in capped.reason
    with pytest.raises(ValueError, match="cpu_memory_fraction"):
        _budget(8 * GIB, fraction=0)


def test_available_memory_is_the_tighter_of_the_host_and_the_cgroup(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:   16000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert available_host_memory_bytes(meminfo, cgroup) == 16000000 * 1024  # no limit files: the host's
    (cgroup / "memory.max").write_text("max\n")
    assert available_host_memory_bytes(meminfo, cgroup) == 16000000 * 1024
    (cgroup / "memory.max").write_text(f"{4 * GIB}\n")
    (cgroup / "memory.current").write_text(f"{GIB}\n")
    assert available_host_memory_bytes(meminfo, cgroup) == 3 * GIB
    assert available_host_memory_bytes(tmp_path / "absent", tmp_path / "absent") is None


def test_an_engine_without_a_size_takes_its_budget_and_logs_it(
    demo_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="serving.engine.engine"):
        engine = Engine(demo_model_dir, config=EngineConfig(max_num_seqs=4, max_num_batched_tokens=64))
    runner = engine.runner
    useful = 4 * runner.max_blocks_per_seq * runner.bytes_per_block
    available = available_host_memory_bytes()
    assert available is not None
    expected = min(max(available // 2, min(MIN_CPU_KV_CACHE_BYTES, available)), useful)
    # The pool rounds down to whole blocks; available memory moves a little between the two reads.
    assert abs(runner.kv_cache_bytes_allocated - expected) <= max(runner.bytes_per_block, expected // 50)
    assert any("KV cache:" in record.getMessage() for record in caplog.records)


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def test_a_cpu_pool_takes_memory_only_as_it_is_written(tiny_llama_dir: Path) -> None:
    before = _resident_bytes()
    runner = ModelRunner(tiny_llama_dir, kv_cache_bytes=GIB, max_num_seqs=4, max_num_batched_tokens=64)
    assert runner.kv_cache_bytes_allocated > GIB - runner.bytes_per_block
    assert _resident_bytes() - before < 256 << 20
    assert not runner.kv_caches[0][1][:4].any()  # and reads as zeros


def _smaps_entry(address: int) -> list[str]:
    """The lines /proc/self/smaps gives for the mapping that holds `address`."""
    entry: list[str] = []
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        if inside:
            entry.append(line)
    return entry


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux's /proc")
def test_a_cpu_pool_is_written_on_small_pages_not_huge_ones(tiny_llama_dir: Path) -> None:
    # A fresh huge page can wait for the kernel to compact memory: the first write to a fresh block
    # would stall the step (serving/engine/host_memory.py).
    runner = ModelRunner(tiny_llama_dir, kv_cache_bytes=64 << 20, max_num_seqs=4, max_num_batched_tokens=64)
    values = runner.kv_caches[0][1]
    values.fill_(1.0)  # every page of one layer's values, 2 MiB-aligned runs included
    entry = _smaps_entry(values.data_ptr())
    flags = next(line for line in entry if line.startswith("VmFlags:")).split()[1:]
    assert "nh" in flags  # advised against transparent huge pages
    assert next(line for line in entry if line.startswith("AnonHugePages:")).split()[1] == "0"
