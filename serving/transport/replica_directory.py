"""Which replicas exist and how loaded they are, for gateways in other processes.

Each replica process publishes a heartbeat every HEARTBEAT_INTERVAL_S into one Redis hash per model
version (field: replica id, value: its state and load). Gateways read the hash, cache it for a quarter
of a second (routing takes a cache up to a second old and refreshes it in the background), and treat a
replica whose last beat is older than STALE_AFTER_S as gone. In the embedded default there is no Redis:
the runtime knows its in-process replicas directly.

A beat's age is read on one clock, Redis's: the publishing script stamps `sent_at` with Redis's TIME,
and a reader turns it into its own clock with the offset it reads beside the hash. Stamped by the
replica's host and read against the gateway's, a skew of a second between two hosts (STALE_AFTER_S is
1.5 s) flapped a replica's readiness, or kept a dead one routable."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import math
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from serving.transport.protocol import STALE_AFTER_S

logger = logging.getLogger(__name__)

_FORGET_AFTER_S = 60.0
_CACHE_S = 0.25
# Routing may use a cache this old while a background read refreshes it: a replica's load figures are a
# heartbeat old anyway, and one that stopped is caught by its heartbeat's age (is_ready) or by the
# circuit breaker.
_SERVE_STALE_S = 1.0
# A beat older than the stale limit plus the cache's age was missed, not merely read from a cache: the
# runtime opens the replica's circuit breaker on it (serving/gateway/breaker.py).
MISSED_AFTER_S = STALE_AFTER_S + _SERVE_STALE_S
# How long after a replica's beat says it is draining a gateway may still send it requests: from a
# directory cache up to _SERVE_STALE_S old, or a read of it that was under way. A replica process leaving
# (SIGTERM) keeps admitting for this long, so that they are served rather than refused and retried.
ROUTED_AFTER_LEAVING_S = _SERVE_STALE_S + 2 * _CACHE_S
# A heartbeat's step_s is the mean over this many seconds of steps: the autoscaler's tick (5 s) sees
# each step once, and one long prefill does not swing it.
STEP_WINDOW_S = 5.0
# The soonest seat ends a beat carries (Heartbeat.latest_ends_in_steps): more seats than a request is
# short of in any but a far-overloaded batch, whose requests the forecast refuses on its rate anyway.
SEAT_ENDS_REPORTED = 16
MIN_STEP_SPAN_S = 1.0
KEY_PREFIX = "switchyard:replicas:"
# A replica's states (serving.replica.replica.ReplicaState) in which it serves nothing any more. Any other
# counts
# as alive, so that a state a newer replica adds (a rolling upgrade) does not fail its requests.
TERMINAL_STATES = frozenset({"failed", "stopped"})
# One hash: "model:version" -> when a request last waited for a replica of a version that had none
# (scaled to zero), in seconds on Redis' own clock (TIME), which the autoscaler compares with the same
# clock. It reads the entry as a request to that version.
DEMAND_KEY = "switchyard:demand"
# The versions the autoscaler declined to start a replica for, (model:version) -> why (serving/
# selectors.py, publish_pin_declines): read where a gateway records its demand, in the same call.
PIN_DECLINES_KEY = "switchyard:pin-declines"
# KEYS: the demand hash, the declines hash; ARGV[1] model:version. Records the demand on Redis's clock and
# returns why the version was declined (nil: it was not).
RECORD_DEMAND_SCRIPT = """
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], ARGV[1], t[1])
return redis.call('HGET', KEYS[2], ARGV[1])
"""
# KEYS[1] the version's hash; ARGV: replica id, the beat's JSON. Its sent_at becomes Redis's TIME.
PUBLISH_BEAT_SCRIPT = """
local t = redis.call('TIME')
local beat = cjson.decode(ARGV[2])
beat['sent_at'] = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(beat))
"""


def version_key(model_name: str, version: str) -> str:
    return f"{KEY_PREFIX}{model_name}:{version}"


@dataclass(frozen=True, slots=True)
class Heartbeat:
    replica_id: str
    model_name: str
    version: str
    channel_name: str
    state: str
    num_waiting: int
    num_running: int
    kv_cache_usage: float
    sent_at: float  # wall clock: Redis's once published, the reader's own once read (module docstring)
    capacity: int = 0  # the most sequences (or batch items) it runs at once; 0: not known (older replicas)
    is_generative: bool = True  # False: an encoder, whose queue is inputs waiting for a batch
    # Seconds since its last submission (or since it became ready), on its own clock, so that no host's
    # clock need agree with another's: how long the version has been idle, for scaling to zero. An older
    # replica does not say, and 0 is never taken for idle.
    idle_s: float = 0.0
    # Its steps' mean time over the last few seconds (0: none ran) and how many it ran a second of wall
    # time (RecentSteps), and a step's time with one sequence decoding (0: not known): the autoscaler's
    # step-time signal. An older replica says none of them.
    step_s: float = 0.0
    step_rate: float = 0.0
    base_step_s: float = 0.0
    # The prompt tokens its waiting and running sequences have yet to prefill, and the prompt tokens it
    # prefilled a second of its prefilling steps' time over the same window as step_s (the last known
    # rate when none ran in it; 0: never measured): the gateway's TTFT forecast
    # (serving/gateway/ttft_forecast.py). An older replica says neither.
    queued_prompt_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    # The sequences its steps ended a second of their time, over the same window (the last known rate
    # when none ran; 0: none ended yet): how fast seats free in a full batch, the forecast's seat wait.
    seats_freed_per_s: float = 0.0
    # LoRA adapters resident in its engine, of the versions it serves on its base ("Adapters on a shared
    # base"); an older replica says none.
    num_adapters: int = 0
    # When its batch frees seats at the latest: the steps within which its decoding sequences must end
    # (each one's max_tokens less the tokens made), the soonest SEAT_ENDS_REPORTED ascending, and the
    # seconds since its last step ended when the beat was made. With step_s, the forecast's bound on a
    # seat wait; an older replica says neither.
    latest_ends_in_steps: tuple[int, ...] = ()
    since_step_s: float = 0.0

    @classmethod
    def from_json(cls, raw: str | bytes) -> Heartbeat:
        """A beat as a replica wrote it. Fields this code does not know (a newer replica's, during a
        rolling upgrade) are left out rather than refused. Raises ValueError for anything else that is
        not a beat: not a JSON object, a field missing or of the wrong type."""
        values = json.loads(raw)
        if not isinstance(values, dict):
            raise ValueError("a heartbeat is a JSON object")
        try:
            beat = cls(**{k: v for k, v in values.items() if k in _HEARTBEAT_FIELDS})
        except TypeError as exc:
            raise ValueError(f"not a heartbeat: {exc}") from None
        # A JSON list, checked here and kept as a tuple; an empty one comes back from the publishing
        # script as {} (Lua's cjson writes an empty table as an object).
        ends: object = beat.latest_ends_in_steps
        ends = () if ends == {} else ends
        if not isinstance(ends, list | tuple) or not all(
            isinstance(end, int) and not isinstance(end, bool) and end >= 0 for end in ends
        ):
            raise ValueError(f"heartbeat field latest_ends_in_steps is {ends!r}")
        beat = dataclasses.replace(beat, latest_ends_in_steps=tuple(ends))
        for name, kinds in _HEARTBEAT_TYPES.items():
            value = getattr(beat, name)
            if (
                (isinstance(value, bool) and kinds != (bool,))
                or not isinstance(value, kinds)
                or (isinstance(value, float) and not math.isfinite(value))  # JSON's NaN and Infinity
            ):
                raise ValueError(f"heartbeat field {name} is {value!r}")
        return beat

    @property
    def load(self) -> int:
        return self.num_waiting + self.num_running

    @property
    def is_fresh(self) -> bool:
        return time.time() - self.sent_at < STALE_AFTER_S

    @property
    def has_missed_beats(self) -> bool:
        return time.time() - self.sent_at >= MISSED_AFTER_S

    @property
    def is_ready(self) -> bool:
        return self.state == "ready" and self.is_fresh

    @property
    def is_alive(self) -> bool:
        """Whether the requests it holds may still end: a replica that has failed (its engine thread
        died) goes on beating to say so, and its requests must fail over at once, not time out."""
        return self.state not in TERMINAL_STATES and self.is_fresh


_HEARTBEAT_FIELDS = frozenset(f.name for f in dataclasses.fields(Heartbeat))
_HEARTBEAT_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("replica_id", "model_name", "version", "channel_name", "state"), (str,)),
    **dict.fromkeys(
        ("num_waiting", "num_running", "capacity", "queued_prompt_tokens", "num_adapters"), (int,)
    ),
    **dict.fromkeys(
        (
            "kv_cache_usage",
            "sent_at",
            "idle_s",
            "step_s",
            "step_rate",
            "base_step_s",
            "prefill_tokens_per_s",
            "seats_freed_per_s",
            "since_step_s",
        ),
        (int, float),
    ),
    "is_generative": (bool,),
}


class StepTimes(NamedTuple):
    mean_s: float  # the steps' mean time; 0: none lately
    per_s: float  # steps per second of wall time: with mean_s, the share of it the replica was stepping


class RecentSteps:
    """A replica's latest steps, for its heartbeat: those that ended within `window_s` of the newest,
    over the wall time from then (or from `since`, when it became ready, if later) until now, or until
    the step running now began. So a replica that ran one long prefill and then idled reads as idle, not
    as busy with long steps. A step still running after a whole window counts as the replica busy. The
    model thread calls begin() and add(); another thread reads, and each call publishes one value, so a
    read never sees a sum without its count."""

    def __init__(self, window_s: float = STEP_WINDOW_S, *, since: float = -math.inf) -> None:
        self.window_s = window_s
        self.since = since
        self._steps: deque[tuple[float, float]] = deque()  # (ended at, seconds), the adding thread's
        self._total = 0.0
        self._summary = (0.0, 0, -math.inf)  # total, count, newest's end
        self._running_since: float | None = None

    def begin(self, at: float) -> None:
        self._running_since = at

    def cancel(self) -> None:
        """The step begun did not end (it failed): nothing is running."""
        self._running_since = None

    def add(self, ended_at: float, seconds: float) -> None:
        self._steps.append((ended_at, seconds))
        self._total += seconds
        while self._steps[0][0] < ended_at - self.window_s:
            self._total -= self._steps.popleft()[1]
        self._summary = (self._total, len(self._steps), ended_at)
        self._running_since = None

    def read(self, now: float) -> StepTimes:
        running_since = self._running_since
        if running_since is not None and now - running_since >= self.window_s:
            return StepTimes(now - running_since, 1 / (now - running_since))
        total, count, newest = self._summary
        if not count or now - newest > self.window_s:
            return StepTimes(0.0, 0.0)
        # Up to the start of a step still running (its time so far is neither idle nor counted yet), and
        # at least the steps' own time (the oldest began a little before the window did) and a second: a
        # replica just ready that ran one long prefill is not read as busy from a tenth of a second.
        end = now if running_since is None else running_since
        span = max(end - max(newest - self.window_s, self.since), total, MIN_STEP_SPAN_S)
        return StepTimes(total / count, count / span)


def clock_offset(redis_time: Sequence[int], asked_at: float, answered_at: float) -> float:
    """Redis's clock (TIME's seconds and microseconds) less this process's, halfway through the round
    trip that read it: within a millisecond or so here, where a beat's age is judged in seconds."""
    seconds, micros = redis_time
    return seconds + micros / 1e6 - (asked_at + answered_at) / 2


