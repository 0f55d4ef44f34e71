"""Admission: who waits and who runs. The per-tenant waiting queues, the running set, and the policy
that moves sequences between them: admission least-served tenant first (fairness.py) under per-tenant
caps and a watermark of free blocks, and preemption (recompute) when a running sequence needs a block
that is not there. The scheduler (scheduler.py) builds each step on top of it."""

from __future__ import annotations

import collections
from collections.abc import Callable, KeysView

from serving.engine.fairness import VirtualTokenCounter
from serving.engine.kv_cache import KVCacheManager
from serving.engine.sequence import Sequence, SequenceStatus


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
    ) -> None:
        self.kv_cache = kv_cache
        self.vtc = vtc
        self._clock = clock
        self.max_num_seqs = max_num_seqs
        self.max_running_per_tenant = max_running_per_tenant
        self.max_blocks_per_tenant = max_blocks_per_tenant
        self.is_chunked_prefill_enabled = is_chunked_prefill_enabled
        self._num_watermark_blocks = num_watermark_blocks
        self.running: dict[str, Sequence] = {}  # in admission order: the last is preempted first
        self._waiting_by_tenant: dict[str, collections.deque[Sequence]] = {}  # FIFO each; never empty
        self.num_waiting = 0
        self._tenant_to_num_running: dict[str, int] = {}
        self.num_preemptions = 0

    # --- in and out of the queues -----------------------------------------------------------------

    def enqueue(self, seq: Sequence, *, is_preempted: bool) -> None:
        tenant = seq.tenant_id
        queue = self._waiting_by_tenant.get(tenant)
        if queue is None:
            if not is_preempted and not self._tenant_to_num_running.get(tenant):
                # Back from idle (a preempted sequence's tenant never left): no credit for the idle time.
                self.vtc.lift(tenant, active_tenant_ids=self._active_tenant_ids())
            queue = self._waiting_by_tenant[tenant] = collections.deque()
        if is_preempted:
            queue.appendleft(seq)  # it was admitted before everything still waiting
        else:
            queue.append(seq)
        self.num_waiting += 1

    def remove_waiting(self, seq: Sequence) -> None:
        queue = self._waiting_by_tenant[seq.tenant_id]
        # By identity: Sequence equality compares every field.
        del queue[next(i for i, queued in enumerate(queue) if queued is seq)]
        if not queue:
            del self._waiting_by_tenant[seq.tenant_id]
        self.num_waiting -= 1

    def remove_running(self, seq: Sequence) -> None:
        del self.running[seq.request_id]
        self._tenant_to_num_running[seq.tenant_id] -= 1

    def _active_tenant_ids(self) -> list[str]:
        """Tenants with a sequence waiting or running."""
        running = [tenant for tenant, num_running in self._tenant_to_num_running.items() if num_running]
        return [*self._waiting_by_tenant, *running]

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
            num_short = (len(seq.token_ids) + bs) // bs - len(seq.block_table)
            if num_short > 0:
                num_reserved += num_short
                tenant_to_num_reserved[seq.tenant_id] += num_short
        skipped: set[str] = set()
        while budget and len(self.running) < self.max_num_seqs:
            candidates = [t for t in self._waiting_by_tenant if t not in skipped]
            if not candidates:
                break
            tenant = self.vtc.least_served(candidates)
            num_tenant_running = self._tenant_to_num_running.get(tenant, 0)
            if self.max_running_per_tenant is not None and num_tenant_running >= self.max_running_per_tenant:
                skipped.add(tenant)
                continue
            queue = self._waiting_by_tenant[tenant]
            seq = queue[0]
            prefix = kv.match_prefix(seq)
            num_remaining = len(seq.token_ids) - prefix.num_tokens
            num_new = min(num_remaining, budget)
            if num_new < num_remaining and not self.is_chunked_prefill_enabled:
                break  # the least-served tenant's head waits for a fuller budget; nobody jumps it
            num_eventual = (len(seq.token_ids) + bs) // bs  # blocks to finish its tokens and step once
            if (
                self.max_blocks_per_tenant is not None
                and num_tenant_running
                and kv.num_blocks_by_tenant.get(tenant, 0) + tenant_to_num_reserved[tenant] + num_eventual
                > self.max_blocks_per_tenant
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
            queue.popleft()
            if not queue:
                del self._waiting_by_tenant[tenant]
            self.num_waiting -= 1
            kv.allocate(seq, num_new, prefix)
            num_reserved += num_taken_eventually - num_taken_now
            tenant_to_num_reserved[tenant] += max(0, num_eventual - len(seq.block_table))
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
        """Preempt until `seq` gets one more slot; False if `seq` itself had to go."""
        kv = self.kv_cache
        cap = self.max_blocks_per_tenant
        while True:
            num_needed = kv.num_blocks_needed(seq, 1)
            if cap is not None and kv.num_blocks_by_tenant.get(seq.tenant_id, 0) + num_needed > cap:
                victim = next(s for s in reversed(self.running.values()) if s.tenant_id == seq.tenant_id)
            elif num_needed > kv.num_free_blocks:
                victim = next(reversed(self.running.values()))
            else:
                return True
            self.preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False

    def num_free_slots(self, seq: Sequence) -> int:
        """Tokens `seq` could still compute this step without preempting anyone."""
        kv = self.kv_cache
        num_blocks = kv.num_free_blocks
        cap = self.max_blocks_per_tenant
        if cap is not None:
            num_blocks = min(num_blocks, cap - kv.num_blocks_by_tenant.get(seq.tenant_id, 0))
        return len(seq.block_table) * kv.block_size - seq.num_computed_tokens + num_blocks * kv.block_size

    def preempt(self, seq: Sequence) -> None:
        """Recompute later: drop the blocks and go back to the front of the tenant's queue."""
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
        waiting = [seq for queue in self._waiting_by_tenant.values() for seq in queue]
        assert all(queue for queue in self._waiting_by_tenant.values()), "no empty tenant queues"
        assert len(waiting) == self.num_waiting
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
        if self.max_running_per_tenant is not None:
            assert all(n <= self.max_running_per_tenant for n in running_by_tenant.values())
        if self.max_blocks_per_tenant is not None:
            assert all(n <= self.max_blocks_per_tenant for n in self.kv_cache.num_blocks_by_tenant.values())
