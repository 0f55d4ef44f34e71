"""Serving's read API for the other apps: the only door through which rollouts/ and dashboard/ read the
data plane's state (docs/architecture.md, "Import rules").

Metric windows come from the metrics store; replicas from this process's runtime (embedded mode) and,
with Redis, from the heartbeats every replica process publishes; demand from the hash gateways write
when a request waits for a version with no replica; quota usage from the gateway's quota store. The
readers for other threads (the judge's, the autoscaler's) only read the runtimes' state and never touch
their event loops. One write goes back the same way: the autoscaler's answer to that demand, the pinned
versions it declined (publish_pin_declines)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import redis
from django.conf import settings

from serving import runtime
from serving.gateway.data_plane import ReplicaHandle
from serving.gateway.quota import QuotaLimits, QuotaUsage
from serving.gateway.quota_memory import MemoryQuotaStore
from serving.gateway.quota_store import quota_store
from serving.telemetry.metric_window import WINDOW_S, floor_time
from serving.telemetry.metrics_reads import VersionWindow, version_series, version_window, version_windows
from serving.telemetry.shadow_pairs import pairs_of as shadow_diff_pairs
from serving.transport.replica_directory import (
    DEMAND_KEY,
    KEY_PREFIX,
    PIN_DECLINES_KEY,
    Heartbeat,
    read_beats,
    version_key,
)

logger = logging.getLogger(__name__)

__all__ = [
    "WINDOW_S",
    "Heartbeat",
    "HeartbeatsUnavailable",
    "QuotaUsage",
    "ReplicaHandle",
    "VersionWindow",
    "embedded_replica_ready",
    "fleet_demand",
    "fleet_heartbeats",
    "fleet_replica_ready",
    "fleet_replicas",
    "floor_time",
    "local_replicas",
    "quota_counted_by",
    "quota_refusals",
    "quota_usage",
    "shadow_diff_pairs",
    "version_series",
    "version_window",
    "version_windows",
]


class HeartbeatsUnavailable(Exception):
    """Replica heartbeats or gateway demand could not be read (Redis down): no heartbeats would look like
    no load, so the caller skips its tick rather than act on nothing."""


def _fleet_redis() -> redis.Redis:
    """A client for the hashes the fleet writes in Redis (heartbeats, gateway demand), for the judge's and
    the autoscaler's ticks: a second to connect or answer, so that a tick holds rather than hangs."""
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1.0, socket_connect_timeout=1.0)


# --- replicas ------------------------------------------------------------------------------------------


async def fleet_replicas() -> list[ReplicaHandle]:
    """Every replica this process knows: its own (embedded mode) and, with Redis, fresh heartbeats.
    Raises what the replica directory's read raises (Redis unreachable)."""
    return await (await runtime.get_runtime()).all_replicas()


def local_replicas() -> list[ReplicaHandle]:
    """This loop's own replicas, draining ones included; none when its runtime has not started (Redis
    down at its start)."""
    started = runtime.started_runtime()
    return started.local_replicas() if started is not None else []


def fleet_heartbeats() -> list[Heartbeat]:
    """The latest heartbeat of every replica that sends one: those this process hosts (embedded mode),
    and with Redis the hashes every replica process writes. Raises HeartbeatsUnavailable when Redis
    cannot be read."""
    beats = {
        replica.replica_id: replica.heartbeat()
        for rt in runtime.live_runtimes()
        for replica in list(rt.replicas.values())
    }
    if not settings.REDIS_URL:
        return list(beats.values())
    client = _fleet_redis()
    try:
        keys = [key.decode() for key in client.scan_iter(f"{KEY_PREFIX}*")]
        for beat in read_beats(client, keys):  # on this host's clock, whatever Redis's says
            beats.setdefault(beat.replica_id, beat)
    except redis.RedisError as exc:
        raise HeartbeatsUnavailable(f"replica heartbeats unreadable ({exc})") from exc
    finally:
        client.close()
    return list(beats.values())


