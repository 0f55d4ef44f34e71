"""The engine's adapter slots (serving/engine/lora_slots.py): installed on first seat, least recently used
evicted first and never one a live sequence holds; a request whose adapter finds every slot held waits,
and no other adapter's new request is seated until it is (so it cannot starve); a property test over
random requests, seats and finishes."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from serving.engine.lora_slots import AdapterSlots
from serving.engine.sequence import Sequence


@dataclass(frozen=True)
class FakeAdapter:
    adapter_id: str


def make_slots(max_loras: int) -> tuple[AdapterSlots[FakeAdapter, str], list[str]]:
    installs: list[str] = []

    def prepare(adapter: FakeAdapter) -> str:
        installs.append(adapter.adapter_id)
        return f"weights of {adapter.adapter_id}"

    return AdapterSlots(max_loras=max_loras, prepare=prepare), installs


def request(slots: AdapterSlots[FakeAdapter, str], request_id: str, adapter_id: str | None) -> Sequence:
    seq = Sequence(request_id, [1, 2, 3], adapter_id=adapter_id)
    if adapter_id is not None:
        slots.register(seq, FakeAdapter(adapter_id))
    return seq


def test_least_recently_used_unheld_adapters_are_evicted_first() -> None:
    slots, installs = make_slots(2)
    a1, b1 = request(slots, "a1", "a"), request(slots, "b1", "b")
    for seq in (a1, b1):
        assert slots.can_seat(seq)
        slots.seat(seq)
    assert slots.weights("a") == "weights of a" and slots.stats().resident == ("a", "b")
    slots.release(b1)
    slots.release(a1)  # a used last
    c1 = request(slots, "c1", "c")
    assert slots.can_seat(c1)
    slots.seat(c1)  # evicts b, the least recently used
    assert slots.stats().resident == ("a", "c") and installs == ["a", "b", "c"]
    base = request(slots, "base", None)
    assert slots.can_seat(base) and slots.has_holders  # c1 holds c
    slots.seat(base)  # the base's: nothing held
    assert slots.stats().num_evictions == 1
    slots.check_invariants()


def test_a_request_waits_for_a_held_slot_and_held_slots_drain_for_it() -> None:
    slots, installs = make_slots(1)
    a1 = request(slots, "a1", "a")
    slots.seat(a1)
    b1 = request(slots, "b1", "b")
    assert not slots.can_seat(b1)  # a's slot is held
    a2 = request(slots, "a2", "a")
    assert not slots.can_seat(a2)  # resident, but b waits for the slot: a drains
    assert slots.can_seat(request(slots, "base", None))
    assert slots.can_seat(a1)  # seated already (say, preempted since)
    assert slots.stats().num_waiting_for_slot == 1
    slots.release(a1)
    assert slots.can_seat(b1)
    slots.seat(b1)
    assert slots.can_seat(a2) is False  # now b holds the one slot
    assert installs == ["a", "b"] and slots.stats().num_waiting_for_slot == 1
    slots.release(a2)  # a2 aborted while waiting: nothing starves any more
    assert slots.stats().num_waiting_for_slot == 0
    slots.check_invariants()


@settings(max_examples=80, deadline=None)
@given(
    max_loras=st.integers(1, 3),
    ops=st.lists(
        st.tuples(st.sampled_from(["new", "seat", "finish"]), st.sampled_from([None, "a", "b", "c", "d"])),
        max_size=40,
    ),
    picks=st.lists(st.integers(0, 1000), min_size=40, max_size=40),
)
def test_slots_keep_their_invariants_and_every_request_is_seated_in_the_end(
    max_loras: int, ops: list[tuple[str, str | None]], picks: list[int]
) -> None:
    slots, _ = make_slots(max_loras)
    waiting: list[Sequence] = []
    seated: list[Sequence] = []
    for index, (op, adapter_id) in enumerate(ops):
        pick = picks[index]
        if op == "new":
            waiting.append(request(slots, f"r{index}", adapter_id))
        elif op == "seat" and waiting:
            seq = waiting[pick % len(waiting)]
            if slots.can_seat(seq):
                slots.seat(seq)
                waiting.remove(seq)
                seated.append(seq)
        elif op == "finish" and (waiting or seated):
            pool = seated if seated and pick % 2 else waiting or seated
            seq = pool.pop(pick % len(pool))
            slots.release(seq)
        slots.check_invariants()
        resident = set(slots.stats().resident)
        assert all(s.adapter_id in resident for s in seated if s.adapter_id is not None)
    # Liveness: admitting in arrival order while the seated finish seats everyone, a few rounds at most.
    for _ in range(len(waiting) + 1):
        for seq in list(waiting):
            if slots.can_seat(seq):
                slots.seat(seq)
                waiting.remove(seq)
                seated.append(seq)
        for seq in seated:
            slots.release(seq)
        seated.clear()
        slots.check_invariants()
    assert not waiting
    assert not slots.has_holders and slots.stats().num_waiting_for_slot == 0
