"""A pin through the provisioner (issue 43): a request pinned (X-Version-Pin) to a version with no traffic
and no replica waits at its gateway, whose demand in Redis gets the version one replica from the
autoscaler (which the provisioner starts), kept while pinned requests keep coming and retired after the
idle time; at most PROVISIONER_MAX_PINNED such versions at once."""

from __future__ import annotations

import pytest

from rollouts.fleet.autoscaler import ScalingPolicy
from tests.rollouts.fleet.test_autoscaler import beat

POLICY = ScalingPolicy(min_replicas=1, max_replicas=6, idle_before_zero_s=300, scale_down_window_s=60)
pytestmark = pytest.mark.django_db


def tick(now: float, beats: list, demand: dict | None = None) -> dict:  # type: ignore[type-arg]
    from rollouts.scaling import autoscale

    return autoscale(heartbeats=beats, demand=demand or {}, policy=POLICY, now=now)


def _reason(version: str) -> str:
    from rollouts.models import ScaleTarget

    return ScaleTarget.objects.get(version__version=version).reason


def test_a_pinned_version_without_a_replica_gets_one_kept_until_idle(make_model) -> None:  # type: ignore[no-untyped-def]
    make_model("chat")
    v1 = beat("chat", "v1", sent_at=1000.0)
    assert tick(1000.0, [v1], {("chat", "v2"): 0.5}) == {("chat", "v1"): 1, ("chat", "v2"): 1}
    assert _reason("v2").startswith("kept warm: the last request 0 s ago")
    # loading (no heartbeat yet) while the pinned request still waits: kept
    assert tick(1010.0, [beat("chat", "v1", sent_at=1010.0)], {("chat", "v2"): 0.2}) == {}

    # up, and its pinned requests served (the last at 1001): its replica's idle time keeps it, then
    # retires it, with the gateway's last demand as old
    def at(now: float) -> list:  # type: ignore[type-arg]
        return [beat("chat", "v1", sent_at=now), beat("chat", "v2", sent_at=now, idle_s=now - 1001.0)]

    assert tick(1200.0, at(1200.0), {("chat", "v2"): 200.0}) == {}
    assert tick(1301.0, at(1301.0), {("chat", "v2"): 301.0}) == {("chat", "v2"): 0}
    # a demand older than the idle time (a gateway's leftover in Redis) brings nothing back
    assert tick(1400.0, [beat("chat", "v1", sent_at=1400.0)], {("chat", "v2"): 300.0}) == {}


def test_at_most_provisioner_max_pinned_versions_get_a_replica_for_pins(make_model, settings) -> None:  # type: ignore[no-untyped-def]
    settings.PROVISIONER_MAX_PINNED = 1
    make_model("chat")
    v1 = beat("chat", "v1", sent_at=1000.0)
    # v3 asked for more recently: it gets the one; v2 none (its requests time out with a 503)
    assert tick(1000.0, [v1], {("chat", "v2"): 5.0, ("chat", "v3"): 1.0}) == {
        ("chat", "v1"): 1,
        ("chat", "v3"): 1,
    }
    # v3's replica is up and used: it keeps it, and v2 still gets none
    beats = [v1, beat("chat", "v3", sent_at=1010.0, idle_s=2.0)]
    assert tick(1010.0, beats, {("chat", "v2"): 0.1}) == {}
    settings.PROVISIONER_MAX_PINNED = 0  # pins off: a version that has its replica keeps it while used
    assert tick(1020.0, [v1, beat("chat", "v3", sent_at=1020.0, idle_s=1.0)], {("chat", "v2"): 0.1}) == {}


@pytest.mark.redis
def test_a_pinned_version_given_no_replica_is_declined_in_redis_with_why_until_it_has_room(  # type: ignore[no-untyped-def]
    make_model, settings, redis_url
) -> None:
    """The autoscaler's word to the gateways (serving.selectors.publish_pin_declines), read where a
    gateway records its demand: a version past PROVISIONER_MAX_PINNED is declined with why, and no more
    once it gets room."""
    import redis

    from serving.transport.replica_directory import DEMAND_KEY, PIN_DECLINES_KEY, RECORD_DEMAND_SCRIPT

    settings.REDIS_URL = redis_url
    settings.PROVISIONER_MAX_PINNED = 1
    client = redis.Redis.from_url(redis_url)
    client.delete(PIN_DECLINES_KEY, DEMAND_KEY)
    try:
        make_model("chat")
        v1 = beat("chat", "v1", sent_at=1000.0)
        tick(1000.0, [v1], {("chat", "v2"): 5.0, ("chat", "v3"): 1.0})
        why = client.eval(RECORD_DEMAND_SCRIPT, 2, DEMAND_KEY, PIN_DECLINES_KEY, "chat:v2")
        assert why.decode().startswith("the fleet keeps at most 1 versions without traffic warm")
        assert client.eval(RECORD_DEMAND_SCRIPT, 2, DEMAND_KEY, PIN_DECLINES_KEY, "chat:v3") is None
        assert 0 < client.ttl(PIN_DECLINES_KEY) <= 3 * settings.AUTOSCALER_INTERVAL_S
        # Room for both: declined no more.
        settings.PROVISIONER_MAX_PINNED = 2
        assert tick(1005.0, [v1], {("chat", "v2"): 0.5, ("chat", "v3"): 1.0}) == {("chat", "v2"): 1}
        assert client.hgetall(PIN_DECLINES_KEY) == {}
    finally:
        client.delete(PIN_DECLINES_KEY, DEMAND_KEY)
        client.close()
