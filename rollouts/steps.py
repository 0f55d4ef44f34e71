"""A deployment's request, checked before anything is written: its steps, its bake window, its
thresholds; and the error the rollouts answer a refused request with."""

from __future__ import annotations

import math
from typing import Any

from django.conf import settings

from rollouts import judge
from rollouts.quality_floor import QualityFloor, QualityFloorError

MAX_STEPS = 20
MAX_BAKE_SECONDS = 7 * 24 * 3600


class DeploymentError(Exception):
    """A request the rollouts refuse; `status` is the HTTP status the API answers with."""

    status = 400


class DeploymentConflict(DeploymentError):
    status = 409


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    if not (is_int(value) or isinstance(value, float)):
        return False
    try:
        return math.isfinite(float(value))  # type: ignore[arg-type]
    except OverflowError:  # an integer of hundreds of digits, which JSON allows
        return False


def validate_steps(steps: object) -> list[dict[str, int]]:
    if not isinstance(steps, list) or not steps:
        raise DeploymentError('steps must be a non-empty list like [{"pct": 5}, {"pct": 100}]')
    if len(steps) > MAX_STEPS:
        raise DeploymentError(f"at most {MAX_STEPS} steps")
    pcts: list[int] = []
    for i, step in enumerate(steps):
        if not isinstance(step, dict) or set(step) != {"pct"}:
            raise DeploymentError(f'step {i} must be an object with exactly one key, "pct"')
        pct = step["pct"]
        if not is_int(pct) or not 1 <= pct <= 100:
            raise DeploymentError(f"step {i}: pct must be an integer from 1 to 100, got {pct!r}")
        if pcts and pct <= pcts[-1]:
            raise DeploymentError(f"steps must be strictly increasing; step {i} ({pct}%) follows {pcts[-1]}%")
        pcts.append(pct)
    if pcts[-1] != 100:
        raise DeploymentError(f"the last step must be 100%, got {pcts[-1]}%")
    if len(pcts) == 1:
        # At 100% the incumbent takes no traffic, so the judge has nothing to compare the canary with.
        raise DeploymentError(
            "a canary needs at least one step below 100% before the last, e.g. "
            '[{"pct": 5}, {"pct": 100}]: at 100% the incumbent gets nothing for the judge to compare with'
        )
    return [{"pct": p} for p in pcts]


_INT_THRESHOLDS = {"min_samples"}
_PROBABILITY_THRESHOLDS = {"alpha", "min_rate_increase", "min_truncation_increase"}
_SHARE_THRESHOLDS = {"min_agreement"}  # a share in [0, 1]: 1 asks every compared token to agree
# A finite number can still overflow the judge: 1e308 x an incumbent's p99 is inf, which neither SQLite's
# nor Postgres's JSON accepts, so every tick that saved its figures failed and the deployment never moved.
# The bounds are far past any sensible setting. (min_samples is an integer, only ever compared: a huge
# one holds a canary for good, which is how a benchmark keeps the judge from deciding.)
_UPPER_BOUNDS: dict[str, float] = {
    "ttft_sla_ms": 3_600_000.0,  # an hour
    "tpot_sla_ms": 600_000.0,
    "latency_ratio": 1000.0,
    "min_output_length_ratio": 1.0,  # the canary's mean output may be held to the incumbent's, not above
}


def resolve_thresholds(overrides: object) -> dict[str, Any]:
    """settings.ROLLOUT_THRESHOLDS with the deployment's overrides, checked name by name."""
    if overrides is None:
        overrides = {}
    if not isinstance(overrides, dict):
        raise DeploymentError("thresholds must be an object")
    known = judge.Thresholds.names()
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise DeploymentError(
            f"unknown threshold(s): {', '.join(map(str, unknown))}; known: {', '.join(sorted(known))}"
        )
    for name, value in overrides.items():
        if name in _INT_THRESHOLDS:
            if not is_int(value) or value < 1:
                raise DeploymentError(f"threshold {name} must be a positive integer, got {value!r}")
        elif not _is_number(value):
            raise DeploymentError(f"threshold {name} must be a number, got {value!r}")
        elif name in _PROBABILITY_THRESHOLDS and not 0 <= value < 1:
            raise DeploymentError(f"threshold {name} must be in [0, 1), got {value!r}")
        elif name in _SHARE_THRESHOLDS and not 0 <= value <= 1:
            raise DeploymentError(f"threshold {name} must be in [0, 1], got {value!r}")
        elif name not in _PROBABILITY_THRESHOLDS | _SHARE_THRESHOLDS and value <= 0:
            raise DeploymentError(f"threshold {name} must be positive, got {value!r}")
        if name in _UPPER_BOUNDS and value > _UPPER_BOUNDS[name]:
            raise DeploymentError(f"threshold {name} may be at most {_UPPER_BOUNDS[name]:g}, got {value!r}")
    if overrides.get("alpha") == 0:
        raise DeploymentError("threshold alpha must be above 0")
    resolved = {**settings.ROLLOUT_THRESHOLDS, **overrides}
    return judge.Thresholds.from_dict(resolved).as_dict()


def resolve_quality_floor(value: object) -> dict[str, float]:
    """A deployment's quality floor (rollouts/quality_floor.py) as stored: the fields set, {} for none."""
    try:
        return QualityFloor.from_dict(value).as_dict()
    except QualityFloorError as exc:
        raise DeploymentError(str(exc)) from None
