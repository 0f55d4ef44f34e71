"""Failures under load on the Redis fleet (docs/reliability.md, "Replica failures" and "Redis and Postgres
faults"): a replica killed under 50 streams, Redis paused and every Postgres connection ended under 8,
each with the figures the issue asks for, printed (`-s`) and asserted where they hold on a loaded machine."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest
import redis

from serving.gateway.quota_redis import RedisQuotaStore
from serving.transport.protocol import HEARTBEAT_INTERVAL_S, SUBMIT, replica_channel_prefix
from serving.transport.wire_signing import MAC_BYTES
from tests.e2e.conftest import LiveServer
from tests.e2e.quota_ledger import TOKENS_PER_MINUTE as LEDGER_TOKENS_PER_MINUTE
from tests.e2e.quota_ledger import QuotaLedger
from tests.e2e.redis_fleet import (
    FLEET_DATABASE,
    POSTGRES_ADMIN_URL,
    REDIS_URL,
    STARTED_ON,
    Fleet,
    running_fleet,
    stream,
)

pytestmark = [pytest.mark.live_server_process, pytest.mark.redis]

NUM_KILL_STREAMS = 50
BASELINE_PROBES = 8  # the survivor's TTFT under the 50 streams before the kill
RANDOM_PREFIX_BYTES = 12  # channels_redis's, in front of each message on a channel


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    yield from running_fleet(tmp_path_factory)


def test_killing_a_replica_mid_stream_ends_its_streams_with_an_error_and_spares_the_others(
    fleet: Fleet, request: pytest.FixtureRequest
) -> None:
    results: list[dict] = []
    threads: list[threading.Thread] = []
    started: list[threading.Event] = []
    # A tenant whose rate quota is out of the way: the demo's 50 requests a second would refuse one of
    # the 50 streams whenever probes had gone out in the same second (a 429 has no served replica).
    key = fleet.server.tenant_key("replica-kill", max_concurrent=128)

    def start_stream() -> None:
        event = threading.Event()
        started.append(event)
        thread = threading.Thread(target=lambda: results.append(stream(fleet.server, 150, event, key=key)))
        threads.append(thread)
        thread.start()

    def replicas_streaming() -> set[str]:
        return {r["replica"] for r in results}  # filled when a stream ends; see started_on below

    # 50 streams at once (docs/reliability.md, "Replica failures"); power of two choices spreads them
    # over both replicas, though a heartbeat arriving late on a loaded machine can send a burst to one.
    STARTED_ON.clear()  # only this test's streams
    # Short requests one after another, from the streams' start to the end: the survivor's TTFT before
    # the kill (under the streams' load) and after it.
    probes = _Probes(fleet.server, key=key)
    probes.start()
    # Stopped however the test ends: probes left running would keep the fleet's counters moving, and the
    # next test, which waits for them to settle, would wait for ever.
    request.addfinalizer(probes.stop)
    for _ in range(NUM_KILL_STREAMS):
        start_stream()
    assert all(event.wait(120) for event in started)
    all_started_at = time.monotonic()
    started_on = {replica for replica in STARTED_ON if replica in fleet.replicas}
    assert started_on == set(fleet.replicas), "the load should have spread over both replicas"
    # The victim is the replica with more streams: with two replicas the power of two choices sends each
    # probe to the less loaded one, the survivor, whose TTFT before the kill is then measured at all.
    victim, survivor = sorted(fleet.replicas, key=STARTED_ON.count, reverse=True)
    # The baseline: probes on the survivor once all 50 streams run (their prefills, a burst, behind
    # them), without waiting so long that the victim's streams end first.
    probes.wait_for(survivor, count=BASELINE_PROBES, timeout_s=8, after=all_started_at)
    fleet.replicas.pop(victim).send_signal(signal.SIGKILL)
    killed_at, killed_wall = time.monotonic(), time.time()
    listed_until_s, dropped_after_s = _seconds_until_unlisted(fleet.server, victim, since=killed_at)
    for thread in threads:
        thread.join(120)
    probes.stop()
    assert replicas_streaming() <= started_on
    routed_after_s = _sent_to(victim, since_wall=killed_wall)

    on_victim = [r for r in results if r["replica"] == victim]
    on_others = [r for r in results if r["replica"] != victim]
    assert on_victim
    assert on_others
    for result in on_victim:
        final = result["events"][-1]
        assert final["finish_reason"] == "error"
        assert final["error"]["type"] == "replica_lost"
    # Each ends once the gateway finds the replica's heartbeat stale (STALE_AFTER_S after its last beat)
    # at its next liveness check (LIVENESS_CHECK_S): within 2 s of the kill (docs/reliability.md).
    ended_after_s = max(r["ended_at"] - killed_at for r in on_victim)
    before = probes.ttfts(survivor, after=all_started_at, before=killed_at)
    after = probes.ttfts(survivor, after=killed_at)
    last_routed_s = max(routed_after_s, default=0.0)
    print(
        f"\n{len(on_victim)} streams on the killed replica, all ended {ended_after_s:.2f} s after the kill "
        f"(the kill {killed_at - all_started_at:.2f} s after the 50 streams' first tokens, the others' "
        f"last end {max(r['ended_at'] for r in on_others) - killed_at:.2f} s after it); "
        f"the gateway stopped listing it between {listed_until_s:.2f} and {dropped_after_s:.2f} s after "
        f"({listed_until_s / HEARTBEAT_INTERVAL_S:.1f}-{dropped_after_s / HEARTBEAT_INTERVAL_S:.1f} "
        f"heartbeats); {len(routed_after_s)} request(s) "
        f"sent to it after the kill, the last {last_routed_s:.2f} s "
        f"({last_routed_s / HEARTBEAT_INTERVAL_S:.1f} heartbeats) after; the survivor's TTFT, "
        f"before the kill: p50 {_pct(before, 50):.3f} s p99 {_pct(before, 99):.3f} s over {len(before)}, "
        f"after: p50 {_pct(after, 50):.3f} s p99 {_pct(after, 99):.3f} s over {len(after)} "
        f"(p99 ratio {_pct(after, 99) / _pct(before, 99):.2f})"
    )
    assert ended_after_s <= 2.0
    # The router's candidates are the replicas whose beat is fresh, the test /readyz lists them by:
    # gone within 3 heartbeats of the kill. Asserted on the last read that still listed it: the first
    # that did not list it ends a few tenths of a second later on this loaded machine (1.61 s once).
    assert listed_until_s <= 3 * HEARTBEAT_INTERVAL_S
    # Nor did the router send it anything later (few requests or none at all: the power of two choices
    # prefers the survivor, which has fewer streams; docs/reliability.md, "Replica failures").
    assert last_routed_s <= 3 * HEARTBEAT_INTERVAL_S
    for result in on_others:
        assert result["events"][-1]["finish_reason"] == "length"
        assert len(result["events"]) == 151
    # No probe failed: one sent to the dead replica before the router knew was retried on the survivor
    # (one already streaming from it when it died ends with replica_lost, as the streams above do).
    assert probes.failures == []
    # The router stops choosing the dead replica: every new request lands on the survivor.
    assert {stream(fleet.server, 2, key=key)["replica"] for _ in range(6)} == {survivor}


def _sent_to(replica_id: str, *, since_wall: float) -> list[float]:
    """How long after `since_wall` (the wall clock, which the gateway's channel layer scores each
    message with) each request routed to `replica_id` was sent to it. A killed replica reads nothing
    more from its channel, a sorted set in Redis, so every submission sent to it after the kill is
    still there: the router's choices, where the client sees only a retry's wait. A message there is
    its HMAC, channels_redis's random prefix, then the JSON (serving/transport/channel_layers.py)."""
    channel = redis.Redis.from_url(REDIS_URL).zrangebyscore(
        f"asgi{replica_channel_prefix('demo-chat', 'v1')}{replica_id}", since_wall, "+inf", withscores=True
    )
    return [
        score - since_wall
        for member, score in channel
        if json.loads(member[MAC_BYTES + RANDOM_PREFIX_BYTES :]).get("type") == SUBMIT
    ]


