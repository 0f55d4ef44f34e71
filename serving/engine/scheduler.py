"""Continuous batching: each step picks which sequences compute how many tokens, under a cap on
running sequences and a token budget. There are no prefill or decode phases: a running sequence asks
for the tokens it has not computed yet (one when decoding), and a long prompt is cut to the budget."""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from serving.engine.admission import Admission
from serving.engine.fairness import VirtualTokenCounter
from serving.engine.kv_cache import KVCacheManager
from serving.engine.lora_slots import AdapterSlots
from serving.engine.sequence import TIER_NAMES, FinishReason, Sequence, SequenceStatus, TenantLimits


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    block_size: int = 16
    max_running_per_tenant: int | None = None
    max_blocks_per_tenant: int | None = None
    eos_token_id: int | None = None
    is_chunked_prefill_enabled: bool = True
    # Virtual token counter weights (Sheng et al., OSDI 2024): an output token costs more service
    # than a prompt token because it takes a whole sequential step.
    prompt_token_weight: float = 1.0
    output_token_weight: float = 2.0
    # Free blocks kept back at admission beyond what running sequences are known to need next.
    watermark_fraction: float = 0.01
    # A waiting flex sequence is promoted to the default tier after this many seconds (0: never), and
    # then competes with default ones by age (tiers.py).
    tier_aging_s: float = 10.0

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("max_running_per_tenant", "max_blocks_per_tenant"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or an integer >= 1, got {value!r}")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must leave room for at least one prompt and one output token")
        if not self.is_chunked_prefill_enabled and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")
        if not (self.prompt_token_weight >= 0 and self.output_token_weight >= 0):
            raise ValueError("token weights must be >= 0")
        if not self.tier_aging_s >= 0:
            raise ValueError(f"tier_aging_s must be >= 0, got {self.tier_aging_s!r}")
        if not 0 <= self.watermark_fraction < 1:
            raise ValueError(f"watermark_fraction must be in [0, 1), got {self.watermark_fraction!r}")


@dataclass(slots=True)
class ScheduledSequence:
    """Compute seq.token_ids[num_computed : num_computed + num_new_tokens] this step; sample a token
    iff that range reaches the end of seq.token_ids."""

    seq: Sequence
    num_new_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    preempted: list[Sequence]
    num_batched_tokens: int


