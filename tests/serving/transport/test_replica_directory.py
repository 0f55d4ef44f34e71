"""The replica directory gateways route from: heartbeats in Redis, cached per process, and on the request
path served from the cache while a background read refreshes it."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import pytest

from serving.transport import replica_directory
from serving.transport.replica_directory import (
    Heartbeat,
    HeartbeatPublisher,
    RecentSteps,
    ReplicaDirectory,
    StepTimes,
)


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


@pytest.mark.parametrize(
    "raw",
    [b"[1, 2]", b'"ready"', b"{}", b'{"replica_id": "r1"}'],
    ids=["a list", "a string", "empty", "fields missing"],
)
def test_what_is_not_a_heartbeat_is_refused(raw: bytes) -> None:
    with pytest.raises(ValueError, match="heartbeat"):
        Heartbeat.from_json(raw)


def test_a_heartbeat_of_a_newer_replica_parses_and_a_wrongly_typed_one_does_not() -> None:
    beat = Heartbeat("r1", "m", "v1", "c", "ready", 1, 0, 0.5, time.time(), capacity=8)
    values = dataclasses.asdict(beat)
    import json

    assert Heartbeat.from_json(json.dumps({**values, "added_later": [1]})) == beat
    for field, bad in (("sent_at", None), ("num_waiting", "3"), ("num_running", True), ("state", 1)):
        with pytest.raises(ValueError, match=f"heartbeat field {field}"):
            Heartbeat.from_json(json.dumps({**values, field: bad}))


@pytest.mark.redis
async def test_one_entry_that_does_not_parse_hides_none_of_the_others(redis_url: str) -> None:
    import redis.asyncio as aioredis

    model = f"dir-{uuid.uuid4().hex[:8]}"
    beat = Heartbeat("r1", model, "v1", "switchyard.replica.x", "ready", 0, 0, 0.0, time.time())
    publisher, directory = HeartbeatPublisher(redis_url), ReplicaDirectory(redis_url)
    client = aioredis.Redis.from_url(redis_url)
    try:
        await publisher.publish(beat)
        await client.hset(replica_directory.version_key(model, "v1"), "junk", b'{"sent_at": null}')
        assert [b.replica_id for b in await directory.replicas(model, "v1")] == ["r1"]
    finally:
        await client.delete(replica_directory.version_key(model, "v1"))
        await client.aclose()
        await publisher.close()
        await directory.close()


def test_recent_steps_read_as_a_share_of_wall_time_and_a_long_step_as_busy() -> None:
    steps = RecentSteps(window_s=5.0, since=0.0)
    assert steps.read(now=0.0) == StepTimes(0.0, 0.0)
    for at, seconds in ((0.1, 0.100), (2.0, 0.020), (6.5, 0.030)):
        steps.add(at, seconds)
    # The step at 0.1 ended more than 5 s before the newest: two steps over the 5.5 s since 1.5.
    assert steps.read(now=7.0) == pytest.approx(StepTimes(0.025, 2 / 5.5))
    assert steps.read(now=11.6) == StepTimes(0.0, 0.0)  # no step for a whole window: idle
    # Just ready: one long prefill in its first 0.3 s is not most of its time; a second is the least.
    fresh = RecentSteps(window_s=5.0, since=10.0)
    fresh.add(10.25, 0.25)
    assert fresh.read(now=10.30) == pytest.approx(StepTimes(0.25, 1.0))
    # Back to back from then: the wall time is the steps' own (here 1.5 s since ready, 1.25 s stepping).
    for end in (10.5, 10.75, 11.0, 11.25):
        fresh.add(end, 0.25)
    fresh.begin(11.5)
    assert fresh.read(now=11.6) == pytest.approx(StepTimes(0.25, 5 / 1.5))  # the one running: not yet
    fresh.add(11.5, 0.25)
    # One step running for longer than the window (an overloaded replica): busy with it, not idle.
    fresh.begin(11.5)
    assert fresh.read(now=17.4) == pytest.approx(StepTimes(5.9, 1 / 5.9))
    fresh.add(17.9, 6.4)
    assert fresh.read(now=17.9) == pytest.approx(StepTimes(6.4, 1 / 6.4))
    # A step that failed ended nothing: once cancelled, nothing is running.
    fresh.begin(18.0)
    fresh.cancel()
    assert fresh.read(now=40.0) == StepTimes(0.0, 0.0)


@pytest.mark.redis
async def test_a_beat_is_aged_on_redis_clock_whatever_the_hosts_clocks_say(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica host whose clock is 10 s behind, read by a gateway host whose clock is 10 s ahead: its
    fresh beat is ready, and one it stopped sending goes stale."""
    model = f"dir-{uuid.uuid4().hex[:8]}"
    behind = Heartbeat("r1", model, "v1", "switchyard.replica.x", "ready", 0, 0, 0.0, time.time() - 10)
    publisher, directory = HeartbeatPublisher(redis_url), ReplicaDirectory(redis_url)
    real_time = time.time
    monkeypatch.setattr(replica_directory.time, "time", lambda: real_time() + 10)  # the gateway's host
    try:
        await publisher.publish(behind)
        (beat,) = await directory.replicas(model, "v1", refresh=True)
        assert beat.is_ready and abs(beat.sent_at - time.time()) < 0.5
        assert await directory.is_alive(model, "v1", "r1")
        monkeypatch.setattr(replica_directory.time, "time", lambda: real_time() + 10 + 3)  # 3 s later
        assert not beat.is_fresh and beat.has_missed_beats
    finally:
        await publisher.withdraw(behind)
        await publisher.close()
        await directory.close()


