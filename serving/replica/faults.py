"""Fault injection, to show and test a bad version: a delay added to every engine step, and a fraction
of requests that end in an `injected_fault` error instead of their tokens (drawn at admission from a
seeded RNG, so a run is reproducible).

Off by default, and refused unless DEBUG is on or SWITCHYARD_ALLOW_FAULT_INJECTION=1. Two ways in:
`run_replica --inject-step-delay-ms 40 --inject-error-rate 0.2`, or, for the replicas the server hosts
itself, SWITCHYARD_FAULTS="demo-chat:v3=delay_ms:40,error_rate:0.2;demo-chat:v4=error_rate:1"."""

from __future__ import annotations

import functools
import logging
import math
import random
from dataclasses import dataclass, field

from django.conf import settings

logger = logging.getLogger(__name__)


class FaultInjectionRefused(Exception):
    pass


class FaultSpecError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Faults:
    step_delay_ms: float = 0.0
    error_rate: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.step_delay_ms) and 0 <= self.step_delay_ms <= 60_000):
            raise FaultSpecError(f"step delay must be in [0, 60000] ms, got {self.step_delay_ms!r}")
        if not (math.isfinite(self.error_rate) and 0 <= self.error_rate <= 1):
            raise FaultSpecError(f"error rate must be in [0, 1], got {self.error_rate!r}")

    @property
    def is_active(self) -> bool:
        return self.step_delay_ms > 0 or self.error_rate > 0

    def __str__(self) -> str:
        return f"step delay {self.step_delay_ms:g} ms, error rate {self.error_rate:g}, seed {self.seed}"


def is_fault_injection_allowed() -> bool:
    return bool(settings.DEBUG or settings.ALLOW_FAULT_INJECTION)


def check_fault_injection_allowed() -> None:
    if not is_fault_injection_allowed():
        raise FaultInjectionRefused(
            "fault injection is refused when DEBUG is off; set SWITCHYARD_ALLOW_FAULT_INJECTION=1 to allow it"
        )


_KEYS = {"delay_ms": "step_delay_ms", "error_rate": "error_rate", "seed": "seed"}


@functools.lru_cache(maxsize=8)
def parse_faults(spec: str) -> dict[tuple[str, str], Faults]:
    """`model:version=key:value,key:value;model:version=…` with keys delay_ms, error_rate, seed."""
    result: dict[tuple[str, str], Faults] = {}
    for entry in filter(None, (part.strip() for part in spec.split(";"))):
        target, sep, options = entry.partition("=")
        model_name, colon, version = target.strip().partition(":")
        if not (sep and colon and model_name and version):
            raise FaultSpecError(f"expected model:version=key:value,…, got {entry!r}")
        values: dict[str, float | int] = {}
        for option in filter(None, (o.strip() for o in options.split(","))):
            key, colon, raw = option.partition(":")
            field_name = _KEYS.get(key.strip())
            if field_name is None or not colon:
                raise FaultSpecError(f"unknown fault option {option!r}; use {', '.join(_KEYS)}")
            try:
                values[field_name] = int(raw) if field_name == "seed" else float(raw)
            except ValueError as exc:
                raise FaultSpecError(f"bad value in {option!r}") from exc
        result[(model_name, version.strip())] = Faults(**values)  # type: ignore[arg-type]
    return result


def configured_faults(model_name: str, version: str) -> Faults | None:
    """The faults SWITCHYARD_FAULTS sets for a version; raises FaultInjectionRefused when it sets any
    while injection is not allowed, FaultSpecError when it does not parse."""
    spec = settings.FAULTS
    if not spec:
        return None
    faults = parse_faults(spec).get((model_name, version))
    if faults is not None and faults.is_active:
        check_fault_injection_allowed()
    return faults


@dataclass(slots=True)
class ArmedFaults:
    """The faults a running replica applies: read by its model thread at every step and admission. Empty
    (nothing injected) until arm_faults() fills it at start."""

    step_delay_s: float = 0.0
    error_rate: float = 0.0
    rng: random.Random | None = field(default=None, repr=False)

    def fails_admission(self) -> bool:
        """Whether the request being admitted ends in an injected_fault error instead of its tokens."""
        return self.rng is not None and self.rng.random() < self.error_rate


def arm_faults(armed: ArmedFaults, faults: Faults | None, model_name: str, version: str) -> Faults | None:
    """Fill `armed` from `faults` (None: what SWITCHYARD_FAULTS sets for the version) and return the faults
    applied. Raises FaultInjectionRefused when injection is not allowed: the replica fails to start,
    saying why."""
    if faults is None:
        faults = configured_faults(model_name, version)
    if faults is None or not faults.is_active:
        return faults
    check_fault_injection_allowed()
    armed.step_delay_s = faults.step_delay_ms / 1000
    armed.error_rate = faults.error_rate
    armed.rng = random.Random(faults.seed)
    logger.warning("replica %s:%s: FAULT INJECTION on: %s", model_name, version, faults)
    return faults