@dataclass(slots=True, frozen=True)
class SchedulerStats:
    num_steps: int
    num_running: int
    num_waiting: int
    num_scheduled_seqs: int  # in the last step
    num_batched_tokens: int  # in the last step
    num_preempted: int  # in the last step
    num_preemptions: int  # since start
    kv_usage: float
    num_free_blocks: int
    prefix_cache_hit_rate: float


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        *,
        clock: Callable[[], float] = time.monotonic,
        adapters: AdapterSlots[Any, Any] | None = None,
    ) -> None:
        """`adapters`: the engine's LoRA slots, which admission seats adapters' sequences in and a
        finished sequence releases (lora_slots.py); None: no adapters."""
        config.validate()
        if config.block_size != kv_cache.block_size:
            raise ValueError(f"block_size {config.block_size} != the KV cache's {kv_cache.block_size}")
        self.config = config
        self.kv_cache = kv_cache
        self._clock = clock
        self._requests: dict[str, Sequence] = {}  # every unfinished sequence
        self._vtc = VirtualTokenCounter(
            prompt_token_weight=config.prompt_token_weight, output_token_weight=config.output_token_weight
        )
        # The waiting and running sequences, and who is admitted or preempted (admission.py).
        self._admission = Admission(
            kv_cache,
            vtc=self._vtc,
            clock=clock,
            max_num_seqs=config.max_num_seqs,
            max_running_per_tenant=config.max_running_per_tenant,
            max_blocks_per_tenant=config.max_blocks_per_tenant,
            is_chunked_prefill_enabled=config.is_chunked_prefill_enabled,
            num_watermark_blocks=math.ceil(config.watermark_fraction * kv_cache.num_blocks),
            tier_aging_s=config.tier_aging_s,
            adapters=adapters,
        )
        self._running = self._admission.running  # the same dict, read here every step
        self.num_steps = 0
        self._last_output = SchedulerOutput([], [], 0)

    @property
    def num_waiting(self) -> int:
        return self._admission.num_waiting

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_preemptions(self) -> int:
        """Sequences preempted since start."""
        return self._admission.num_preemptions

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def get(self, request_id: str) -> Sequence | None:
        return self._requests.get(request_id)

    def running_seqs(self) -> list[Sequence]:
        """Running sequences in admission order: the last is preempted first."""
        return list(self._running.values())

    def service_of(self, tenant_id: str) -> float:
        return self._vtc.service_of(tenant_id)

    def stats(self) -> SchedulerStats:
        kv = self.kv_cache
        return SchedulerStats(
            num_steps=self.num_steps,
            num_running=len(self._running),
            num_waiting=self._admission.num_waiting,
            num_scheduled_seqs=len(self._last_output.scheduled),
            num_batched_tokens=self._last_output.num_batched_tokens,
            num_preempted=len(self._last_output.preempted),
            num_preemptions=self.num_preemptions,
            kv_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            prefix_cache_hit_rate=kv.prefix_cache_hit_rate,
        )

    # --- requests in and out ----------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; raise ValueError (with nothing allocated) if it can never run."""
        cfg = self.config
        if seq.request_id in self._requests:
            raise ValueError(f"request {seq.request_id!r} is already queued or running")
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or seq.block_table:
            raise ValueError(f"request {seq.request_id!r} is not a fresh sequence")
        if not seq.prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        seq.params.validate()
        if seq.limits is not None:
            seq.limits.validate()
        if not 0 <= seq.tier < len(TIER_NAMES):
            raise ValueError(f"tier must be one of 0..{len(TIER_NAMES) - 1}, got {seq.tier!r}")
        if seq.num_prompt_tokens >= cfg.max_model_len:
            raise ValueError(
                f"the prompt has {seq.num_prompt_tokens} tokens; the context limit is {cfg.max_model_len}, "
                "which must leave room for at least one output token"
            )
        if seq.params.max_tokens > cfg.max_model_len:
            raise ValueError(
                f"max_tokens {seq.params.max_tokens} exceeds the context limit {cfg.max_model_len}"
            )
        # The last token is sampled but never computed, so this many positions need slots at most.
        max_num_positions = min(seq.num_prompt_tokens + seq.params.max_tokens, cfg.max_model_len) - 1
        num_blocks_alone = -(-max_num_positions // cfg.block_size)
        max_blocks = self.max_blocks_per_sequence(seq.limits)
        if num_blocks_alone > max_blocks:
            raise ValueError(
                f"request {seq.request_id!r} needs up to {num_blocks_alone} KV blocks; at most {max_blocks} "
                "can ever be available to it"
            )
        self._requests[seq.request_id] = seq
        self._admission.enqueue(seq, is_preempted=False)

    def max_blocks_per_sequence(self, limits: TenantLimits | None = None) -> int:
        """The KV blocks one sequence can ever hold: the pool, or its tenant's share of it."""
        cap = self._admission.block_cap_of(limits)
        return self.kv_cache.num_blocks if cap is None else min(self.kv_cache.num_blocks, cap)

    def max_output_tokens(self, num_prompt_tokens: int, limits: TenantLimits | None = None) -> int:
        """The most tokens a prompt this long can ever be given (add() refuses more): up to the context
        limit, and no more than the blocks it could hold (the last token needs no slot). May be < 1."""
        num_positions = self.max_blocks_per_sequence(limits) * self.config.block_size
        return min(self.config.max_model_len, num_positions + 1) - num_prompt_tokens

    def expire_waiting(self, max_wait_s: float) -> list[Sequence]:
        """End, as aborted, the sequences that waited over `max_wait_s` and never ran; those."""
        cutoff = self._clock() - max_wait_s
        waiting = self._admission.waiting()
        expired = [s for s in waiting if s.first_scheduled_time is None and (s.enqueued_time or 0) < cutoff]
        for seq in expired:
            self.finish(seq.request_id, FinishReason.ABORT)
        return expired

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a waiting or running request and free its blocks at once; None if unknown."""
        return self.finish(request_id, FinishReason.ABORT)

    def finish(self, request_id: str, reason: FinishReason) -> Sequence | None:
        """End a request from outside the step (a stop string matched, the client left)."""
        seq = self._requests.get(request_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self._admission.remove_waiting(seq)
            del self._requests[request_id]
            self._mark_finished(seq, reason)
        else:
            self._finish_running(seq, reason)
        return seq

    # --- the step ---------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        kv = self.kv_cache
        admission = self._admission
        budget = cfg.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Sequence] = []
        prefilling: list[Sequence] = []

        # A waiting higher tier takes the seat or blocks of a running lower one (tiers.py), before
        # anything of this step is scheduled.
        admission.displace(preempted)
        num_displaced = len(preempted)

        # Decodes first, in admission order, so a long prompt never stalls them.
        for seq in list(self._running.values()):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            if len(seq.token_ids) - seq.num_computed_tokens != 1:
                prefilling.append(seq)
                continue
            if seq.num_computed_tokens >= kv.num_slots(seq):  # its last block (or half) is full
                num_preempted = len(preempted)
                has_room = admission.make_room(seq, preempted)
                # The lowest tier goes first: a decode scheduled above may be one, and is taken out again.
                scheduled, num_dropped = _without(scheduled, preempted[num_preempted:])
                budget += num_dropped
                if not has_room:
                    continue
                kv.allocate(seq, 1)
            scheduled.append(ScheduledSequence(seq, 1))
            budget -= 1

        # Then the next chunk of each running prefill. A chunk takes no blocks from others (the likely
        # victims are decodes scheduled above); it shrinks to the blocks left. With none left it gives
        # up its own and requeues, so prefills stuck on each other's blocks cannot deadlock; its full
        # blocks stay in the prefix cache, which makes the recompute cheap.
        for seq in prefilling:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            num_remaining = len(seq.token_ids) - seq.num_computed_tokens
            num_free_slots = admission.num_free_slots(seq)
            if num_free_slots == 0:
                admission.preempt(seq)
                preempted.append(seq)
                continue
            num_new = min(num_remaining, budget, num_free_slots)
            if num_new < num_remaining and not cfg.is_chunked_prefill_enabled:
                continue
            kv.allocate(seq, num_new)
            scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new

        # A step that had to preempt for blocks admits nobody: blocks are short, and the victims would
        # come straight back in. (Displacements were made for the one admitted next.)
        had_to_preempt = len(preempted) > num_displaced
        if admission.num_waiting and budget and not had_to_preempt and len(self._running) < cfg.max_num_seqs:
            for seq, num_new in admission.admit(budget):
                scheduled.append(ScheduledSequence(seq, num_new))
                budget -= num_new

        self.num_steps += 1
        output = SchedulerOutput(scheduled, preempted, cfg.max_num_batched_tokens - budget)
        self._last_output = output
        if __debug__:
            _assert_step_invariants(self, output)
        return output

    def update(self, output: SchedulerOutput, sampled_token_ids: dict[str, int]) -> list[Sequence]:
        """Account for a finished forward pass: advance computed tokens, append sampled ones, finish
        sequences that hit a stop condition (freeing their blocks) and return those."""
        missing = [
            item.seq.request_id
            for item in output.scheduled
            if item.seq.status is SequenceStatus.RUNNING
            and item.seq.num_computed_tokens + item.num_new_tokens == len(item.seq.token_ids)
            and item.seq.request_id not in sampled_token_ids
        ]
        if missing:
            raise ValueError(f"no sampled token for {missing[:5]}")
        cfg = self.config
        kv = self.kv_cache
        is_caching = kv.prefix_cache.is_enabled
        eos_token_id = cfg.eos_token_id
        max_model_len = cfg.max_model_len
        now: float | None = None
        finished: list[Sequence] = []
        sampled_tenant_ids: list[str] = []
        for item in output.scheduled:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:  # aborted or finished since schedule()
                continue
            seq.num_computed_tokens += item.num_new_tokens
            if is_caching:
                kv.commit_computed(seq)
            if seq.num_computed_tokens < len(seq.token_ids):  # a prefill chunk that did not finish
                continue
            reason = _append(seq, sampled_token_ids[seq.request_id], eos_token_id, max_model_len)
            sampled_tenant_ids.append(seq.tenant_id)
            if seq.first_token_time is None:
                now = self._clock() if now is None else now
                seq.first_token_time = now
            if reason is not None:
                self._finish_running(seq, reason)
                finished.append(seq)
        self._vtc.charge_output(sampled_tenant_ids)
        return finished

    # --- helpers ----------------------------------------------------------------------------------

    def _finish_running(self, seq: Sequence, reason: FinishReason) -> None:
        self._admission.remove_running(seq)
        del self._requests[seq.request_id]
        self._mark_finished(seq, reason)

    def _mark_finished(self, seq: Sequence, reason: FinishReason) -> None:
        self.kv_cache.free(seq)  # frees nothing for a waiting sequence, which holds no blocks
        self._admission.adapters.release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time = self._clock()

    # --- invariants -------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Full O(requests + blocks) check of scheduler and KV cache state; for tests."""
        cfg = self.config
        self._admission.check_invariants(self._requests.keys())
        assert all(_is_in_step(seq) for seq in self._requests.values()), "each grammar at its output's end"
        for seq in self._running.values():
            assert seq.status is SequenceStatus.RUNNING
            assert self.kv_cache.num_slots(seq) >= seq.num_computed_tokens
            assert seq.num_computed_tokens < len(seq.token_ids) <= cfg.max_model_len
        self.kv_cache.check_invariants(self._running.values())


def _append(
    seq: Sequence, token_id: int, eos_token_id: int | None, max_model_len: int
) -> FinishReason | None:
    """Append a sampled token to `seq`, and to its grammar's matcher (constraint.py: it consumes every
    token the sequence keeps); why the sequence ends there, if it does."""
    seq.token_ids.append(token_id)
    params = seq.params
    constraint = seq.constraint
    if constraint is not None and not constraint.advance(token_id):
        return FinishReason.ERROR  # a token its grammar refuses: the masks make it impossible
    if (token_id == eos_token_id and not params.ignore_eos) or token_id in params.stop_token_ids:
        return FinishReason.STOP
    if constraint is not None and constraint.is_complete:
        return FinishReason.STOP  # a whole value of its grammar, which allows nothing after it
    if len(seq.token_ids) - seq.num_prompt_tokens >= params.max_tokens or len(seq.token_ids) >= max_model_len:
        return FinishReason.LENGTH
    return None


def _is_in_step(seq: Sequence) -> bool:
    """Its grammar's matcher (if any) has consumed exactly its output tokens, preempted or not."""
    return seq.constraint is None or seq.constraint.num_consumed == seq.num_output_tokens


def _assert_step_invariants(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """What every step must keep (checked under __debug__, every step)."""
    cfg = scheduler.config
    assert output.num_batched_tokens <= cfg.max_num_batched_tokens, "token budget respected"
    assert scheduler.num_running <= cfg.max_num_seqs, "max_num_seqs respected"
    assert scheduler.num_waiting + scheduler.num_running == len(scheduler._requests), "one place each"
    for item in output.scheduled:
        seq = item.seq
        assert item.num_new_tokens >= 1
        assert seq.status is SequenceStatus.RUNNING
        num_slots = scheduler.kv_cache.num_slots(seq)
        assert num_slots >= seq.num_computed_tokens + item.num_new_tokens, seq.request_id


def _without(
    scheduled: list[ScheduledSequence], victims: list[Sequence]
) -> tuple[list[ScheduledSequence], int]:
    """`scheduled` less the decodes of `victims` (preempted after they were scheduled: their blocks went
    with them), and how many tokens of the budget that gives back."""
    if not victims:
        return scheduled, 0
    ids = {victim.request_id for victim in victims}
    kept = [item for item in scheduled if item.seq.request_id not in ids]
    return kept, sum(item.num_new_tokens for item in scheduled) - sum(item.num_new_tokens for item in kept)


def latest_ends_in_steps(running: Iterable[Sequence], limit: int) -> tuple[int, ...]:
    """The steps within which the decoding sequences of `running` must end at the latest (each one's
    max_tokens less the tokens it has made; EOS or a stop string may end it sooner), the soonest `limit`,
    ascending: the TTFT forecast's bound on when a full batch frees its seats (docs/architecture.md,
    "SLO-aware admission"). Sequences still prefilling are left out: leaving some out can only put the
    k-th soonest later, so every figure stays a bound."""
    ends = (
        seq.params.max_tokens - seq.num_output_tokens
        for seq in running
        if seq.num_computed_tokens >= seq.num_prompt_tokens
    )
    return tuple(heapq.nsmallest(limit, ends))