def _seconds_until_unlisted(server: LiveServer, replica_id: str, *, since: float) -> tuple[float, float]:
    """When, after `since`, the gateway's replica list (/readyz) stopped naming `replica_id`: after the
    start of the last read that named it, and before the end of the first that did not. On a loaded
    machine a read takes a while, and the first bound leaves the read's own time out."""
    last_listed_at = since
    while time.monotonic() - since < 30:
        asked_at = time.monotonic()
        if replica_id not in {r["replica_id"] for r in server.replicas()}:
            return last_listed_at - since, time.monotonic() - since
        last_listed_at = asked_at
        time.sleep(0.05)
    pytest.fail(f"the gateway still lists {replica_id} 30 s after its kill")


def _pct(values: list[float], q: int) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))] if ordered else float("nan")


class _Probes:
    """One client sending 2-token streams one after another: each one's send time, time to its first
    token and serving replica (the survivor's TTFT before and after the kill)."""

    def __init__(self, server: LiveServer, *, key: str) -> None:
        self._server = server
        self._key = key
        self._stopped = threading.Event()
        self._landed = threading.Condition()
        self.samples: list[tuple[float, float, str]] = []  # (sent at, TTFT, replica)
        self.failures: list[str] = []
        self._thread = threading.Thread(target=self._run)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(60)

    def wait_for(self, replica: str, *, count: int, timeout_s: float, after: float = 0.0) -> bool:
        with self._landed:
            return self._landed.wait_for(lambda: len(self.ttfts(replica, after=after)) >= count, timeout_s)

    def ttfts(self, replica: str, *, before: float = float("inf"), after: float = 0.0) -> list[float]:
        return [t for sent, t, r in self.samples if r == replica and after < sent < before]

    def _run(self) -> None:
        first = threading.Event()
        while not self._stopped.is_set():
            sent_at = time.monotonic()
            first.clear()
            try:
                result = stream(self._server, 2, first, key=self._key)
            except (httpx.HTTPError, KeyError) as exc:
                self.failures.append(repr(exc))
                continue
            if result["events"][-1].get("finish_reason") != "length" and not _cut_after_a_token(result):
                self.failures.append(json.dumps(result["events"][-1]))
            with self._landed:
                self.samples.append((sent_at, result["first_at"] - sent_at, result["replica"]))
                self._landed.notify_all()


