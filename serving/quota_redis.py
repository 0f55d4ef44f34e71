"""Quota counters in Redis, shared by every gateway process. One Lua script refills both buckets,
decides and charges atomically; the decision rules match serving.gateway._refusal, which then words
the refusal from the state the script returns.

The same script can also submit the admitted request to its replica's channel (`aadmit_and_send`),
when the channel layer's Redis is this one: admission and submission were two round trips in a row on
every request's time to first token, 0.7 to 0.9 ms each on a loaded 2-core machine (docs/benchmarks.md,
"Seventh machine")."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterable
from typing import Any

import redis
import redis.asyncio as aioredis
from channels.exceptions import ChannelFull

from registry.selectors import TenantContext
from serving.channel_layer import SEND_FUNCTIONS, OneTripRedisChannelLayer
from serving.gateway import (
    GatewayError,
    QuotaLimits,
    QuotaUsage,
    Ticket,
    _refusal,
    admit_then_send,
    quota_usage,
)

# admit(tenant hash, refusal counts, rps, tokens/min, max concurrent, tokens asked, idle expiry (s),
# tenant id). A refusal is counted in the same script: no second round trip per 429. Returns {admitted
# (0/1), request_tokens, token_tokens, in_flight} as strings (Lua numbers would be truncated to
# integers on the way out).
_ADMIT_FUNCTION = """
local function admit(key, refused_key, rps, tpm, max_c, tokens, ttl, tenant_id)
  rps = tonumber(rps); tpm = tonumber(tpm); max_c = tonumber(max_c)
  tokens = tonumber(tokens); ttl = tonumber(ttl)
  local t = redis.call('TIME'); local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
  local burst = math.max(1, rps)
  local s = redis.call('HMGET', key, 'rt', 'tt', 'ts', 'n')
  local rt = tonumber(s[1]) or burst; local tt = tonumber(s[2]) or tpm
  local ts = tonumber(s[3]) or now; local n = tonumber(s[4]) or 0
  local el = math.max(0, now - ts)
  rt = math.min(burst, rt + el * rps); tt = math.min(tpm, tt + el * tpm / 60)
  local ok = rps > 0 and n < max_c and rt >= 1 and tokens <= tpm and tt >= tokens
  local out_rt, out_tt, out_n = rt, tt, n
  if ok then rt = rt - 1; tt = tt - tokens; n = n + 1
  else redis.call('HINCRBY', refused_key, tenant_id, 1) end
  redis.call('HSET', key, 'rt', tostring(rt), 'tt', tostring(tt), 'ts', tostring(now), 'n', n)
  redis.call('EXPIRE', key, ttl)
  return {ok and 1 or 0, tostring(out_rt), tostring(out_tt), tostring(out_n)}
end
"""
# KEYS[1] tenant hash, KEYS[2] the refusal counts; ARGV as admit() takes them after its two keys.
_ADMIT = _ADMIT_FUNCTION + "return admit(KEYS[1], KEYS[2], unpack(ARGV))"
# The same, then KEYS[3] the replica's channel and ARGV[7..11] the send's (serving.channel_layer). A full
# channel admits nothing ({-1}); an admitted request is on its replica's channel when the reply arrives.
_ADMIT_AND_SEND = (
    _ADMIT_FUNCTION
    + SEND_FUNCTIONS
    + """
if not channel_has_room(KEYS[3], ARGV[7], ARGV[8]) then return {-1} end
local result = admit(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6])
if result[1] == 1 then channel_add(KEYS[3], ARGV[9], ARGV[10], ARGV[11]) end
return result
"""
)

_RELEASE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local n = tonumber(redis.call('HGET', KEYS[1], 'n') or '0')
if n > 0 then redis.call('HSET', KEYS[1], 'n', n - 1) end
redis.call('HINCRBYFLOAT', KEYS[1], 'tt', ARGV[1])
return 1
"""

# A gateway that dies mid-request leaves its in-flight count behind; an idle tenant's state expires.
_IDLE_EXPIRY_S = 600