def parse_beats(raw: Mapping[Any, Any], offset: float, *, where: str) -> list[tuple[Any, Heartbeat]]:
    """A version hash's entries as (field, beat), sent_at turned from Redis's clock to this process's
    (`offset`: clock_offset). An entry that is not a beat is logged and left out: one bad entry must not
    hide the version's other replicas."""
    beats = []
    for field, value in raw.items():
        try:
            beat = Heartbeat.from_json(value)
        except ValueError as exc:
            logger.warning("replica directory: skipping %s in %s: %s", field, where, exc)
            continue
        beats.append((field, dataclasses.replace(beat, sent_at=beat.sent_at - offset)))
    return beats


def read_beats(client: Any, keys: Sequence[str]) -> list[Heartbeat]:
    """The beats in these version hashes, on this process's clock, from a blocking redis-py client (the
    control plane's loops): TIME and every HGETALL in one round trip."""
    asked_at = time.time()
    pipe = client.pipeline(transaction=False)
    pipe.time()
    for key in keys:
        pipe.hgetall(key)
    redis_time, *hashes = pipe.execute()
    offset = clock_offset(redis_time, asked_at, time.time())
    return [
        beat for key, raw in zip(keys, hashes, strict=True) for _, beat in parse_beats(raw, offset, where=key)
    ]


