"""Service tiers and tenants' own caps in the scheduler (serving/engine/tiers.py, docs/architecture.md,
"Service tiers"): a priority request takes a flex one's seat at once, a flex request is promoted by aging
so it is never starved, KV pressure preempts the lowest tier first, and a tenant's quota caps only it."""

from __future__ import annotations

import dataclasses

from serving.engine.kv_cache import KVCacheManager
from serving.engine.scheduler import Scheduler, SchedulerConfig
from serving.engine.sequence import DEFAULT_TIER, FLEX_TIER, PRIORITY_TIER, SequenceStatus, TenantLimits
from tests.serving.engine.test_scheduler import make_scheduler, make_seq, step


def _with(seq, **fields):  # type: ignore[no-untyped-def]
    return dataclasses.replace(seq, **fields)


def test_a_priority_request_takes_a_running_flex_seat_and_starts_on_the_next_step() -> None:
    scheduler = make_scheduler(max_num_seqs=4, tier_aging_s=0)
    for i in range(8):  # a flood of long flex generations: 4 running, 4 waiting
        scheduler.add(_with(make_seq(f"flex{i}", 8, max_tokens=200), tier=FLEX_TIER))
    for _ in range(3):
        step(scheduler)
    scheduler.add(_with(make_seq("urgent", 8, max_tokens=4), tier=PRIORITY_TIER))
    output, _ = step(scheduler)
    assert "urgent" in {item.seq.request_id for item in output.scheduled}
    assert [seq.tier for seq in output.preempted] == [FLEX_TIER]  # one seat, one flex gave it up
    scheduler.check_invariants()


def test_a_default_request_waits_for_a_seat_rather_than_displacing_flex() -> None:
    scheduler = make_scheduler(max_num_seqs=2, tier_aging_s=0)
    for i in range(2):
        scheduler.add(_with(make_seq(f"f{i}", 8, max_tokens=50), tier=FLEX_TIER))
    step(scheduler)
    scheduler.add(make_seq("late", 8, max_tokens=4))
    output, _ = step(scheduler)
    assert not output.preempted
    assert scheduler.get("late").status is SequenceStatus.WAITING  # type: ignore[union-attr]


def test_a_waiting_flex_request_is_promoted_by_aging_and_admitted_before_later_defaults() -> None:
    now = [0.0]
    config = SchedulerConfig(
        max_num_seqs=1, max_num_batched_tokens=64, max_model_len=256, block_size=4, tier_aging_s=5.0
    )
    scheduler = Scheduler(config, KVCacheManager(64, 4, salt_secret=b"t"), clock=lambda: now[0])
    scheduler.add(make_seq("d0", 4, max_tokens=2))
    scheduler.add(_with(make_seq("flex", 4, max_tokens=2), tier=FLEX_TIER))
    admitted: list[str] = []
    for number in range(1, 60):
        # A default request arrives every step: without aging the flex one would wait for ever.
        scheduler.add(make_seq(f"d{number}", 4, max_tokens=2))
        output, _ = step(scheduler)
        admitted += [item.seq.request_id for item in output.scheduled if item.num_new_tokens > 1]
        if "flex" in admitted:
            break
        now[0] += 1.0  # a second per step
    # Promoted to default after 5 s, to priority after 10 s: it goes first once it outranks them.
    assert "flex" in admitted
    assert now[0] <= 2 * config.tier_aging_s


def test_kv_pressure_preempts_the_lowest_tier_first_whatever_the_admission_order() -> None:
    # 8 blocks of 4 tokens: three sequences that each grow to 3+ blocks cannot all stay.
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=3, tier_aging_s=0, watermark_fraction=0.0)
    scheduler.add(_with(make_seq("flex", 4, max_tokens=12), tier=FLEX_TIER))
    scheduler.add(_with(make_seq("default", 4, max_tokens=12), tier=DEFAULT_TIER))
    scheduler.add(_with(make_seq("priority", 4, max_tokens=12), tier=PRIORITY_TIER))
    preempted: list[str] = []
    while scheduler.has_unfinished():
        output, _ = step(scheduler)
        preempted += [seq.request_id for seq in output.preempted]
        scheduler.check_invariants()
    assert preempted and preempted[0] == "flex"  # admitted first, preempted first all the same
    assert "priority" not in preempted


def test_a_tenants_own_caps_bind_it_and_no_other() -> None:
    scheduler = make_scheduler(max_num_seqs=8, tier_aging_s=0)
    capped = TenantLimits(max_running=1, kv_share=0.25)
    for i in range(4):
        scheduler.add(_with(make_seq(f"a{i}", 4, max_tokens=8, tenant_id="a"), limits=capped))
        scheduler.add(make_seq(f"b{i}", 4, max_tokens=8, tenant_id="b"))
    output, _ = step(scheduler)
    tenants = [item.seq.tenant_id for item in output.scheduled]
    assert tenants.count("a") == 1 and tenants.count("b") == 4
    while scheduler.has_unfinished():
        step(scheduler)
        scheduler.check_invariants()  # asserts a's running and block caps every step


def test_a_request_that_waited_past_the_queue_timeout_without_a_seat_is_expired() -> None:
    now = [0.0]
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=256, block_size=4)
    scheduler = Scheduler(config, KVCacheManager(64, 4, salt_secret=b"t"), clock=lambda: now[0])
    scheduler.add(make_seq("running", 4, max_tokens=50))
    step(scheduler)
    scheduler.add(make_seq("waiting", 4, max_tokens=4))
    now[0] = 5.0
    assert scheduler.expire_waiting(10.0) == []  # not yet
    now[0] = 11.0
    expired = scheduler.expire_waiting(10.0)
    assert [seq.request_id for seq in expired] == ["waiting"]
    assert scheduler.get("waiting") is None and scheduler.get("running") is not None
    assert scheduler.expire_waiting(0.0) == []  # one that ran is never expired
    scheduler.check_invariants()