def _unavailable(exc: Exception) -> GatewayError:
    return GatewayError(503, f"quota store unavailable: {type(exc).__name__}", retry_after_s=1)


class _LoopClient:
    """An asyncio Redis client and the two scripts, for one event loop (asyncio connections belong to
    the loop that opened them)."""

    def __init__(self, url: str) -> None:
        self.redis: Any = aioredis.Redis.from_url(url)
        self.admit = self.redis.register_script(_ADMIT)
        self.admit_and_send = self.redis.register_script(_ADMIT_AND_SEND)
        self.release = self.redis.register_script(_RELEASE)


class RedisQuotaStore:
    """The gateway admits with `aadmit` and `arelease`, on a client of its event loop's own, so admission
    costs one Redis round trip and no thread hop. `admit` and `release` are the same on a blocking client
    (the QuotaStore interface, for callers in threads); `usage` and `refusals` serve the dashboard."""

    def __init__(self, url: str, *, key_prefix: str = "switchyard:quota:") -> None:
        self._url = url
        self._redis = redis.Redis.from_url(url)
        self._prefix = key_prefix
        self._admit = self._redis.register_script(_ADMIT)
        self._release = self._redis.register_script(_RELEASE)
        self._refused_key = f"{key_prefix}refused"  # tenant id -> 429s, over every gateway process
        self._loop_clients: dict[asyncio.AbstractEventLoop, _LoopClient] = {}
        # Tenant id -> until when (monotonic) this process expects it to be refused: see aadmit_and_send.
        self._refusing_until: dict[int, float] = {}

    def _key(self, tenant_id: int) -> str:
        return f"{self._prefix}{tenant_id}"

    def _admit_args(self, context: TenantContext, tokens: int) -> dict[str, list[object]]:
        return {
            "keys": [self._key(context.tenant_id), self._refused_key],
            "args": [
                context.requests_per_second,
                context.tokens_per_minute,
                context.max_concurrent_requests,
                tokens,
                _IDLE_EXPIRY_S,
                context.tenant_id,
            ],
        }

    @staticmethod
    def _refusal(context: TenantContext, tokens: int, rt: bytes, tt: bytes, n: bytes) -> GatewayError:
        refusal = _refusal(
            context, request_tokens=float(rt), token_tokens=float(tt), num_in_flight=int(n), tokens=tokens
        )
        return refusal or GatewayError(429, "over quota", retry_after_s=1)

    def admit(self, context: TenantContext, *, tokens: int) -> Ticket:
        try:
            admitted, rt, tt, n = self._admit(**self._admit_args(context, tokens))
        except redis.RedisError as exc:
            raise _unavailable(exc) from exc
        if not int(admitted):
            raise self._refusal(context, tokens, rt, tt, n)
        return Ticket(uuid.uuid4().hex, context.tenant_id, tokens)

    def release(self, ticket: Ticket, *, used_tokens: int) -> None:
        # On failure the idle expiry clears the count we could not give back.
        with contextlib.suppress(redis.RedisError):
            self._release(keys=[self._key(ticket.tenant_id)], args=[ticket.charged_tokens - used_tokens])

    def _loop_client(self) -> _LoopClient:
        loop = asyncio.get_running_loop()
        client = self._loop_clients.get(loop)
        if client is None:
            for closed in [lp for lp in self._loop_clients if lp.is_closed()]:
                del self._loop_clients[closed]
            client = _LoopClient(self._url)
            self._loop_clients[loop] = client
        return client

    async def aadmit(self, context: TenantContext, *, tokens: int) -> Ticket:
        client = self._loop_client()
        try:
            admitted, rt, tt, n = await client.admit(**self._admit_args(context, tokens))
        except redis.RedisError as exc:
            raise _unavailable(exc) from exc
        if not int(admitted):
            raise self._refused(context, tokens, rt, tt, n)
        self._refusing_until.pop(context.tenant_id, None)
        return Ticket(uuid.uuid4().hex, context.tenant_id, tokens)

    def _refused(self, context: TenantContext, tokens: int, rt: bytes, tt: bytes, n: bytes) -> GatewayError:
        refusal = self._refusal(context, tokens, rt, tt, n)
        self._refusing_until[context.tenant_id] = time.monotonic() + (refusal.retry_after_s or 1.0)
        return refusal

    def sends_with_admission(self, context: TenantContext) -> bool:
        """False for a tenant this process refused a moment ago (within its Retry-After): it is likely
        refused again, and admitted alone first a flood of refusals carries no prompt to Redis and
        builds nothing else for a request that will not run."""
        return self._refusing_until.get(context.tenant_id, 0.0) <= time.monotonic()

    async def aadmit_and_send(
        self, context: TenantContext, *, tokens: int, layer: Any, channel: str, message: dict[str, Any]
    ) -> Ticket:
        """Admit, then send `message` on `layer`: in one round trip when the layer's Redis is this one,
        else admission and then the layer's own send. Raises GatewayError (a refusal: nothing is sent)
        or ChannelFull (nothing is admitted). A tenant being refused (sends_with_admission) is admitted
        alone first."""
        shares_server = isinstance(layer, OneTripRedisChannelLayer) and layer.single_address() == self._url
        if not shares_server or not self.sends_with_admission(context):
            return await admit_then_send(
                self, context, tokens=tokens, layer=layer, channel=channel, message=message
            )
        prepared = layer.prepare_send(channel, message)
        admit = self._admit_args(context, tokens)
        try:
            admitted, *state = await self._loop_client().admit_and_send(
                keys=[*admit["keys"], prepared.key], args=[*admit["args"], *prepared.args]
            )
        except redis.RedisError as exc:
            raise _unavailable(exc) from exc
        if int(admitted) == -1:
            raise ChannelFull()
        if not int(admitted):
            raise self._refused(context, tokens, *state)
        return Ticket(uuid.uuid4().hex, context.tenant_id, tokens)

    async def arelease(self, ticket: Ticket, *, used_tokens: int) -> None:
        with contextlib.suppress(redis.RedisError):
            await self._loop_client().release(
                keys=[self._key(ticket.tenant_id)], args=[ticket.charged_tokens - used_tokens]
            )

    def refusals(self) -> dict[int, int] | None:
        """429s per tenant id, counted by every gateway process (None when Redis cannot be read)."""
        try:
            raw = self._redis.hgetall(self._refused_key)
        except redis.RedisError:
            return None
        return {int(tenant_id): int(n) for tenant_id, n in raw.items()}

    def usage(self, limits: Iterable[QuotaLimits]) -> dict[int, QuotaUsage]:
        """Each tenant's usage now, over every gateway process (empty when Redis cannot be read).

        Reads the hash _ADMIT keeps and refills it in Python, writing nothing: a look must not move a
        bucket's timestamp. The clock is Redis's own TIME, as in the script, read in the same
        MULTI/EXEC as the hashes so that no admission lands between them."""
        limits = list(limits)
        try:
            with self._redis.pipeline(transaction=True) as pipe:
                pipe.time()
                for tenant in limits:
                    pipe.hmget(self._key(tenant.tenant_id), "rt", "tt", "ts", "n")
                (seconds, microseconds), *states = pipe.execute()
        except redis.RedisError:
            return {}
        now = seconds + microseconds / 1e6
        result = {}
        for tenant, (rt, tt, ts, n) in zip(limits, states, strict=True):
            result[tenant.tenant_id] = quota_usage(
                tenant,
                request_tokens=None if rt is None else float(rt),
                token_tokens=None if tt is None else float(tt),
                num_in_flight=0 if n is None else int(n),
                elapsed_s=0.0 if ts is None else now - float(ts),
            )
        return result

    def clear(self) -> None:
        for key in self._redis.scan_iter(f"{self._prefix}*"):
            self._redis.delete(key)
