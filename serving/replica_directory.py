"""Which replicas exist and how loaded they are, for gateways in other processes.

Each replica process publishes a heartbeat every HEARTBEAT_INTERVAL_S into one Redis hash per model
version (field: replica id, value: its state and load). Gateways read the hash, cache it for a quarter
of a second, and treat a replica whose last beat is older than STALE_AFTER_S as gone. In the embedded
default there is no Redis: the runtime knows its in-process replicas directly."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

HEARTBEAT_INTERVAL_S = 0.5
STALE_AFTER_S = 1.5
_FORGET_AFTER_S = 60.0
_CACHE_S = 0.25
KEY_PREFIX = "switchyard:replicas:"


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
    sent_at: float  # wall clock

    @property
    def load(self) -> int:
        return self.num_waiting + self.num_running

    @property
    def is_fresh(self) -> bool:
        return time.time() - self.sent_at < STALE_AFTER_S

    @property
    def is_ready(self) -> bool:
        return self.state == "ready" and self.is_fresh


class HeartbeatPublisher:
    def __init__(self, redis_url: str) -> None:
        import redis.asyncio as aioredis

        self._redis: Any = aioredis.Redis.from_url(redis_url)

    async def publish(self, beat: Heartbeat) -> None:
        key = version_key(beat.model_name, beat.version)
        await self._redis.hset(key, beat.replica_id, json.dumps(asdict(beat)))

    async def withdraw(self, beat: Heartbeat) -> None:
        await self._redis.hdel(version_key(beat.model_name, beat.version), beat.replica_id)

    async def close(self) -> None:
        await self._redis.aclose()


class ReplicaDirectory:
    def __init__(self, redis_url: str) -> None:
        import redis.asyncio as aioredis

        self._redis: Any = aioredis.Redis.from_url(redis_url)
        self._cache: dict[str, tuple[float, list[Heartbeat]]] = {}

    async def replicas(self, model_name: str, version: str, *, refresh: bool = False) -> list[Heartbeat]:
        key = version_key(model_name, version)
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is not None and not refresh and now - hit[0] < _CACHE_S:
            return hit[1]
        raw = await self._redis.hgetall(key)
        beats, forgotten = [], []
        for field, value in raw.items():
            beat = Heartbeat(**json.loads(value))
            if time.time() - beat.sent_at > _FORGET_AFTER_S:
                forgotten.append(field)  # a replica that died without withdrawing
            else:
                beats.append(beat)
        if forgotten:
            await self._redis.hdel(key, *forgotten)
        self._cache[key] = (now, beats)
        return beats

    async def all_replicas(self) -> list[Heartbeat]:
        beats: list[Heartbeat] = []
        async for key in self._redis.scan_iter(f"{KEY_PREFIX}*"):
            model_name, _, version = key.decode()[len(KEY_PREFIX) :].partition(":")
            beats.extend(await self.replicas(model_name, version, refresh=True))
        return beats

    async def is_alive(self, model_name: str, version: str, replica_id: str) -> bool:
        beats = await self.replicas(model_name, version)
        return any(b.replica_id == replica_id and b.is_fresh for b in beats)

    async def close(self) -> None:
        await self._redis.aclose()
