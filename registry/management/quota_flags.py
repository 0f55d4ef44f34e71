"""The flags `create_tenant` and `set_quota` share for a quota's limits, rights (may pin, may deploy, the
models it may use and roll out, its service tier), latency objectives and caps inside each replica. A flag
left out is not in the command's options (argparse.SUPPRESS): the service then applies its default
(create_tenant) or keeps the setting (set_quota, create_tenant --update). `none` empties an objective, a
cap or a model list; registry.quotas checks every value, so a command refuses what the API and the admin
refuse, and both commands amend through the one service the API's PATCH uses (services.quota_set)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from django.core.management.base import CommandError, CommandParser

from registry.models import Model, Quota, ServiceTier, Tenant, is_valid_name
from registry.quotas import SETTINGS, QuotaChange, models_named
from registry.services import RegistryError, quota_set


def _or_none(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        return None if text.strip().lower() == "none" else kind(text)

    parse.__name__ = kind.__name__  # argparse names it in "invalid int value: 'x'"
    return parse


def add_limit_flags(parser: CommandParser) -> None:
    """Its rate limits and its rights to pin and to deploy."""
    kept = argparse.SUPPRESS
    parser.add_argument("--requests-per-second", type=float, default=kept, help="made with 10")
    parser.add_argument("--tokens-per-minute", type=int, default=kept, help="made with 100000")
    parser.add_argument(
        "--max-concurrent", dest="max_concurrent_requests", type=int, default=kept, help="made with 16"
    )
    parser.add_argument(
        "--may-pin", action=argparse.BooleanOptionalAction, default=kept, help="pin a version (X-Version-Pin)"
    )
    parser.add_argument(
        "--may-deploy",
        action=argparse.BooleanOptionalAction,
        default=kept,
        help="roll out its own models (Model.owner), and the platform's --deploy-model grants it",
    )


def add_model_flags(parser: CommandParser) -> None:
    """The models it may use and roll out: named, a list replaces the one there; `none` alone empties it."""
    parser.add_argument(
        "--allow-model",
        dest="allowed_models",
        action="append",
        default=argparse.SUPPRESS,
        metavar="MODEL",
        help="repeat; none named: every model but other tenants' own (a named one may be another's: shared)",
    )
    parser.add_argument(
        "--deploy-model",
        dest="deployable_models",
        action="append",
        default=argparse.SUPPRESS,
        metavar="MODEL",
        help="repeat; a platform model it may roll out too (with --may-deploy): its traffic is every "
        "tenant's it serves",
    )


def add_policy_flags(parser: CommandParser) -> None:
    def flag(name: str, kind: Callable[[str], Any], metavar: str, help: str) -> None:
        parser.add_argument(name, type=kind, metavar=metavar, default=argparse.SUPPRESS, help=help)

    flag(
        "--max-service-tier",
        str,
        "TIER",
        f"the highest service_tier its requests may ask for: {', '.join(ServiceTier.values)} (made with "
        "default)",
    )
    flag(
        "--ttft-objective-ms",
        _or_none(int),
        "MS",
        "its p99 time-to-first-token objective (none: no objective)",
    )
    flag(
        "--tpot-objective-ms", _or_none(int), "MS", "its time-per-output-token objective (none: no objective)"
    )
    flag(
        "--max-running-sequences",
        _or_none(int),
        "N",
        "the most of its sequences one replica runs at once (none: the replica's "
        "SWITCHYARD_MAX_RUNNING_PER_TENANT, if set)",
    )
    flag(
        "--kv-share",
        _or_none(float),
        "SHARE",
        "the share (0.01-1) of a replica's KV-cache blocks its sequences may hold (none: the replica's "
        "SWITCHYARD_MAX_KV_SHARE_PER_TENANT, if set)",
    )


POLICY = (
    "max_service_tier",
    "ttft_objective_ms",
    "tpot_objective_ms",
    "max_running_sequences",
    "kv_share",
)


def given_settings(options: dict[str, Any], names: tuple[str, ...] = POLICY) -> dict[str, Any]:
    """Those of these quota settings (default: the ones add_policy_flags adds) the command line named,
    with their values."""
    return {name: options[name] for name in names if name in options}


def named_models(options: dict[str, Any]) -> dict[str, tuple[Model, ...]]:
    """The model lists the command line named, resolved (`none` alone: an empty list)."""
    lists: dict[str, tuple[Model, ...]] = {}
    for name in ("allowed_models", "deployable_models"):
        if name in options:
            names = [str(n) for n in options[name]]
            try:
                lists[name] = () if names == ["none"] else models_named(names)
            except LookupError as exc:
                raise CommandError(str(exc)) from None
    return lists


def amend_tenant(name: str, options: dict[str, Any], *, actor: str) -> str:
    """Change what the command line named of an existing tenant's quota and rights, the others kept;
    returns the line that shows the result."""
    tenant = Tenant.objects.filter(name=name).first() if is_valid_name(name) else None
    if tenant is None:
        raise CommandError(f"unknown tenant {name!r}")
    named: dict[str, Any] = {**given_settings(options, SETTINGS), **named_models(options)}
    if not named:
        raise CommandError("nothing to change: name a setting to change (see --help)")
    try:
        quota = quota_set(tenant=tenant, change=QuotaChange(**named), actor=actor)
    except RegistryError as exc:
        raise CommandError(str(exc)) from None
    return f"quota of {tenant.name}: {shown(quota)}"


def shown(quota: Quota) -> str:
    """A quota's settings and model lists, on one line."""
    settings = [f"{field}={getattr(quota, field)}" for field in SETTINGS]
    lists = [
        f"{field}=[{','.join(sorted(m.name for m in getattr(quota, field).all()))}]"
        for field in ("allowed_models", "deployable_models")
    ]
    return ", ".join([*settings, *lists])
