"""A tenant's token bucket in the Redis quota store, read as a ledger of what the quota charged
(docs/reliability.md, "Redis and Postgres faults": no usage lost or counted twice).

Admission refills the bucket (tokens/min over 60 s, on Redis's clock) and draws the request's estimate;
release gives back the estimate less the tokens the request used (serving/gateway/quota_scripts.py). So
while the bucket stays below full, its level is linear in what was used:

    level now = level at the start + rate * (last admission's time - start) - tokens used,

where a request whose release never landed counts its whole estimate, and one released twice gives
back its excess twice. The ledger starts the bucket low enough that it cannot refill to full (and so
lose refill to the cap) within a minute, and reads back the tokens charged, to within the 0.1 ms to which
the script stores its clock (a tenth of a token at 1,000 tokens/s)."""

from __future__ import annotations

import redis

# The hash the store keeps per tenant (serving/gateway/quota_redis.py, RedisQuotaStore's default prefix).
KEY_PREFIX = "switchyard:quota:"
TOKENS_PER_MINUTE = 60_000  # 1,000 tokens/s of refill
START_LEVEL = 2_000.0  # a request's estimate fits; full again only after 58 s


class QuotaLedger:
    def __init__(self, redis_url: str, tenant_id: int) -> None:
        self._redis = redis.Redis.from_url(redis_url)
        self._key = f"{KEY_PREFIX}{tenant_id}"
        self._started_at = 0.0

    def start(self) -> None:
        """Set the tenant's token bucket to START_LEVEL now (no request of the tenant may be in flight)."""
        seconds, microseconds = self._redis.time()
        self._started_at = seconds + microseconds / 1e6
        self._redis.delete(self._key)
        self._redis.hset(self._key, mapping={"tt": repr(START_LEVEL), "ts": repr(self._started_at)})

    def tokens_charged(self) -> float:
        """The tokens the quota has charged the tenant since start(); fails if the bucket could have
        refilled to full meanwhile (the test ran too long for the ledger to be exact)."""
        level, last_admission = (float(v) for v in self._redis.hmget(self._key, "tt", "ts"))  # type: ignore[arg-type]
        refill = (last_admission - self._started_at) * TOKENS_PER_MINUTE / 60
        assert START_LEVEL + refill < TOKENS_PER_MINUTE, "the bucket may have refilled to full: not exact"
        return START_LEVEL + refill - level
