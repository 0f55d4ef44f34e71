"""Service tiers inside a replica (docs/architecture.md, "Service tiers"): which waiting sequence goes
first, and which running one gives way.

- Admission takes the best *effective* tier first: a sequence's own tier, a flex one promoted to
  default once it has waited an aging period (never to priority, which only a quota grants: an aged
  request outranking a fresh priority one would stall the displacement below), then the least-served
  tenant among those (fairness.py), then the one that has waited longest. So a flex request competes
  with default ones by age after one period, and starves only while priority requests fill the replica.
- A waiting sequence of the priority tier displaces running sequences of lower tiers when it cannot
  otherwise be seated: the lowest tier goes first, the latest admitted of it first (the least work lost).
  The other tiers wait for a seat in tier order: a preemption costs a recompute, which only the priority
  tier pays for.
- Under KV pressure (a running sequence needs a block that is not there) the lowest tier is preempted
  first, the latest admitted of it first."""

from __future__ import annotations

from collections.abc import Iterable

from serving.engine.sequence import DEFAULT_TIER, Sequence


def effective_tier(seq: Sequence, *, now: float, aging_s: float) -> int:
    """`seq`'s tier for admission order: its own, or default for a flex one that has waited `aging_s`."""
    if seq.tier <= DEFAULT_TIER or aging_s <= 0 or seq.enqueued_time is None:
        return seq.tier
    return DEFAULT_TIER if now - seq.enqueued_time >= aging_s else seq.tier


def lowest_tier_victim(
    running: Iterable[Sequence], *, below: int | None = None, tenant_id: str | None = None
) -> Sequence | None:
    """The running sequence to preempt: of the lowest tier (only tiers lower than `below`, when given;
    only `tenant_id`'s sequences, when given), the latest admitted of it. `running` in admission order."""
    victim: Sequence | None = None
    for seq in running:
        if tenant_id is not None and seq.tenant_id != tenant_id:
            continue
        if below is not None and seq.tier <= below:
            continue
        if victim is None or seq.tier >= victim.tier:  # >=: a later one of the same tier wins
            victim = seq
    return victim
