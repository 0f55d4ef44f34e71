"""(d) The engine as a benchmarked system: stepped in this thread, requests added at their arrival times,
and its KV use sampled after every step. serving.engine.engine is imported when this is built, so the
rest of the benchmark runs (and says so) where the facade does not exist."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from serving.benchmarks.workload import BenchRequest, RequestRecord, new_records
from serving.engine.sequence import FinishReason


@dataclass(slots=True)
class EngineRunStats:
    """What engine.stats() showed after each step of one run. KV waste: allocated token slots not
    holding a token, as a fraction of the slots allocated: per step (max, mean of steps) and over the
    whole run (slot-steps: every step's empty slots over every step's allocated slots)."""

    num_steps: int = 0
    max_kv_waste: float = 0.0
    mean_kv_waste: float = 0.0
    run_kv_waste: float = 0.0
    num_kv_samples: int = 0
    half_block_tails: bool = False  # whether the engine kept short tails in half blocks (half_blocks.py)
    max_num_running: int = 0
    num_batched_tokens: int = 0  # prompt and output tokens run through the model, all steps
    num_preemptions: int = 0
    num_ended_early: int = 0  # requests EOS ended before their max_tokens (those that honour it)
    busy_s: float = 0.0  # time inside engine.step()
    wall_s: float = 0.0  # the whole run, idle waits for arrivals included

    @property
    def busy_fraction(self) -> float:
        """How loaded the run was: near 1 the engine never waited for work, and queueing, not the
        per-request path, decides TTFT."""
        return self.busy_s / self.wall_s if self.wall_s else 0.0

    @property
    def mean_num_batched_tokens(self) -> float:
        return self.num_batched_tokens / self.num_steps if self.num_steps else 0.0


class EngineSystem:
    name = "engine"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        kv_cache_bytes: int,
        block_size: int,
        compile: bool,
        pack_linear: bool | None = None,
        forward: str = "auto",
        attention: str = "auto",
        half_block_tails: bool = True,
    ) -> None:
        from serving.engine.engine import Engine, EngineConfig

        self.engine = Engine(
            model_dir,
            config=EngineConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                kv_cache_bytes=kv_cache_bytes,
                block_size=block_size,
                compile=compile,
                pack_linear=pack_linear,
                forward=forward,
                attention=attention,
                half_block_tails=half_block_tails,
            ),
        )
        warmup = getattr(self.engine, "warmup", None)  # beyond the facade's minimal contract
        if callable(warmup):
            warmup()  # compiles here when compile is on, outside the measured runs
        self.last_run = EngineRunStats()
        self._num_runs = 0

    def describe_paths(self) -> str:
        """The engine's forward, attention and Linear layers, and why not the others."""
        return str(self.engine.runner.describe())

    def run(self, requests: Sequence[BenchRequest]) -> list[RequestRecord]:
        self._num_runs += 1
        prefix = f"run{self._num_runs}-"  # request ids stay unique across runs on one engine
        # A tenant per run: prefix-cache entries are salted per tenant, so a repeat of the same workload
        # cannot reuse the previous run's prompt blocks and do less work than the other systems.
        tenant_id = f"bench-run{self._num_runs}"
        engine = self.engine
        records = new_records(requests)
        pending = deque(sorted(requests, key=lambda r: r.arrival_s))
        stats = EngineRunStats(half_block_tails=engine.kv_cache.half_block_tails)
        waste_sum = 0.0
        allocated_slot_steps = empty_slot_steps = 0
        started = time.monotonic()
        while pending or engine.has_unfinished():
            now = time.monotonic()
            while pending and started + pending[0].arrival_s <= now:
                request = pending.popleft()
                engine.add_request(
                    prefix + request.request_id,
                    list(request.prompt_token_ids),
                    request.params,
                    tenant_id=tenant_id,
                    arrival_time=started + request.arrival_s,
                )
            if not engine.has_unfinished():
                time.sleep(max(0.0, started + pending[0].arrival_s - time.monotonic()))
                continue
            step_started = time.monotonic()
            outputs = engine.step()
            stepped_at = time.monotonic()
            stats.busy_s += stepped_at - step_started
            for output in outputs:
                record = records[output.request_id.removeprefix(prefix)]
                record.num_output_tokens += len(output.new_token_ids)
                if record.first_token_s is None and output.new_token_ids:
                    first = output.first_token_time if output.first_token_time is not None else stepped_at
                    record.first_token_s = first - started
                if output.is_finished:
                    end = output.finished_time if output.finished_time is not None else stepped_at
                    record.finished_s = end - started
                    # EOS, where a request honours it (the API's, mirrored), counted as bench serve
                    # counts a stream the model ended
                    if output.finish_reason == FinishReason.STOP and record.end_where_the_model_ended():
                        stats.num_ended_early += 1
            engine_stats = engine.stats()
            stats.num_steps += 1
            stats.num_batched_tokens += engine_stats.num_batched_tokens
            stats.max_num_running = max(stats.max_num_running, engine_stats.num_running)
            stats.num_preemptions = engine_stats.num_preemptions
            if engine_stats.kv_allocated_slots > 0:
                waste = 1 - engine_stats.kv_used_slots / engine_stats.kv_allocated_slots
                stats.max_kv_waste = max(stats.max_kv_waste, waste)
                waste_sum += waste
                stats.num_kv_samples += 1
                allocated_slot_steps += engine_stats.kv_allocated_slots
                empty_slot_steps += engine_stats.kv_allocated_slots - engine_stats.kv_used_slots
        stats.wall_s = time.monotonic() - started
        stats.mean_kv_waste = waste_sum / stats.num_kv_samples if stats.num_kv_samples else 0.0
        stats.run_kv_waste = empty_slot_steps / allocated_slot_steps if allocated_slot_steps else 0.0
        self.last_run = stats
        return list(records.values())
