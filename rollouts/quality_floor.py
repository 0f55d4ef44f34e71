"""A deployment's quality floor: how good a candidate's recorded evaluation against its parent must be
before a canary advances (docs/architecture.md, "Quantized siblings"). A pure function of the floor, the
candidate's quantization and its recorded quality (registry ModelVersion.quality, which `manage.py
quantize` writes); no database, no clock.

- `min_greedy_agreement`: the least share of held-out positions where the candidate's greedy token is
  its parent's (0-1);
- `max_perplexity_increase`: the most its perplexity on the held-out text may exceed the parent's,
  relative (0.05: 5% higher);
- either empty (None): not judged.

The rules: a candidate is held, never rolled back (the figures are offline measurements: they do not
change while it waits, and an operator decides what to do with a version that misses them), when
1. it is quantized and has no recorded evaluation, whatever the floor: a quantized version is rolled out
   only with its accuracy loss measured;
2. the deployment sets a floor and the candidate has no recorded evaluation (quantized or not);
3. a figure the floor names misses it, or was not recorded."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any


class QualityFloorError(ValueError):
    """A floor that cannot be set; the message says why."""


@dataclass(frozen=True, slots=True)
class QualityFloor:
    min_greedy_agreement: float | None = None
    max_perplexity_increase: float | None = None

    @classmethod
    def from_dict(cls, values: object) -> QualityFloor:
        """The floor a request or a stored deployment names (None or {}: none), checked field by field."""
        if values is None:
            return cls()
        if not isinstance(values, dict):
            raise QualityFloorError("quality_floor must be an object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise QualityFloorError(
                f"unknown quality_floor field(s): {', '.join(map(str, unknown))}; "
                f"known: {', '.join(sorted(known))}"
            )
        for name, value in values.items():
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise QualityFloorError(f"quality_floor {name} must be a number or null, got {value!r}")
        agreement, increase = values.get("min_greedy_agreement"), values.get("max_perplexity_increase")
        if agreement is not None and not 0 <= agreement <= 1:
            raise QualityFloorError(
                f"quality_floor min_greedy_agreement must be in [0, 1], got {agreement!r}"
            )
        if increase is not None and not 0 <= increase <= 1000:
            raise QualityFloorError(
                f"quality_floor max_perplexity_increase must be in [0, 1000] (relative), got {increase!r}"
            )
        return cls(
            min_greedy_agreement=None if agreement is None else float(agreement),
            max_perplexity_increase=None if increase is None else float(increase),
        )

    @property
    def is_set(self) -> bool:
        return self.min_greedy_agreement is not None or self.max_perplexity_increase is not None

    def as_dict(self) -> dict[str, Any]:
        """What the deployment stores: only the fields that are set ({} when none is)."""
        return {name: value for name, value in asdict(self).items() if value is not None}


@dataclass(frozen=True, slots=True)
class QualityCheck:
    held: bool
    reason: str  # why it is held ("" when it is not)
    waiting_on: str | None  # what would let it go on that is not the judge's to do, if anything
    figures: dict[str, Any]


def check(
    floor: QualityFloor, *, candidate: str, quantization: str, quality: Mapping[str, Any]
) -> QualityCheck:
    """Whether the canary of `candidate` ("model:version") may advance as far as its quality goes."""
    figures: dict[str, Any] = {
        "floor": floor.as_dict(),
        "quantization": quantization or None,
        "recorded": {k: quality.get(k) for k in ("greedy_agreement", "perplexity_increase") if k in quality},
    }
    if not quality and (quantization or floor.is_set):
        why = f"{quantization} quantized" if quantization else "held to a quality floor"
        return QualityCheck(
            held=True,
            reason=f"{candidate} is {why} and has no recorded evaluation against its parent",
            waiting_on=f"an evaluation of {candidate} against its parent (manage.py quantize records one)",
            figures=figures,
        )
    misses = []
    agreement, increase = (
        _number(quality.get("greedy_agreement")),
        _number(quality.get("perplexity_increase")),
    )
    if floor.min_greedy_agreement is not None and (
        agreement is None or agreement < floor.min_greedy_agreement
    ):
        misses.append(f"greedy agreement {_pct(agreement)} < the floor's {floor.min_greedy_agreement:.2%}")
    if floor.max_perplexity_increase is not None and (
        increase is None or increase > floor.max_perplexity_increase
    ):
        misses.append(
            f"perplexity increase {_pct(increase, signed=True)} > the floor's "
            f"{floor.max_perplexity_increase:.2%}"
        )
    if misses:
        return QualityCheck(
            held=True,
            reason=f"{candidate} is under its quality floor: {'; '.join(misses)}",
            waiting_on=None,
            figures=figures,
        )
    return QualityCheck(held=False, reason="", waiting_on=None, figures=figures)


def _number(value: object) -> float | None:
    """A recorded figure as a number, None when it is not one (missing, null, text, infinite)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _pct(value: float | None, *, signed: bool = False) -> str:
    if value is None:
        return "not recorded"
    return f"{value:+.2%}" if signed else f"{value:.2%}"