class HeartbeatPublisher:
    def __init__(self, redis_url: str) -> None:
        import redis.asyncio as aioredis

        self._redis: Any = aioredis.Redis.from_url(redis_url)
        self._publish = self._redis.register_script(PUBLISH_BEAT_SCRIPT)

    async def publish(self, beat: Heartbeat) -> None:
        key = version_key(beat.model_name, beat.version)
        await self._publish(keys=[key], args=[beat.replica_id, json.dumps(asdict(beat))])

    async def withdraw(self, beat: Heartbeat) -> None:
        await self._redis.hdel(version_key(beat.model_name, beat.version), beat.replica_id)

    async def close(self) -> None:
        await self._redis.aclose()


class ReplicaDirectory:
    def __init__(self, redis_url: str) -> None:
        import redis.asyncio as aioredis

        self._redis: Any = aioredis.Redis.from_url(redis_url)
        self._cache: dict[str, tuple[float, list[Heartbeat]]] = {}
        self._refreshing: dict[str, asyncio.Task[list[Heartbeat]]] = {}

    async def replicas(
        self, model_name: str, version: str, *, refresh: bool = False, allow_stale: bool = False
    ) -> list[Heartbeat]:
        """The version's heartbeats, from a cache at most _CACHE_S old. `allow_stale` (the request
        path): a cache up to _SERVE_STALE_S old is returned at once while a read refreshes it in the
        background, so routing a request waits on Redis only for a version it has not seen lately."""
        key = version_key(model_name, version)
        hit = self._cache.get(key)
        if hit is not None and not refresh:
            read_at, beats = hit
            age = time.monotonic() - read_at
            if age < _CACHE_S:
                return beats
            if allow_stale and age < _SERVE_STALE_S:
                if key not in self._refreshing:
                    task = asyncio.get_running_loop().create_task(self._read(key), name=f"directory-{key}")
                    self._refreshing[key] = task
                    task.add_done_callback(functools.partial(self._refreshed, key))
                return beats
        return await self._read(key)

    def _refreshed(self, key: str, task: asyncio.Task[list[Heartbeat]]) -> None:
        self._refreshing.pop(key, None)
        if not task.cancelled() and task.exception() is not None:
            # The next request past _SERVE_STALE_S reads in line and gets the error itself.
            logger.warning("replica directory: refreshing %s failed: %r", key, task.exception())

    async def _read(self, key: str) -> list[Heartbeat]:
        read_at = time.monotonic()
        asked_at = time.time()
        async with self._redis.pipeline(transaction=False) as pipe:
            redis_time, raw = await pipe.time().hgetall(key).execute()
        offset = clock_offset(redis_time, asked_at, time.time())
        beats, forgotten = [], []
        for field, beat in parse_beats(raw, offset, where=key):
            if time.time() - beat.sent_at > _FORGET_AFTER_S:
                forgotten.append(field)  # a replica that died without withdrawing
            else:
                beats.append(beat)
        if forgotten:
            await self._redis.hdel(key, *forgotten)
        self._cache[key] = (read_at, beats)
        return beats

    async def all_replicas(self) -> list[Heartbeat]:
        beats: list[Heartbeat] = []
        async for key in self._redis.scan_iter(f"{KEY_PREFIX}*"):
            model_name, _, version = key.decode()[len(KEY_PREFIX) :].partition(":")
            beats.extend(await self.replicas(model_name, version, refresh=True))
        return beats

    async def record_demand(self, model_name: str, version: str) -> str | None:
        """Tells the autoscaler that requests wait for a replica of the version; returns why it declined
        to start one, if it did (serving/selectors.py, publish_pin_declines)."""
        why = await self._redis.eval(
            RECORD_DEMAND_SCRIPT, 2, DEMAND_KEY, PIN_DECLINES_KEY, f"{model_name}:{version}"
        )
        return why.decode() if isinstance(why, bytes) else why

    async def is_alive(self, model_name: str, version: str, replica_id: str) -> bool:
        beats = await self.replicas(model_name, version)
        return any(b.replica_id == replica_id and b.is_alive for b in beats)

    async def close(self) -> None:
        for task in list(self._refreshing.values()):
            task.cancel()
        await self._redis.aclose()
