"""Failed sign-ins counted over every process of a deployment, in Redis (docs/reliability.md, "Failed
sign-ins").

Each process still decides from its own memory (registry/auth_throttle.py), so that an attempt costs no
Redis round trip: only a failure does. A process that counts a failure adds it here and takes back the
fleet's latest failures under each of the attempt's keys, which then replace its own. So once the fleet
as a whole has seen the limit, every process refuses from its next failure under that key on: N gateways
let through the limit plus at most one attempt each, where counting alone they let N times the limit.

One sorted set per key (member: a unique id, score: when, on Redis's own clock, so that hosts need not
agree on the time), kept for the window and trimmed as it is written."""

from __future__ import annotations

import logging
import time
import uuid

import redis

logger = logging.getLogger(__name__)

KEY_PREFIX = "switchyard:auth-failures:"
# KEYS: the attempt's keys. ARGV: window (s), limit, a unique member. Returns Redis's time and, per key,
# the scores of its newest `limit` failures, oldest first.
RECORD_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local window, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
local result = {tostring(now)}
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, now, ARGV[3] .. ':' .. i)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
  redis.call('EXPIRE', key, math.ceil(window) + 1)
  result[#result + 1] = redis.call('ZRANGE', key, -limit, -1, 'WITHSCORES')
end
return result
"""
# A failure must not hang an attempt's answer on a Redis that does not answer: it is counted here only.
SOCKET_TIMEOUT_S = 0.5


class SharedFailures:
    def __init__(self, url: str, *, clock=time.monotonic) -> None:  # type: ignore[no-untyped-def]
        self._redis = redis.Redis.from_url(url, socket_timeout=SOCKET_TIMEOUT_S)
        self._record = self._redis.register_script(RECORD_SCRIPT)
        self._clock = clock

    def record(self, keys: tuple[str, ...], *, window_s: float, limit: int) -> dict[str, list[float]] | None:
        """Count one failure under each key; the fleet's newest `limit` failures under each, as times on
        this process's clock (`clock`), oldest first. None when Redis cannot be reached: the caller
        counts the failure itself."""
        try:
            now_local = self._clock()
            raw = self._record(
                keys=[KEY_PREFIX + key for key in keys], args=[window_s, max(1, limit), uuid.uuid4().hex]
            )
        except redis.RedisError as exc:
            logger.warning("failed sign-ins: Redis unreachable (%r); counted in this process only", exc)
            return None
        redis_now = float(raw[0])
        return {
            key: [now_local - (redis_now - float(score)) for score in scores[1::2]]
            for key, scores in zip(keys, raw[1:], strict=True)
        }

    def clear(self) -> None:
        try:
            for key in self._redis.scan_iter(f"{KEY_PREFIX}*"):
                self._redis.delete(key)
        except redis.RedisError as exc:
            logger.warning("failed sign-ins: Redis unreachable (%r); not cleared", exc)
