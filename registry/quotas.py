"""A tenant's quota as the registry's writes take it: what a change names (QuotaChange), and the rules
each setting's value keeps (`problem`). The rules are the model's own validators (registry.models.Quota),
checked after the value's type, with one more: a whole number fits the database's integer column, on
SQLite as on Postgres. The services (quota_set, tenant_create) and the admin's quota form apply them, so
every path refuses the same values."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from django.core.exceptions import ValidationError
from django.db import models

from registry.models import Model, Quota, ServiceTier, is_valid_name

MAX_INT = 2**31 - 1  # the database's integer columns

# The settings of a quota other than its model lists, in the order listings show them.
SETTINGS = (
    "requests_per_second",
    "tokens_per_minute",
    "max_concurrent_requests",
    "may_pin",
    "may_deploy",
    "max_service_tier",
    "ttft_objective_ms",
    "tpot_objective_ms",
    "max_running_sequences",
    "kv_share",
)
# Those that may be empty (None): no objective, or no cap of the tenant's own (a replica then applies
# SWITCHYARD_MAX_RUNNING_PER_TENANT / SWITCHYARD_MAX_KV_SHARE_PER_TENANT, if set).
OPTIONAL = frozenset(name for name in SETTINGS if Quota._meta.get_field(name).null)

_WHAT = {
    "requests_per_second": "a number from 0",
    "tokens_per_minute": f"a whole number from 0 to {MAX_INT}",
    "max_concurrent_requests": f"a whole number from 0 to {MAX_INT}",
    "may_pin": "true or false",
    "may_deploy": "true or false",
    "max_service_tier": f"one of {', '.join(ServiceTier.values)}",
    "ttft_objective_ms": f"a whole number of milliseconds from 1 to {MAX_INT}, or none",
    "tpot_objective_ms": f"a whole number of milliseconds from 1 to {MAX_INT}, or none",
    "max_running_sequences": f"a whole number from 1 to {MAX_INT}, or none",
    "kv_share": "a share from 0.01 to 1, or none",
}


def _typed(field: models.Field, value: Any) -> bool:
    """Whether the value is of the field's kind (a bool is no number, a number in a string no number)."""
    if isinstance(field, models.BooleanField):
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if isinstance(field, models.IntegerField):
        return isinstance(value, int) and value <= MAX_INT
    if isinstance(field, models.FloatField):
        return isinstance(value, int | float) and math.isfinite(value)
    return isinstance(value, str)


def problem(name: str, value: Any) -> str | None:
    """Why `value` cannot be the quota's setting `name`, in one line; None when it can."""
    field = Quota._meta.get_field(name)
    if value is None and name in OPTIONAL:
        return None
    if value is None:
        return f"{name} cannot be empty: it must be {_WHAT[name]}"
    try:
        if not _typed(field, value):
            raise ValidationError("wrong type")
        field.clean(value, None)  # the model's validators and choices
    except ValidationError:
        return f"{name} must be {_WHAT[name]}, got {value!r}"
    return None


def first_problem(values: Mapping[str, Any]) -> str | None:
    """The first of these settings' problems, in SETTINGS' order; None when every value may be stored."""
    for name in SETTINGS:
        if name in values and (found := problem(name, values[name])) is not None:
            return found
    return None


def models_named(names: list[str]) -> tuple[Model, ...]:
    """The models a quota's list names, each once and in the order named; LookupError naming those that
    do not exist (the API answers it 400, the commands print it)."""
    found = {m.name: m for m in Model.objects.filter(name__in=[n for n in names if is_valid_name(n)])}
    missing = sorted(set(names) - set(found))
    if missing:
        raise LookupError(f"unknown model(s): {', '.join(missing)}")
    return tuple(found[name] for name in dict.fromkeys(names))


class _Keep(enum.Enum):
    KEEP = "keep"


KEEP = _Keep.KEEP


@dataclass(frozen=True, slots=True)
class QuotaChange:
    """What to change of a tenant's quota. KEEP (the default) leaves a field as it is; None empties one
    that may be empty (OPTIONAL: an objective, a cap inside each replica) and is refused for the others.
    A model list replaces the one there; an empty one empties it."""

    requests_per_second: float | _Keep = KEEP
    tokens_per_minute: int | _Keep = KEEP
    max_concurrent_requests: int | _Keep = KEEP
    may_pin: bool | _Keep = KEEP
    may_deploy: bool | _Keep = KEEP
    max_service_tier: str | _Keep = KEEP
    ttft_objective_ms: int | _Keep | None = KEEP
    tpot_objective_ms: int | _Keep | None = KEEP
    max_running_sequences: int | _Keep | None = KEEP
    kv_share: float | _Keep | None = KEEP
    allowed_models: tuple[Model, ...] | _Keep = KEEP
    deployable_models: tuple[Model, ...] | _Keep = KEEP

    def settings(self) -> dict[str, Any]:
        """The settings it changes (not the model lists), with their new values."""
        given = {f.name: getattr(self, f.name) for f in fields(self) if f.name in SETTINGS}
        return {name: value for name, value in given.items() if value is not KEEP}

    def problem(self) -> str | None:
        """Why it cannot be made, in one line; None when it can."""
        for name in ("allowed_models", "deployable_models"):
            value = getattr(self, name)
            if value is not KEEP and not isinstance(value, tuple | list):
                return f"{name} must be a list of models (empty for none), got {value!r}"
        return first_problem(self.settings())