def fleet_demand() -> dict[tuple[str, str], float]:
    """(model, version) -> seconds since a request last waited at a gateway for a replica of a version
    that had none, on Redis' clock; empty without Redis. Raises HeartbeatsUnavailable when Redis cannot
    be read: no demand would let a waiting request's version stay at zero."""
    if not settings.REDIS_URL:
        return {}
    client = _fleet_redis()
    try:
        raw = client.hgetall(DEMAND_KEY)
        seconds, micros = client.time()
    except redis.RedisError as exc:
        raise HeartbeatsUnavailable(f"gateway demand unreadable ({exc})") from exc
    finally:
        client.close()
    demand: dict[tuple[str, str], float] = {}
    for field, value in raw.items():
        model_name, _, version = field.decode().partition(":")
        try:
            demand[(model_name, version)] = max(0.0, seconds + micros / 1e6 - float(value))
        except ValueError:
            logger.warning("skipping gateway demand %r for %s", value, field)
    return demand


# Ticks the autoscaler's declines outlive the tick that wrote them: a stopped autoscaler's last word fades.
PIN_DECLINES_TICKS_KEPT = 3


def publish_pin_declines(declines: Mapping[tuple[str, str], str]) -> None:
    """The autoscaler's word back to the gateways: the versions pinned requests wait for that get no replica
    this tick, (model, version) -> why (docs/architecture.md, "Replicas kept warm"). A gateway reads it
    where it records its demand (ReplicaDirectory.record_demand, one call) and answers the waiting
    requests at once with a 503 saying why, where they waited out COLD_START_TIMEOUT_S for a replica
    nobody would start. One hash rewritten whole each tick, so a version given room later is declined no
    more. Nothing without Redis (embedded, the supervisor starts pinned versions itself); a Redis error
    is logged, not raised (the tick's targets are stored, and the requests wait to their timeout)."""
    if not settings.REDIS_URL:
        return
    client = _fleet_redis()
    try:
        pipe = client.pipeline(transaction=True)
        pipe.delete(PIN_DECLINES_KEY)
        if declines:
            pipe.hset(PIN_DECLINES_KEY, mapping={f"{m}:{v}": why for (m, v), why in declines.items()})
            ttl_s = max(1, round(PIN_DECLINES_TICKS_KEPT * settings.AUTOSCALER_INTERVAL_S))
            pipe.expire(PIN_DECLINES_KEY, ttl_s)
        pipe.execute()
    except redis.RedisError:
        logger.warning("autoscaler: the pinned versions it declined are not published", exc_info=True)
    finally:
        client.close()


def embedded_replica_ready(model_name: str, version: str) -> bool | None:
    """Is a replica of (model, version) that this process hosts ready? None when this process hosts no
    replicas (no live runtime, or replicas run as processes)."""
    if not settings.EMBEDDED_REPLICAS:
        return None
    runtimes = runtime.live_runtimes()
    if not runtimes:
        return None
    for rt in runtimes:
        replica = rt.replicas.get((model_name, version))
        if replica is not None and replica.is_ready:
            return True
    return False


def fleet_replica_ready(model_name: str, candidate: str, incumbent: str) -> bool | None:
    """Does a replica process of the candidate publish a fresh `ready` heartbeat? None without Redis,
    when it cannot be read, or when it has no fresh heartbeat of the candidate nor of the incumbent
    (then this model is not served by processes that publish heartbeats, and their absence says
    nothing)."""
    if not settings.REDIS_URL:
        return None
    client = _fleet_redis()

    def beats(version: str) -> list[Heartbeat]:
        return read_beats(client, [version_key(model_name, version)])

    try:
        fresh = [beat for beat in beats(candidate) if beat.is_fresh]
        if fresh:
            return any(beat.is_ready for beat in fresh)
        if any(beat.is_fresh for beat in beats(incumbent)):
            return False
        return None
    except (redis.RedisError, ValueError, TypeError) as exc:
        logger.warning("readiness of %s:%s: replica heartbeats unreadable (%s)", model_name, candidate, exc)
        return None
    finally:
        client.close()


# --- quota ---------------------------------------------------------------------------------------------


def quota_usage(limits: list[QuotaLimits]) -> dict[int, QuotaUsage]:
    """Each tenant's counters now (by tenant id), as the next admission would see them."""
    return quota_store().usage(limits)


def quota_refusals() -> dict[int, int] | None:
    """429s by tenant id; None when the store cannot be read now."""
    return quota_store().refusals()


def quota_counted_by() -> str:
    """Whose requests the usage counts: this process's, or every gateway's."""
    return "this server process" if isinstance(quota_store(), MemoryQuotaStore) else "every gateway (Redis)"
