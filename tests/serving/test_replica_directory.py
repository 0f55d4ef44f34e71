"""The replica directory gateways route from: heartbeats in Redis, cached per process, and on the request
path served from the cache while a background read refreshes it."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import pytest

from serving import replica_directory
from serving.replica_directory import Heartbeat, HeartbeatPublisher, ReplicaDirectory


@pytest.mark.redis
async def test_routing_gets_the_cached_heartbeats_at_once_and_the_next_read_gets_the_refreshed_ones(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replica_directory, "_CACHE_S", 0.0)  # every read is past the plain cache
    model = f"dir-{uuid.uuid4().hex[:8]}"
    beat = Heartbeat("r1", model, "v1", "switchyard.replica.x", "ready", 1, 0, 0.0, time.time())
    publisher, directory = HeartbeatPublisher(redis_url), ReplicaDirectory(redis_url)
    try:
        await publisher.publish(beat)
        assert [b.num_waiting for b in await directory.replicas(model, "v1")] == [1]  # cold: in line
        await publisher.publish(dataclasses.replace(beat, num_waiting=5, sent_at=time.time()))

        # The request path: the cached beats now, one refresh behind them (not one per request).
        assert [b.num_waiting for b in await directory.replicas(model, "v1", allow_stale=True)] == [1]
        assert [b.num_waiting for b in await directory.replicas(model, "v1", allow_stale=True)] == [1]
        assert len(directory._refreshing) == 1
        await asyncio.gather(*directory._refreshing.values())
        assert [b.num_waiting for b in await directory.replicas(model, "v1", allow_stale=True)] == [5]

        # A cache too old to route from is read in line, and so is every liveness check.
        monkeypatch.setattr(replica_directory, "_SERVE_STALE_S", 0.0)
        await publisher.withdraw(beat)
        assert await directory.replicas(model, "v1", allow_stale=True) == []
        assert not await directory.is_alive(model, "v1", "r1")
    finally:
        await publisher.withdraw(beat)
        await publisher.close()
        await directory.close()
