"""Admission: who waits and who runs. The waiting queues (one per tenant and service tier), the running
set, and the policy that moves sequences between them: admission by tier with aging, then least-served
tenant first (fairness.py, tiers.py), under per-tenant caps (each tenant's own from its quota, else the
replica's) and a watermark of free blocks; displacement of lower tiers by a waiting priority one; and
preemption (recompute), lowest tier first, when a running sequence needs a block that is not there. The
scheduler (scheduler.py) builds each step on top of it."""

from __future__ import annotations

import collections
from collections.abc import Callable, KeysView
from typing import Any

from serving.engine.fairness import VirtualTokenCounter
from serving.engine.kv_cache import KVCacheManager, blocks_of_share
from serving.engine.lora_slots import AdapterSlots, no_adapters
from serving.engine.sequence import PRIORITY_TIER, Sequence, SequenceStatus, TenantLimits
from serving.engine.tiers import effective_tier, lowest_tier_victim

QueueKey = tuple[str, int]  # (tenant, tier)


class Admission:
    """The waiting and running sequences of one scheduler, and the moves between the two."""

    def __init__(
        self,
        kv_cache: KVCacheManager,
        *,
        vtc: VirtualTokenCounter,
        clock: Callable[[], float],
        max_num_seqs: int,
        max_running_per_tenant: int | None,
        max_blocks_per_tenant: int | None,
        is_chunked_prefill_enabled: bool,
        num_watermark_blocks: int,
        tier_aging_s: float = 0.0,
        adapters: AdapterSlots[Any, Any] | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.adapters = adapters or no_adapters()  # an adapter's sequence is seated with it (lora_slots.py)
        self.vtc = vtc
        self._clock = clock
        self.max_num_seqs = max_num_seqs
        self.max_running_per_tenant = max_running_per_tenant
        self.max_blocks_per_tenant = max_blocks_per_tenant
        self.is_chunked_prefill_enabled = is_chunked_prefill_enabled
        self._num_watermark_blocks = num_watermark_blocks
        self.tier_aging_s = tier_aging_s
        self.running: dict[str, Sequence] = {}  # in admission order: the last of a tier is preempted first
        self._waiting: dict[QueueKey, collections.deque[Sequence]] = {}  # FIFO each; never empty
        self._tenant_to_num_waiting: collections.Counter[str] = collections.Counter()
        self.num_waiting = 0
        self._tenant_to_num_running: dict[str, int] = {}
        # Each tenant's caps as its latest sequence brought them (its quota, read by the gateway).
        self._tenant_to_limits: dict[str, TenantLimits] = {}
        self.num_preemptions = 0
        self.num_displaced = 0  # running sequences preempted for a waiting higher tier

    # --- in and out of the queues -----------------------------------------------------------------

    def enqueue(self, seq: Sequence, *, is_preempted: bool) -> None:
        tenant = seq.tenant_id
        if seq.limits is not None:
            self._tenant_to_limits[tenant] = seq.limits
        if seq.enqueued_time is None:
            seq.enqueued_time = self._clock()
        is_idle = not self._tenant_to_num_waiting[tenant] and not self._tenant_to_num_running.get(tenant)
        if is_idle and not is_preempted:
            # Back from idle (a preempted sequence's tenant never left): no credit for the idle time.
            self.vtc.lift(tenant, active_tenant_ids=self._active_tenant_ids())
        queue = self._waiting.setdefault((tenant, seq.tier), collections.deque())
        if is_preempted:
            queue.appendleft(seq)  # it was admitted before everything still waiting of its tier
        else:
            queue.append(seq)
        self._tenant_to_num_waiting[tenant] += 1
        self.num_waiting += 1

    def remove_waiting(self, seq: Sequence) -> None:
        key = (seq.tenant_id, seq.tier)
        queue = self._waiting[key]
        # By identity: Sequence equality compares every field.
        del queue[next(i for i, queued in enumerate(queue) if queued is seq)]
        self._dequeued(key, seq)

    def _dequeued(self, key: QueueKey, seq: Sequence) -> None:
        if not self._waiting[key]:
            del self._waiting[key]
        self._tenant_to_num_waiting[seq.tenant_id] -= 1
        if not self._tenant_to_num_waiting[seq.tenant_id]:
            del self._tenant_to_num_waiting[seq.tenant_id]
        self.num_waiting -= 1

    def waiting(self) -> list[Sequence]:
        """Every waiting sequence, in no particular order."""
        return [seq for queue in self._waiting.values() for seq in queue]

    # --- each tenant's caps -----------------------------------------------------------------------

    def running_cap(self, tenant: str) -> int | None:
        limits = self._tenant_to_limits.get(tenant)
        if limits is not None and limits.max_running is not None:
            return limits.max_running
        return self.max_running_per_tenant

    def block_cap(self, tenant: str) -> int | None:
        return self.block_cap_of(self._tenant_to_limits.get(tenant))

    def block_cap_of(self, limits: TenantLimits | None) -> int | None:
        """The KV blocks a tenant with these limits may hold: its share of this pool, else the replica's."""
        if limits is not None and limits.kv_share is not None:
            return blocks_of_share(limits.kv_share, self.kv_cache.num_blocks)
        return self.max_blocks_per_tenant

    def remove_running(self, seq: Sequence) -> None:
        del self.running[seq.request_id]
        self._tenant_to_num_running[seq.tenant_id] -= 1

    def _active_tenant_ids(self) -> list[str]:
        """Tenants with a sequence waiting or running."""
        running = [tenant for tenant, num_running in self._tenant_to_num_running.items() if num_running]
        return [*self._tenant_to_num_waiting, *running]

    def _next_queue(self, skipped: set[str]) -> QueueKey | None:
        """The queue to admit from: the best effective tier of its head (tiers.py), then the least-served
        tenant, then the head that has waited longest (an aged flex request before the defaults that
        came after it)."""
        now = self._clock()
        best: list[tuple[int, QueueKey]] = []
        for key, queue in self._waiting.items():
            if key[0] in skipped:
                continue
            tier = effective_tier(queue[0], now=now, aging_s=self.tier_aging_s)
            if not best or tier < best[0][0]:
                best = [(tier, key)]
            elif tier == best[0][0]:
                best.append((tier, key))
        if not best:
            return None
        tenant = self.vtc.least_served(key[0] for _, key in best)
        return min(  # of its queues at that tier, the one whose head has waited longest
            (key for _, key in best if key[0] == tenant),
            key=lambda key: (self._waiting[key][0].enqueued_time or 0.0, key[1]),
        )

    # --- the policy -------------------------------------------------------------------------------

    def admit(self, budget: int) -> list[tuple[Sequence, int]]:
        """Admit waiting sequences, least-served tenant first, while seats, budget and blocks allow;
        each admitted sequence with the tokens it computes this step, in admission order."""
        kv = self.kv_cache
        bs = kv.block_size
        admitted: list[tuple[Sequence, int]] = []
        # Blocks that running sequences still need to finish their known tokens and take one more step.
        num_reserved = 0
        tenant_to_num_reserved: dict[str, int] = collections.defaultdict(int)
        for seq in self.running.values():
            num_short = _num_blocks_short(seq, kv)
            if num_short > 0:
                num_reserved += num_short
                tenant_to_num_reserved[seq.tenant_id] += num_short
        skipped: set[str] = set()
        while budget and len(self.running) < self.max_num_seqs:
            key = self._next_queue(skipped)
            if key is None:
                break
            tenant = key[0]
            num_tenant_running = self._tenant_to_num_running.get(tenant, 0)
            running_cap = self.running_cap(tenant)
            if running_cap is not None and num_tenant_running >= running_cap:
                skipped.add(tenant)
                continue
            queue = self._waiting[key]
            seq = queue[0]
            if not self.adapters.can_seat(seq):
                skipped.add(tenant)  # its adapter waits for a slot
                continue
            prefix = kv.match_prefix(seq)
            num_remaining = len(seq.token_ids) - prefix.num_tokens
            num_new = min(num_remaining, budget)
            if num_new < num_remaining and not self.is_chunked_prefill_enabled:
                break  # the least-served tenant's head waits for a fuller budget; nobody jumps it
            num_eventual = (len(seq.token_ids) + bs) // bs  # blocks to finish its tokens and step once
            block_cap = self.block_cap(tenant)
            if (
                block_cap is not None
                and num_tenant_running
                and kv.num_blocks_by_tenant.get(tenant, 0) + tenant_to_num_reserved[tenant] + num_eventual
                > block_cap
            ):
                skipped.add(tenant)
                continue
            # With others running, admit only if that cannot force a preemption on the next step,
            # plus a small watermark for the decodes after it; alone, it always fits (checked in add).
            num_taken_eventually = kv.num_blocks_needed(seq, num_eventual * bs - prefix.num_tokens, prefix)
            if self.running and (
                num_taken_eventually + num_reserved + self._num_watermark_blocks > kv.num_free_blocks
            ):
                break
            num_taken_now = kv.num_blocks_needed(seq, num_new, prefix)
            if not self.running and num_taken_now > kv.num_free_blocks:
                break
            self.adapters.seat(seq)  # holds its adapter (installed on first use) until it finishes
            queue.popleft()
            self._dequeued(key, seq)
            kv.allocate(seq, num_new, prefix)
            num_reserved += num_taken_eventually - num_taken_now
            tenant_to_num_reserved[tenant] += max(0, _num_blocks_short(seq, kv))
            seq.status = SequenceStatus.RUNNING
            self.running[seq.request_id] = seq
            self._tenant_to_num_running[tenant] = num_tenant_running + 1
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = self._clock()
            if seq.num_preemptions == 0:  # recompute is our doing, not the tenant's
                self.vtc.charge_prompt(tenant, seq.num_prompt_tokens)
            admitted.append((seq, num_new))
            budget -= num_new
        return admitted

    def make_room(self, seq: Sequence, preempted: list[Sequence]) -> bool:
        """Preempt, lowest tier first, until `seq` gets one more slot; False if `seq` itself had to go."""
        kv = self.kv_cache
        cap = self.block_cap(seq.tenant_id)
        while True:
            num_needed = kv.num_blocks_needed(seq, 1)
            num_charged = kv.num_entries_added(seq, 1)  # what its tenant's count grows by (a half too)
            if cap is not None and kv.num_blocks_by_tenant.get(seq.tenant_id, 0) + num_charged > cap:
                victim = lowest_tier_victim(self.running.values(), tenant_id=seq.tenant_id)
            elif num_needed > kv.num_free_blocks:
                victim = lowest_tier_victim(self.running.values())
            else:
                return True
            assert victim is not None  # seq itself is running
            self.preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False

    def num_free_slots(self, seq: Sequence) -> int:
        """Tokens `seq` could still compute this step without preempting anyone."""
        kv = self.kv_cache
        cap = self.block_cap(seq.tenant_id)
        room = None if cap is None else cap - kv.num_blocks_by_tenant.get(seq.tenant_id, 0)
        return kv.num_tokens_fitting(seq, kv.num_free_blocks, room)

    def displace(self, preempted: list[Sequence]) -> None:
        """Seat the oldest waiting priority sequence when seats or blocks keep it out: preempt running
        sequences of lower tiers, lowest first (tiers.py), until it would fit or none is left. One
        waiting sequence per step: each step admits it, then the next. Only the priority tier's own
        requests displace (the others wait for a seat in tier order): preemption costs a recompute."""
        if not self.num_waiting or not self.running:
            return
        heads = [queue[0] for (_, tier), queue in self._waiting.items() if tier == PRIORITY_TIER]
        if not heads:
            return
        head = min(heads, key=lambda seq: seq.enqueued_time or 0.0)
        tenant = head.tenant_id
        num_tenant_running = self._tenant_to_num_running.get(tenant, 0)
        running_cap = self.running_cap(tenant)
        is_capped = running_cap is not None and num_tenant_running >= running_cap
        if is_capped or not self.adapters.can_seat(head):
            return  # its tenant's cap, or its adapter's wait for a slot: no other tenant's preemption helps
        kv = self.kv_cache
        bs = kv.block_size
        num_eventual = (len(head.token_ids) + bs) // bs
        block_cap = self.block_cap(tenant)
        if block_cap is not None and num_tenant_running:
            # As admit() checks it: were its tenant's blocks the bar, admission would skip it and seat
            # the very sequences preempted here, to be preempted again next step.
            running = (seq for seq in self.running.values() if seq.tenant_id == tenant)
            num_reserved = sum(max(0, _num_blocks_short(seq, kv)) for seq in running)
            if kv.num_blocks_by_tenant.get(tenant, 0) + num_reserved + num_eventual > block_cap:
                return
        while len(self.running) >= self.max_num_seqs or (
            num_eventual + self._num_watermark_blocks > kv.num_free_blocks
        ):
            victim = lowest_tier_victim(self.running.values(), below=head.tier)
            if victim is None:
                return
            self.preempt(victim)
            preempted.append(victim)
            self.num_displaced += 1

    def preempt(self, seq: Sequence) -> None:
        """Recompute later: drop the blocks and go back to the front of its tenant's and tier's queue."""
        self.remove_running(seq)
        self.kv_cache.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.enqueue(seq, is_preempted=True)

    # --- invariants -------------------------------------------------------------------------------

    def check_invariants(self, request_ids: KeysView[str]) -> None:
        """Full check of the queues against every unfinished request's id; for tests."""
        waiting = self.waiting()
        assert all(queue for queue in self._waiting.values()), "no empty queues"
        for (tenant, tier), queue in self._waiting.items():
            assert all(seq.tenant_id == tenant and seq.tier == tier for seq in queue), "queued by its key"
        assert len(waiting) == self.num_waiting
        assert sum(self._tenant_to_num_waiting.values()) == self.num_waiting
        waiting_ids = {seq.request_id for seq in waiting}
        assert len(waiting_ids) == len(waiting), "no request waits twice"
        assert not waiting_ids & self.running.keys(), "no request both waiting and running"
        assert waiting_ids | self.running.keys() == request_ids
        for seq in waiting:
            assert seq.status is SequenceStatus.WAITING
            assert not seq.block_table
            assert not seq.num_computed_tokens
        running_by_tenant = collections.Counter(seq.tenant_id for seq in self.running.values())
        assert all(self._tenant_to_num_running.get(t, 0) == n for t, n in running_by_tenant.items())
        assert sum(self._tenant_to_num_running.values()) == len(self.running)
        for tenant, num_running in running_by_tenant.items():
            cap = self.running_cap(tenant)
            assert cap is None or num_running <= cap, f"{tenant} runs {num_running} over its cap {cap}"
        for tenant, num_blocks in self.kv_cache.num_blocks_by_tenant.items():
            block_cap = self.block_cap(tenant)
            assert block_cap is None or num_blocks <= block_cap, f"{tenant} holds {num_blocks} > {block_cap}"


def _num_blocks_short(seq: Sequence, kv: KVCacheManager) -> int:
    """The blocks a running sequence still needs to finish its known tokens and take one more step
    (what admission reserves for it); zero or less when it holds them already."""
    if kv.half_block_tails:  # a tail in half a block may grow in place, or move into a whole block
        return kv.num_blocks_needed(seq, len(seq.token_ids) + 1 - seq.num_computed_tokens)
    return (len(seq.token_ids) + kv.block_size) // kv.block_size - len(seq.block_table)