def test_a_beat_says_what_is_queued_ahead_and_how_fast_it_prefills_and_an_older_one_says_nothing() -> None:
    """The TTFT forecast's inputs: a replica's beat carries the prompt tokens its sequences have yet to
    prefill and the rate its prefilling steps ran at; an older replica's beat parses without them."""
    import json
    import types

    from registry.models import Model
    from serving.replica.load_report import LoadReport

    report = LoadReport()

    class Engine:
        def queued_prompt_tokens(self) -> int:
            return 1500

    def stats(batched: int, scheduled: int) -> object:
        return types.SimpleNamespace(
            num_waiting=3,
            num_running=2,
            kv_cache_usage=0.5,
            num_batched_tokens=batched,
            num_scheduled_seqs=scheduled,
        )

    report.account(stats(batched=2, scheduled=2), 0.010, engine=Engine())  # two sequences decoding
    ref = types.SimpleNamespace(model_name="m", version="v1", kind=Model.Kind.CAUSAL_LM)
    beat = report.heartbeat(ref, "r1", "c", "ready", num_pending=0, idle_s=0.0)  # type: ignore[arg-type]
    assert (beat.queued_prompt_tokens, beat.prefill_tokens_per_s) == (1500, 0.0)  # no prefill yet
    report.account(stats(batched=512, scheduled=3), 0.050, engine=Engine())  # one prefilling, two decoding
    report.account(stats(batched=258, scheduled=3), 0.030, engine=Engine())
    beat = report.heartbeat(ref, "r1", "c", "ready", num_pending=0, idle_s=0.0)  # type: ignore[arg-type]
    assert beat.prefill_tokens_per_s == pytest.approx((510 + 256) / 0.080)
    report.account(stats(batched=1, scheduled=1), 0.005, engine=None)  # an engine without the figure
    beat = report.heartbeat(ref, "r1", "c", "ready", num_pending=0, idle_s=0.0)  # type: ignore[arg-type]
    assert beat.queued_prompt_tokens == 0
    assert beat.prefill_tokens_per_s == pytest.approx((510 + 256) / 0.080)  # its last prefill's, kept
    # Seats freed: sequences ended over every step's time, not only the prefilling steps'.
    assert beat.seats_freed_per_s == 0.0  # none ended yet
    report.account(stats(batched=2, scheduled=2), 0.020, engine=Engine(), ended=2)
    beat = report.heartbeat(ref, "r1", "c", "ready", num_pending=0, idle_s=0.0)  # type: ignore[arg-type]
    assert beat.seats_freed_per_s == pytest.approx(2 / (0.010 + 0.050 + 0.030 + 0.005 + 0.020))

    older = {
        k: v
        for k, v in dataclasses.asdict(beat).items()
        if k not in ("queued_prompt_tokens", "prefill_tokens_per_s", "seats_freed_per_s")
    }
    parsed = Heartbeat.from_json(json.dumps(older))
    assert (parsed.queued_prompt_tokens, parsed.prefill_tokens_per_s) == (0, 0.0)
    assert parsed.seats_freed_per_s == 0.0
    with pytest.raises(ValueError, match="heartbeat field queued_prompt_tokens"):
        Heartbeat.from_json(json.dumps({**older, "queued_prompt_tokens": 1.5}))


def test_a_beat_says_when_its_batch_frees_seats_at_the_latest_and_a_wrong_list_is_refused() -> None:
    """The forecast's bound on a seat wait: the engine's soonest ends, and how long ago its last step
    ended, through JSON and back; an engine without the figure (an encoder) says none."""
    import json
    import types

    from registry.models import Model
    from serving.replica.load_report import LoadReport

    class Engine:
        def queued_prompt_tokens(self) -> int:
            return 0

        def latest_ends_in_steps(self, limit: int) -> tuple[int, ...]:
            return (3, 7, 90)[:limit]

    stats = types.SimpleNamespace(
        num_waiting=1, num_running=3, kv_cache_usage=0.5, num_batched_tokens=3, num_scheduled_seqs=3
    )
    ref = types.SimpleNamespace(model_name="m", version="v1", kind=Model.Kind.CAUSAL_LM)
    report = LoadReport()
    before = report.heartbeat(ref, "r1", "c", "ready", num_pending=0, idle_s=0.0)  # type: ignore[arg-type]
    assert (before.latest_ends_in_steps, before.since_step_s) == ((), 0.0)  # no step yet
    report.account(stats, 0.010, engine=Engine())
    beat = report.heartbeat(ref, "r1", "c", "ready", num_pending=0, idle_s=0.0)  # type: ignore[arg-type]
    assert beat.latest_ends_in_steps == (3, 7, 90)
    assert 0.0 < beat.since_step_s < 5.0
    assert Heartbeat.from_json(json.dumps(dataclasses.asdict(beat))) == beat
    # Redis's publishing script writes an empty list back as {} (Lua's cjson): still none.
    empty = Heartbeat.from_json(json.dumps({**dataclasses.asdict(beat), "latest_ends_in_steps": {}}))
    assert empty.latest_ends_in_steps == ()
    for bad in (["3"], [True], [-1], 3, None, {"1": 2}):
        with pytest.raises(ValueError, match="heartbeat field latest_ends_in_steps"):
            Heartbeat.from_json(json.dumps({**dataclasses.asdict(beat), "latest_ends_in_steps": bad}))
    report.account(stats, 0.010, engine=None)
    assert report.heartbeat(ref, "r1", "c", "ready", num_pending=0, idle_s=0.0).latest_ends_in_steps == ()  # type: ignore[arg-type]
