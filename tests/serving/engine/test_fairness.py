"""VirtualTokenCounter: exact counters for prompt and output weights, lift-on-return, least-served
order with ties, and bad weights."""

from __future__ import annotations

import math

import pytest

from serving.engine.fairness import VirtualTokenCounter


def make_counter(prompt_token_weight: float = 1.0, output_token_weight: float = 2.0) -> VirtualTokenCounter:
    return VirtualTokenCounter(
        prompt_token_weight=prompt_token_weight, output_token_weight=output_token_weight
    )


def test_prompt_and_output_tokens_are_charged_at_their_own_weights() -> None:
    vtc = make_counter(prompt_token_weight=0.5, output_token_weight=3.0)
    vtc.charge_prompt("a", 8)
    vtc.charge_prompt("b", 2)
    vtc.charge_output(["a", "b", "a"])  # one entry per sampled token
    assert (vtc.service_of("a"), vtc.service_of("b")) == (0.5 * 8 + 2 * 3.0, 0.5 * 2 + 3.0)
    assert vtc.service_of("never-seen") == 0.0


def test_zero_weights_charge_nothing() -> None:
    vtc = make_counter(prompt_token_weight=0.0, output_token_weight=0.0)
    vtc.charge_prompt("a", 100)
    vtc.charge_output(["a"] * 10)
    assert vtc.service_of("a") == 0.0


def test_a_returning_tenant_is_lifted_to_the_least_active_counter() -> None:
    vtc = make_counter()
    vtc.charge_prompt("idle", 4)
    vtc.charge_prompt("a", 10)
    vtc.charge_prompt("b", 30)
    vtc.lift("idle", active_tenant_ids=["a", "b"])
    # Idling while a and b were served earns no credit: it restarts at a's 10, not its own 4.
    assert vtc.service_of("idle") == 10.0
    assert vtc.least_served(["a", "idle", "b"]) == "a"  # tie with a: the first listed wins


def test_lift_never_lowers_a_counter() -> None:
    vtc = make_counter()
    vtc.charge_prompt("heavy", 50)
    vtc.charge_prompt("a", 10)
    vtc.lift("heavy", active_tenant_ids=["a"])
    assert vtc.service_of("heavy") == 50.0


def test_lift_with_nobody_active_keeps_the_own_counter() -> None:
    vtc = make_counter()
    vtc.charge_prompt("a", 7)
    vtc.lift("a", active_tenant_ids=[])
    vtc.lift("new", active_tenant_ids=[])
    assert (vtc.service_of("a"), vtc.service_of("new")) == (7.0, 0.0)


def test_a_new_tenant_starts_at_the_least_active_counter() -> None:
    vtc = make_counter()
    vtc.charge_prompt("a", 10)
    vtc.lift("new", active_tenant_ids=["a"])
    assert vtc.service_of("new") == 10.0


def test_least_served_picks_the_smallest_counter_then_the_first_on_a_tie() -> None:
    vtc = make_counter()
    vtc.charge_prompt("a", 5)
    vtc.charge_prompt("b", 3)
    vtc.charge_output(["c"])  # 2.0
    assert vtc.least_served(["a", "b", "c"]) == "c"
    vtc.charge_output(["c"])  # 4.0
    assert vtc.least_served(["a", "b", "c"]) == "b"
    vtc.charge_output(["b"])  # 5.0, tied with a
    assert vtc.least_served(["b", "a"]) == "b"
    assert vtc.least_served(["a", "b"]) == "a"
    assert vtc.least_served(["a", "b", "unseen"]) == "unseen"  # 0.0
    with pytest.raises(ValueError, match="empty"):
        vtc.least_served([])


@pytest.mark.parametrize(
    ("prompt_token_weight", "output_token_weight"), [(-1.0, 2.0), (1.0, -0.5), (math.nan, 2.0)]
)
def test_bad_weights_raise(prompt_token_weight: float, output_token_weight: float) -> None:
    with pytest.raises(ValueError, match="token weights must be >= 0"):
        make_counter(prompt_token_weight, output_token_weight)