def _cut_after_a_token(result: dict) -> bool:
    """A probe whose replica died after its first token: it ends with a replica_lost event, as documented
    (docs/reliability.md, "Replica failures"), since a retry would repeat text the client has seen."""
    *tokens, final = result["events"]
    return bool(tokens) and final.get("error", {}).get("type") == "replica_lost"


def _streams_under(
    fleet: Fleet, fault: Callable[[], None], *, key: str, num: int = 8
) -> tuple[list[dict], list[dict], float]:
    """`num` streams of 150 tokens with `key`, `fault()` once each has its first token; then every
    stream's result (its events, or the error that ended it), every answered probe's (the 2-token
    requests polling for the service's return), and how long after the fault the service answered."""
    results: list[dict] = []
    started = [threading.Event() for _ in range(num)]

    def stream_through(first: threading.Event) -> None:
        try:
            results.append(stream(fleet.server, 150, first, key=key))
        except (httpx.HTTPError, KeyError) as exc:  # refused (no X-Served-Replica), or cut off
            results.append({"replica": None, "events": [], "error": repr(exc)})
            first.set()

    threads = [threading.Thread(target=stream_through, args=(first,)) for first in started]
    for thread in threads:
        thread.start()
    assert all(first.wait(60) for first in started)
    fault()
    faulted_at = time.monotonic()
    answered: list[float] = []
    probes: list[dict] = []

    def probe() -> None:  # polled: the service's recovery is what is measured, from the fault on
        while not answered and time.monotonic() - faulted_at < 60:
            try:
                probes.append(stream(fleet.server, 2, key=key))
                if probes[-1]["events"][-1].get("finish_reason") == "length":
                    answered.append(time.monotonic() - faulted_at)
                    return
            except (httpx.HTTPError, KeyError):
                pass
            time.sleep(0.5)

    prober = threading.Thread(target=probe)
    prober.start()
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), "a stream hung"
    prober.join(90)
    assert answered, "the service did not come back"
    return results, probes, answered[0]


def _summary(results: list[dict]) -> str:
    ends = [
        (r["events"][-1].get("error", {}).get("type") or r["events"][-1].get("finish_reason"))
        if r["events"]
        else r["error"][:40]
        for r in results
    ]
    return ", ".join(f"{end}: {ends.count(end)}" for end in sorted(set(map(str, ends))))


def test_redis_paused_for_5_s_hangs_no_stream_and_the_service_comes_back(fleet: Fleet) -> None:
    def pause() -> None:
        redis.Redis.from_url(REDIS_URL).execute_command("CLIENT", "PAUSE", 5000, "ALL")

    _under_a_fault(fleet, pause, name="Redis paused 5 s", tenant="redis-pause", recovers_within_s=5 + 30)


def test_postgres_connections_terminated_under_load_hang_no_stream(fleet: Fleet) -> None:
    import psycopg

    def terminate() -> None:
        admin = POSTGRES_ADMIN_URL.replace("postgres://", "postgresql://").rsplit("/", 1)[0] + "/postgres"
        with psycopg.connect(admin, autocommit=True) as connection:
            connection.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (FLEET_DATABASE,)
            )

    _under_a_fault(
        fleet, terminate, name="Postgres connections ended", tenant="pg-terminate", recovers_within_s=30
    )


