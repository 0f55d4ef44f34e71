"""Scheduler: exact batches for small cases, finish conditions, bad input, preemption, fairness across
tenants, per-tenant caps, and a hypothesis property test over random workloads on tiny KV pools."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.engine.kv_cache import KVCacheManager
from serving.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, latest_ends_in_steps
from serving.engine.sequence import (
    DEFAULT_TIER,
    FLEX_TIER,
    PRIORITY_TIER,
    FinishReason,
    SamplingParams,
    Sequence,
    SequenceStatus,
    TenantLimits,
)


def make_seq(
    request_id: str,
    num_prompt_tokens: int,
    *,
    max_tokens: int = 4,
    tenant_id: str = "a",
    prompt: list[int] | None = None,
    **params: Any,
) -> Sequence:
    if prompt is None:  # distinct per request, so nothing hits the prefix cache by accident
        offset = zlib.crc32(request_id.encode()) % 100_000 * 1000
        prompt = [offset + i for i in range(num_prompt_tokens)]
    params.setdefault("ignore_eos", True)
    return Sequence(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params), tenant_id)


def next_token(seq: Sequence) -> int:
    """A stand-in model: the next token depends only on the position, so recompute must reproduce it."""
    return 100 + len(seq.token_ids) * 7 % 50


def make_scheduler(num_blocks: int = 64, **overrides: object) -> Scheduler:
    fields: dict[str, object] = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "max_model_len": 256,
        "block_size": 4,
        **overrides,
    }
    config = SchedulerConfig(**fields)  # type: ignore[arg-type]
    return Scheduler(config, KVCacheManager(num_blocks, config.block_size, salt_secret=b"test"))


def step(
    scheduler: Scheduler, sample: Callable[[Sequence], int] = next_token
) -> tuple[SchedulerOutput, list[Sequence]]:
    output = scheduler.schedule()
    sampled = {
        item.seq.request_id: sample(item.seq)
        for item in output.scheduled
        if item.seq.num_computed_tokens + item.num_new_tokens == item.seq.num_tokens
    }
    return output, scheduler.update(output, sampled)


def batch(output: SchedulerOutput) -> list[tuple[str, int]]:
    return [(item.seq.request_id, item.num_new_tokens) for item in output.scheduled]


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> int:
    for num_steps in range(1, max_steps + 1):
        step(scheduler)
        scheduler.check_invariants()
        if not scheduler.has_unfinished():
            return num_steps
    raise AssertionError("did not finish")


# --- batches --------------------------------------------------------------------------------------


def test_decodes_go_first_then_prefill_chunks_then_admissions() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16)
    scheduler.add(make_seq("d1", 3, max_tokens=20))
    scheduler.add(make_seq("d2", 3, max_tokens=20))
    assert batch(step(scheduler)[0]) == [("d1", 3), ("d2", 3)]
    scheduler.add(make_seq("p", 40))
    scheduler.add(make_seq("w", 2))
    # Every step both decodes get their token; the long prompt gets what is left of the budget.
    assert batch(step(scheduler)[0]) == [("d1", 1), ("d2", 1), ("p", 14)]
    assert batch(step(scheduler)[0]) == [("d1", 1), ("d2", 1), ("p", 14)]
    assert batch(step(scheduler)[0]) == [("d1", 1), ("d2", 1), ("p", 12), ("w", 2)]
    assert batch(step(scheduler)[0]) == [("d1", 1), ("d2", 1), ("p", 1), ("w", 1)]


def test_chunked_prefill_cuts_a_long_prompt_to_the_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16)
    scheduler.add(make_seq("p", 40, max_tokens=2))
    chunks = [batch(step(scheduler)[0]) for _ in range(5)]
    assert chunks == [[("p", 16)], [("p", 16)], [("p", 8)], [("p", 1)], []]
    stats = scheduler.stats()
    assert (stats.num_steps, stats.num_batched_tokens, stats.num_running) == (5, 0, 0)
    assert not scheduler.has_unfinished()


def test_without_chunked_prefill_a_prompt_waits_for_a_budget_that_fits_it_whole() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=32, max_model_len=32, is_chunked_prefill_enabled=False)
    scheduler.add(make_seq("d1", 2, max_tokens=3))
    scheduler.add(make_seq("d2", 2, max_tokens=3))
    step(scheduler)
    scheduler.add(make_seq("p", 31, max_tokens=1))
    # 32 - 2 decodes leaves 30 tokens: not enough for 31 at once, so p waits rather than being cut.
    assert batch(step(scheduler)[0]) == [("d1", 1), ("d2", 1)]
    assert batch(step(scheduler)[0]) == [("d1", 1), ("d2", 1)]  # both reach max_tokens
    assert batch(step(scheduler)[0]) == [("p", 31)]


def test_max_num_seqs_caps_the_running_set() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for index in range(5):
        scheduler.add(make_seq(f"r{index}", 2, max_tokens=3))
    admitted_at: dict[str, int] = {}
    for number in range(1, 20):
        output, _ = step(scheduler)
        assert scheduler.num_running <= 2
        assert len(output.scheduled) <= 2
        for item in output.scheduled:
            admitted_at.setdefault(item.seq.request_id, number)
        if not scheduler.has_unfinished():
            break
    assert admitted_at == {"r0": 1, "r1": 1, "r2": 4, "r3": 4, "r4": 7}


# --- finishing ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "tokens", "reason", "num_outputs"),
    [
        ({"ignore_eos": False}, [7, 7, 2, 7], FinishReason.STOP, 3),  # EOS, kept in the output
        ({"ignore_eos": True}, [7, 7, 2, 7, 7, 7], FinishReason.LENGTH, 5),  # EOS ignored: max_tokens
        ({"stop_token_ids": (9,)}, [7, 9, 7], FinishReason.STOP, 2),
        ({}, [7] * 10, FinishReason.LENGTH, 5),
    ],
)
def test_a_sequence_finishes_on_eos_stop_token_or_max_tokens(
    params: dict[str, Any], tokens: list[int], reason: FinishReason, num_outputs: int
) -> None:
    scheduler = make_scheduler(eos_token_id=2)
    seq = make_seq("r", 6, max_tokens=5, **params)
    scheduler.add(seq)
    stream = iter(tokens)
    finished: list[Sequence] = []
    while not finished:
        finished = step(scheduler, lambda _seq: next(stream))[1]
    assert finished == [seq]
    assert seq.status is SequenceStatus.FINISHED
    assert seq.finish_reason is reason
    assert seq.output_token_ids == tokens[:num_outputs]
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_a_sequence_finishes_at_the_context_limit() -> None:
    scheduler = make_scheduler(max_model_len=10)
    seq = make_seq("r", 7, max_tokens=10)
    scheduler.add(seq)
    run_to_completion(scheduler)
    assert seq.finish_reason is FinishReason.LENGTH
    assert seq.num_tokens == 10
    assert seq.num_output_tokens == 3


def test_finish_from_outside_frees_blocks_and_records_the_reason() -> None:
    scheduler = make_scheduler()
    seq = make_seq("r", 6, max_tokens=50)
    scheduler.add(seq)
    step(scheduler)
    assert scheduler.finish("r", FinishReason.STOP) is seq
    assert seq.finish_reason is FinishReason.STOP
    assert seq.block_table == []
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks
    assert scheduler.finish("r", FinishReason.STOP) is None


def test_abort_frees_blocks_at_once_waiting_or_running() -> None:
    scheduler = make_scheduler(num_blocks=16, max_num_seqs=1)
    running = make_seq("running", 9, max_tokens=20)
    waiting = make_seq("waiting", 9)
    scheduler.add(running)
    scheduler.add(waiting)
    step(scheduler)
    assert scheduler.kv_cache.num_free_blocks == 16 - 3
    assert scheduler.abort("waiting") is waiting
    assert waiting.finish_reason is FinishReason.ABORT
    assert scheduler.num_waiting == 0
    output = scheduler.schedule()
    assert scheduler.abort("running") is running  # between schedule() and update()
    assert running.status is SequenceStatus.FINISHED
    assert scheduler.kv_cache.num_free_blocks == 16
    assert scheduler.update(output, {}) == []  # the aborted sequence is skipped
    assert running.num_output_tokens == 1
    assert scheduler.abort("unknown") is None
    assert not scheduler.has_unfinished()
    scheduler.check_invariants()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: make_seq("r", 0, prompt=[]), "at least one token"),
        (lambda: make_seq("r", 32), "context limit is 32"),
        (lambda: make_seq("r", 4, max_tokens=33), "exceeds the context limit"),
        (lambda: make_seq("r", 4, temperature=-1.0), "temperature"),
        (lambda: make_seq("r", 4, top_p=0.0), "top_p"),
        (lambda: make_seq("r", 4, top_p=1.5), "top_p"),
        (lambda: make_seq("r", 4, max_tokens=0), "max_tokens"),
        (lambda: make_seq("r", 30, max_tokens=2), "can ever be available"),  # 31 positions: 8 blocks > 6
    ],
)
def test_add_rejects_bad_input_before_allocating_anything(make: Callable[[], Sequence], match: str) -> None:
    scheduler = make_scheduler(num_blocks=6, max_model_len=32)
    with pytest.raises(ValueError, match=match):
        scheduler.add(make())
    assert not scheduler.has_unfinished()
    assert scheduler.kv_cache.num_free_blocks == 6
    assert scheduler.schedule().scheduled == []


def test_add_rejects_duplicates_and_requests_over_the_tenant_block_cap() -> None:
    scheduler = make_scheduler(max_blocks_per_tenant=2)
    scheduler.add(make_seq("r", 4))
    with pytest.raises(ValueError, match="already queued"):
        scheduler.add(make_seq("r", 4))
    with pytest.raises(ValueError, match="at most 2"):
        scheduler.add(make_seq("big", 8, max_tokens=4))  # 11 positions: 3 blocks
    assert scheduler.num_waiting == 1


def test_bad_config_raises() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0).validate()
    with pytest.raises(ValueError, match="without chunked prefill"):
        SchedulerConfig(
            max_num_batched_tokens=16, max_model_len=32, is_chunked_prefill_enabled=False
        ).validate()
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(SchedulerConfig(block_size=8), KVCacheManager(4, block_size=16))


# --- preemption -----------------------------------------------------------------------------------


def test_running_out_of_blocks_preempts_the_most_recently_admitted_and_recompute_completes() -> None:
    scheduler = make_scheduler(num_blocks=6, max_num_seqs=3, watermark_fraction=0.0)
    seqs = [make_seq(name, 4, max_tokens=12) for name in ("a", "b", "c")]
    for seq in seqs:
        scheduler.add(seq)
    victims: list[str] = []
    for _ in range(200):
        before = scheduler.running_seqs()
        output, _ = step(scheduler)
        scheduler.check_invariants()
        # Victims are taken from the newest end of the admission order.
        assert output.preempted == list(reversed(before))[: len(output.preempted)]
        victims += [seq.request_id for seq in output.preempted]
        if not scheduler.has_unfinished():
            break
    assert victims[0] == "c"
    assert scheduler.num_preemptions == len(victims) >= 1
    # Recompute lost nothing: every sequence has the tokens an unpreempted run gives.
    reference = make_scheduler(num_blocks=64)
    expected = [make_seq(name, 4, max_tokens=12) for name in ("a", "b", "c")]
    for seq in expected:
        reference.add(seq)
    run_to_completion(reference)
    assert reference.num_preemptions == 0
    for seq, want in zip(seqs, expected, strict=True):
        assert seq.token_ids == want.token_ids
        assert seq.num_output_tokens == 12
    assert seqs[2].num_preemptions >= 1


def test_a_prefill_stalled_by_decodes_requeues_and_resumes_from_the_prefix_cache() -> None:
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=6, watermark_fraction=0.0)
    a = make_seq("a", 11, max_tokens=6)
    b = make_seq("b", 10, max_tokens=10)
    scheduler.add(a)
    scheduler.add(b)
    outputs = [step(scheduler)[0] for _ in range(8)]
    assert [batch(output) for output in outputs[:4]] == [
        [("a", 6)],
        [("a", 5), ("b", 1)],
        [("a", 1), ("b", 5)],
        [("a", 1), ("b", 2)],  # a's decode took a block: b's chunk shrinks to the slots it holds
    ]
    # a's next decode takes the last free block; b cannot move and gives its blocks back.
    assert batch(outputs[4]) == [("a", 1)]
    assert outputs[4].preempted == [b]
    assert batch(outputs[7]) == [("b", 2)]  # a finished; b's two full blocks came from the cache
    assert scheduler.kv_cache.prefix_cache.num_hit_tokens == 8  # b's own blocks, reused on resume
    assert b.num_cached_prompt_tokens == 0  # not reported to the user as a prompt-cache hit
    run_to_completion(scheduler)
    assert (a.num_output_tokens, b.num_output_tokens) == (6, 10)


# --- fairness and caps ----------------------------------------------------------------------------

PROMPT, OUTPUT, MAX_NUM_SEQS, BUDGET = 128, 64, 8, 512


def wait_of_light_tenant(light_tenant: str) -> int | None:
    """Tenant "a" floods 200 requests; 5 more from `light_tenant` arrive after the first step. Steps
    until all 5 are admitted, or None if not within the VTC bound."""
    scheduler = make_scheduler(
        num_blocks=8 * MAX_NUM_SEQS * 2,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=BUDGET,
        max_model_len=1024,
        block_size=16,
    )
    for index in range(200):
        scheduler.add(make_seq(f"a{index}", PROMPT, max_tokens=OUTPUT, tenant_id="a"))
    step(scheduler)
    light = [make_seq(f"b{index}", PROMPT, max_tokens=OUTPUT, tenant_id=light_tenant) for index in range(5)]
    for seq in light:
        scheduler.add(seq)
    for num_steps in range(1, VTC_BOUND_STEPS + 1):
        step(scheduler)
        if all(seq.status is not SequenceStatus.WAITING for seq in light):
            return num_steps
    return None


# A running request holds its seat for at most T = 2 prefill steps (its prompt fits one budget, but its
# first chunk may get only what the decodes left) + OUTPUT decode steps. Under VTC the newcomer starts
# at the flooding tenant's counter and thereafter gains service more slowly than the flooder while the
# flooder holds more seats, so it wins every seat freed from its arrival on: within T steps every seat
# held at its arrival has turned over, and 5 < MAX_NUM_SEQS seats are enough. 2T leaves slack for the
# tie on arrival. FIFO instead serves the 200 flooding requests first: about 200 / 8 * T steps.
VTC_BOUND_STEPS = 2 * (2 + OUTPUT)


def test_vtc_admits_a_light_tenant_within_a_bounded_number_of_steps() -> None:
    num_steps = wait_of_light_tenant("b")
    assert num_steps is not None
    assert num_steps <= VTC_BOUND_STEPS


def test_fifo_order_would_break_that_bound() -> None:
    # One tenant for everyone: the fair order degenerates to arrival order.
    assert wait_of_light_tenant("a") is None


def test_a_tenant_that_idled_earns_no_credit() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add(make_seq("a0", 8, max_tokens=2, tenant_id="a"))
    run_to_completion(scheduler)
    scheduler.add(make_seq("b0", 8, max_tokens=30, tenant_id="b"))
    for _ in range(10):
        step(scheduler)
    assert scheduler.service_of("b") > scheduler.service_of("a")
    scheduler.add(make_seq("a1", 8, max_tokens=2, tenant_id="a"))
    # a was idle while b was served: it restarts at b's counter, not below it.
    assert scheduler.service_of("a") == scheduler.service_of("b")


def test_running_cap_per_tenant_skips_that_tenant_without_blocking_others() -> None:
    scheduler = make_scheduler(max_running_per_tenant=2)
    for index in range(6):
        scheduler.add(make_seq(f"a{index}", 4, max_tokens=5, tenant_id="a"))
    scheduler.add(make_seq("b0", 4, max_tokens=5, tenant_id="b"))
    scheduler.add(make_seq("b1", 4, max_tokens=5, tenant_id="b"))
    output, _ = step(scheduler)
    assert sorted(request_id for request_id, _ in batch(output)) == ["a0", "a1", "b0", "b1"]
    while scheduler.has_unfinished():
        step(scheduler)
        tenants = [seq.tenant_id for seq in scheduler.running_seqs()]
        assert tenants.count("a") <= 2
        assert tenants.count("b") <= 2
        scheduler.check_invariants()


def test_block_cap_per_tenant_holds_every_step() -> None:
    scheduler = make_scheduler(num_blocks=40, max_blocks_per_tenant=6)
    seqs = [make_seq(f"a{index}", 8, max_tokens=12, tenant_id="a") for index in range(5)]
    seqs.append(make_seq("b0", 8, max_tokens=12, tenant_id="b"))
    for seq in seqs:
        scheduler.add(seq)
    while scheduler.has_unfinished():
        step(scheduler)
        assert all(n <= 6 for n in scheduler.kv_cache.num_blocks_by_tenant.values())
        scheduler.check_invariants()
    assert all(seq.num_output_tokens == 12 for seq in seqs)


# --- property test --------------------------------------------------------------------------------

PROMPT_BASES = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5] * 6)


@st.composite
def workloads(draw: st.DrawFn) -> tuple[Scheduler, list[tuple[int, Sequence]], list[tuple[int, int]]]:
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(2, 12))
    max_model_len = draw(st.integers(4, 40))
    is_chunked = draw(st.booleans())
    config = SchedulerConfig(
        tier_aging_s=draw(st.sampled_from([0.0, 0.0, 1e-9])),  # never, or every step (a fake clock is 0)
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 8) | st.integers(1, 48))
        if is_chunked
        else draw(st.integers(max_model_len, 48)),
        max_model_len=max_model_len,
        block_size=block_size,
        max_running_per_tenant=draw(st.none() | st.integers(1, 3)),
        max_blocks_per_tenant=draw(st.none() | st.integers(1, num_blocks)),
        is_chunked_prefill_enabled=is_chunked,
        watermark_fraction=draw(st.sampled_from([0.0, 0.0, 0.01, 0.2])),
    )
    kv = KVCacheManager(
        num_blocks,
        block_size,
        is_prefix_caching_enabled=draw(st.booleans()),
        salt_secret=b"t",
        half_block_tails=block_size % 2 == 0 and draw(st.booleans()),  # tails in half blocks (half_blocks.py)
    )
    # Under pressure: short prompts that grow long, so decodes outgrow what admission reserved.
    is_pressure = draw(st.booleans())
    max_prompt_tokens = 4 if is_pressure else 14
    min_output_tokens = 6 if is_pressure else 1
    # Each tenant's own caps (its quota), or the replica's; fixed per tenant, as a quota between edits.
    limits = {
        tenant: draw(
            st.none()
            | st.builds(
                TenantLimits,
                max_running=st.none() | st.integers(1, 3),
                kv_share=st.none() | st.sampled_from([0.25, 0.5, 1.0]),
            )
        )
        for tenant in "abc"
    }
    arrivals = []
    for index in range(draw(st.integers(1, 16))):
        base = draw(st.sampled_from(PROMPT_BASES))
        prompt = (base + draw(st.lists(st.integers(0, 3), max_size=6)))[
            : draw(st.integers(1, max_prompt_tokens))
        ]
        tenant = draw(st.sampled_from(["a", "b", "c"]))
        seq = Sequence(
            f"r{index}",
            prompt,
            SamplingParams(max_tokens=draw(st.integers(min_output_tokens, 16)), ignore_eos=True),
            tenant,
            cache_group=draw(st.sampled_from([None, "shared"])),
            tier=draw(st.sampled_from([PRIORITY_TIER, DEFAULT_TIER, FLEX_TIER])),
            limits=limits[tenant],
        )
        arrivals.append((draw(st.integers(0, 10)), seq))
    aborts = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 15)), max_size=3))
    return Scheduler(config, kv), arrivals, aborts


@settings(max_examples=250, deadline=None)
@given(workloads())
def test_random_workloads_keep_invariants_and_finish_every_request(
    workload: tuple[Scheduler, list[tuple[int, Sequence]], list[tuple[int, int]]],
) -> None:
    scheduler, arrivals, aborts = workload
    cfg = scheduler.config
    accepted: dict[str, Sequence] = {}
    aborted: set[str] = set()
    last_arrival = max(arrival for arrival, _ in arrivals)
    for number in range(3000):
        for arrival, seq in arrivals:
            if arrival == number:
                try:
                    scheduler.add(seq)
                except ValueError:
                    # Only requests that could never run are refused.
                    assert (
                        seq.num_prompt_tokens >= cfg.max_model_len
                        or seq.params.max_tokens > cfg.max_model_len
                        or (
                            -(
                                -(min(seq.num_prompt_tokens + seq.params.max_tokens, cfg.max_model_len) - 1)
                                // cfg.block_size
                            )
                            > scheduler.max_blocks_per_sequence(seq.limits)
                        )
                    )
                else:
                    accepted[seq.request_id] = seq
        for when, index in aborts:
            if when == number and scheduler.abort(f"r{index}") is not None:
                aborted.add(f"r{index}")
        output, _ = step(scheduler)
        scheduler.check_invariants()
        if scheduler.has_unfinished():
            assert output.scheduled or output.preempted, "a step with work left must make progress"
        elif number >= last_arrival:
            break
    assert not scheduler.has_unfinished(), "deadlock: requests left after 3000 steps"
    kv = scheduler.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    for request_id, seq in accepted.items():
        assert seq.status is SequenceStatus.FINISHED
        if request_id in aborted:
            continue
        expected_outputs = min(seq.params.max_tokens, cfg.max_model_len - seq.num_prompt_tokens)
        assert seq.finish_reason is FinishReason.LENGTH
        assert seq.num_output_tokens == expected_outputs
        # Recompute and prefix hits reproduce exactly the tokens of an undisturbed run.
        expected = list(seq.prompt_token_ids)
        while len(expected) < seq.num_tokens:
            expected.append(100 + len(expected) * 7 % 50)
        assert seq.token_ids == expected


@given(
    num_blocks=st.integers(1, 40),
    tenant_cap=st.one_of(st.none(), st.integers(1, 40)),
    num_prompt_tokens=st.integers(1, 255),
)
@settings(max_examples=200, deadline=None)
def test_max_output_tokens_is_exactly_what_add_admits(
    num_blocks: int, tenant_cap: int | None, num_prompt_tokens: int
) -> None:
    """A request that asked for no length (chat's default: to the end) is given max_output_tokens: never
    refused for a KV pool, or a tenant's share of it, smaller than the context."""
    scheduler = make_scheduler(num_blocks, max_blocks_per_tenant=tenant_cap)
    longest = scheduler.max_output_tokens(num_prompt_tokens)
    if longest >= 1:
        scheduler.add(make_seq("fits", num_prompt_tokens, max_tokens=longest))
    if num_prompt_tokens + longest < 256:  # one more is refused, unless the context limit refuses it first
        with pytest.raises(ValueError, match="KV blocks"):
            scheduler.add(make_seq("over", num_prompt_tokens, max_tokens=max(1, longest + 1)))


def test_the_latest_ends_are_the_steps_each_decoding_sequence_has_left_and_it_ends_by_then() -> None:
    """The TTFT forecast's bound on a full batch's seat wait (scheduler.latest_ends_in_steps)."""
    scheduler = make_scheduler(max_num_batched_tokens=16)
    scheduler.add(make_seq("short", 3, max_tokens=2))
    scheduler.add(make_seq("long", 3, max_tokens=5))
    scheduler.add(make_seq("prefilling", 40, max_tokens=1))
    step(scheduler)  # short and long prefill and make a token each; prefilling gets 10 of its 40
    # The soonest first; a sequence still prefilling is left out (it ends later than any decoding one
    # with as many tokens left, so leaving it out keeps each figure a bound).
    assert latest_ends_in_steps(scheduler.running_seqs(), 8) == (1, 4)
    assert latest_ends_in_steps(scheduler.running_seqs(), 1) == (1,)
    _, finished = step(scheduler)
    assert [seq.request_id for seq in finished] == ["short"]
    for _ in range(3):
        step(scheduler)
    assert scheduler.get("long") is None  # ended within the 4 steps it listed
