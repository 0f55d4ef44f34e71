"""The flags `create_tenant` and `set_quota` share for a quota's service tier, latency objectives and caps
inside each replica. A flag left out is not in the command's options (argparse.SUPPRESS): the service
then applies its default (create_tenant) or keeps the setting (set_quota). `none` empties an objective or
a cap; registry.quotas checks every value, so a command refuses what the API and the admin refuse."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from django.core.management.base import CommandParser

from registry.models import ServiceTier


def _or_none(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        return None if text.strip().lower() == "none" else kind(text)

    parse.__name__ = kind.__name__  # argparse names it in "invalid int value: 'x'"
    return parse


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