def _under_a_fault(
    fleet: Fleet, fault: Callable[[], None], *, name: str, tenant: str, recovers_within_s: float
) -> None:
    """8 streams of a tenant of their own through `fault`: none hangs or is lost, the service answers
    again within `recovers_within_s`, and no usage is lost or counted twice, neither in the version's
    metrics nor in the tenant's quota (docs/reliability.md, "Redis and Postgres faults")."""
    key = fleet.server.tenant_key(tenant, max_concurrent=32, tokens_per_minute=LEDGER_TOKENS_PER_MINUTE)
    ledger = QuotaLedger(REDIS_URL, _tenant_id(tenant))
    counted_before = _settled_output_tokens_counted()
    ledger.start()
    results, probes, recovered_after_s = _streams_under(fleet, fault, key=key)
    served, counted = _tokens_counted_since(counted_before, [*results, *probes])
    used, charged = _tokens_used([*results, *probes]), ledger.tokens_charged()
    in_flight = _requests_in_flight()
    print(
        f"\n{name} under 8 streams: {_summary(results)}; answering again {recovered_after_s:.1f} s after; "
        f"{served} tokens served, {counted} counted in the metrics; the tenant's quota charged "
        f"{charged:.1f} tokens for the {used} its {len(results) + len(probes)} answered requests used; "
        f"{in_flight} request(s) still held by the quota"
    )
    assert all(r["events"] and r["events"][-1].get("finish_reason") == "length" for r in results)
    assert recovered_after_s <= recovers_within_s
    assert counted == served, f"{served} tokens served, {counted} counted in the metrics"
    assert charged == pytest.approx(used, abs=0.5), f"{used} tokens used, {charged:.1f} charged by the quota"
    assert in_flight == 0


def _tokens_used(results: list[dict]) -> int:
    """The tokens the quota should have charged for `results`: each answered request's prompt and
    completion, as its final event's usage says. A refused one (no events) used none."""
    used = 0
    for result in results:
        if result["events"]:
            usage = result["events"][-1].get("usage")
            assert usage is not None, f"a request ended without its usage: {result['events'][-1]}"
            used += usage["prompt_tokens"] + usage["completion_tokens"]
    return used


def _tenant_id(name: str) -> int:
    import psycopg

    url = POSTGRES_ADMIN_URL.replace("postgres://", "postgresql://").rsplit("/", 1)[0] + "/" + FLEET_DATABASE
    with psycopg.connect(url) as connection:
        row = connection.execute("SELECT id FROM registry_tenant WHERE name = %s", (name,)).fetchone()
    assert row is not None, name
    return int(row[0])


def _tokens_counted_since(counted_before: int, results: list[dict]) -> tuple[int, int]:
    """The tokens served since `counted_before` was read (the streams' and the probes'), and those the
    version's metrics count, once every flush that met the fault has landed: each in once. Polled:
    flushes come every few seconds."""
    served = sum(sum("token" in event for event in r["events"]) for r in results)
    deadline = time.monotonic() + 60
    while _output_tokens_counted() - counted_before < served and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(2 * 5)  # two more flush periods: a row written twice would show by now
    return served, _output_tokens_counted() - counted_before


@dataclass(frozen=True)
class _Limits:
    """A tenant's limits as the quota store's usage() reads them (its counters are what is checked)."""

    tenant_id: int
    requests_per_second: float = 1.0
    tokens_per_minute: int = 1
    max_concurrent_requests: int = 1


def _requests_in_flight() -> int:
    """Requests the quota still counts in flight, over every tenant, read from Redis as every gateway
    would: once the streams have ended, a lease the fault kept from being released shows here."""
    import psycopg

    url = POSTGRES_ADMIN_URL.replace("postgres://", "postgresql://").rsplit("/", 1)[0] + "/" + FLEET_DATABASE
    with psycopg.connect(url) as connection:
        tenant_ids = [row[0] for row in connection.execute("SELECT id FROM registry_tenant")]
    usage = RedisQuotaStore(REDIS_URL).usage([_Limits(tenant_id) for tenant_id in tenant_ids])
    assert len(usage) == len(tenant_ids), "Redis unreadable"
    return sum(u.num_in_flight for u in usage.values())


def _settled_output_tokens_counted() -> int:
    """The count once the earlier tests' tokens are all flushed: the same over a whole flush period.
    Polled: the replicas flush on a timer of their own, which nothing outside them can await."""
    counted = _output_tokens_counted()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(6)  # one flush period (SWITCHYARD_METRICS_FLUSH_INTERVAL_S, 5 s) and a margin
        again = _output_tokens_counted()
        if again == counted:
            return counted
        counted = again
    raise AssertionError("the fleet's token counts still moved after 120 s: something else is streaming")


def _output_tokens_counted() -> int:
    """demo-chat's output tokens in the metrics store, over its 5 s rows (the rows replicas write)."""
    import psycopg

    url = POSTGRES_ADMIN_URL.replace("postgres://", "postgresql://").rsplit("/", 1)[0] + "/" + FLEET_DATABASE
    with psycopg.connect(url) as connection:
        row = connection.execute(
            "SELECT COALESCE(SUM((w.counters->>'output_tokens')::bigint), 0) FROM serving_metricwindow w "
            "JOIN registry_modelversion v ON v.id = w.version_id JOIN registry_model m ON m.id = v.model_id "
            "WHERE m.name = 'demo-chat' AND w.resolution_s = 5"
        ).fetchone()
    return int(row[0]) if row else 0
