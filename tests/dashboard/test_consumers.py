"""The model page's live feed, through Channels' communicator and the real ASGI routing (session auth and
the origin check included)."""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client

from config.asgi import application

pytestmark = pytest.mark.django_db(transaction=True)
PATH = "/dashboard/ws/models/chat/?range=5m"
ORIGIN = (b"origin", b"http://127.0.0.1")


@pytest.fixture(autouse=True)
def fast_feed(monkeypatch: pytest.MonkeyPatch) -> None:
    from dashboard.consumers import LiveFeedConsumer, OverviewFeedConsumer

    monkeypatch.setattr(LiveFeedConsumer, "interval_s", 0.05)
    monkeypatch.setattr(OverviewFeedConsumer, "interval_s", 0.05)


def _session_cookie(user: Any) -> bytes:
    client = Client()
    client.force_login(user)
    return f"sessionid={client.cookies['sessionid'].value}".encode()


async def _communicator(
    user: Any | None, *, path: str = PATH, origin: bytes = ORIGIN[1]
) -> WebsocketCommunicator:
    headers = [(b"origin", origin)]
    if user is not None:
        headers.append((b"cookie", await sync_to_async(_session_cookie)(user)))
    return WebsocketCommunicator(application, path, headers=headers)


async def _refusal(ws: WebsocketCommunicator) -> int:
    """The close code of a feed refused. It comes after the handshake: a close before it reaches a
    browser as an HTTP 403 and the code 1006, which live.js retries for ever (its codes are final)."""
    assert await ws.connect(timeout=10) == (True, None)
    closed = await ws.receive_output(timeout=10)
    assert closed["type"] == "websocket.close", closed
    return int(closed["code"])


async def test_staff_get_updates_with_one_series_per_version(make_user: Any, chat_with_traffic: Any) -> None:
    staff = await sync_to_async(make_user)("admin")
    ws = await _communicator(staff)
    connected, _ = await ws.connect(timeout=10)
    assert connected
    first = await ws.receive_json_from(timeout=10)
    second = await ws.receive_json_from(timeout=10)
    await ws.disconnect(timeout=10)

    assert first["type"] == second["type"] == "update"
    assert first["charted"] == ["v1"]  # active versions; the page passes the others it drew (below)
    assert [v["version"] for v in first["versions"]] == ["v1", "v2"]
    assert [(r["version"], r["state"], r["kv_pct"]) for r in first["replicas"]] == [
        ("v1", "ready", 25.0),
        ("v2", "loading", 50.0),
    ]
    with_data = [p for p in first["points"]["v1"] if p["n"]]
    assert [p["n"] for p in with_data] == [20]
    assert with_data[0]["ttft"][2] == pytest.approx(100.0, rel=0.02)
    assert first["last_minute"]["v1"]["num_requests"] == 20


async def test_a_feeds_first_push_carries_the_whole_range_and_later_ones_the_last_few_steps(
    make_user: Any, chat: Any
) -> None:
    """Two minutes ago is outside the few steps a push re-sends. A page whose feed reconnected after a
    laptop's sleep got only those: the minutes it missed stayed a straight line across the chart."""
    from tests.dashboard.conftest import record_traffic

    await sync_to_async(record_traffic)(chat, "v1", ttft_s=0.1, ago_s=120)
    staff = await sync_to_async(make_user)("admin")
    ws = await _communicator(staff)
    assert (await ws.connect(timeout=10))[0]
    first = await ws.receive_json_from(timeout=10)
    second = await ws.receive_json_from(timeout=10)
    await ws.disconnect(timeout=10)
    assert [p["n"] for p in first["points"]["v1"] if p["n"]] == [20]
    assert [p["n"] for p in second["points"]["v1"] if p["n"]] == []
    assert len(second["points"]["v1"]) < len(first["points"]["v1"])


async def test_versions_drawn_by_the_page_stay_separate_series(
    make_user: Any, chat_with_traffic: Any
) -> None:
    staff = await sync_to_async(make_user)("admin")
    ws = await _communicator(staff, path=PATH + "&versions=v1,v2,nope")
    assert (await ws.connect(timeout=10))[0]
    update = await ws.receive_json_from(timeout=10)
    await ws.disconnect(timeout=10)
    assert update["charted"] == ["v1", "v2"]  # an unknown version is dropped
    series = {v: [p for p in update["points"][v] if p["n"]] for v in ("v1", "v2")}
    assert [p["n"] for p in series["v1"]] == [20] and [p["n"] for p in series["v2"]] == [10]
    assert series["v1"][0]["ttft"][2] == pytest.approx(100.0, rel=0.02)
    assert series["v2"][0]["ttft"][2] == pytest.approx(400.0, rel=0.02)  # the canary's own latency


async def test_a_deployment_shows_up_in_the_feed(make_user: Any, deployment: Any) -> None:
    staff = await sync_to_async(make_user)("admin")
    ws = await _communicator(staff)
    assert (await ws.connect(timeout=10))[0]
    update = await ws.receive_json_from(timeout=10)
    await ws.disconnect(timeout=10)
    assert update["charted"] == ["v1", "v2"]  # the candidate holds the canary alias: active
    assert update["deployment"]["id"] == deployment.pk and update["deployment"]["state"] == "provisioning"


async def test_anonymous_and_non_staff_are_refused(make_user: Any, chat: Any) -> None:
    ws = await _communicator(None)
    assert await _refusal(ws) == 4403
    mallory = await sync_to_async(make_user)("mallory", is_staff=False)
    ws = await _communicator(mallory)
    assert await _refusal(ws) == 4403


async def test_an_unknown_model_is_refused(make_user: Any, chat: Any) -> None:
    staff = await sync_to_async(make_user)("admin")
    ws = await _communicator(staff, path="/dashboard/ws/models/nope/")
    assert await _refusal(ws) == 4404


async def test_another_sites_origin_is_refused(make_user: Any, chat: Any) -> None:
    staff = await sync_to_async(make_user)("admin")
    ws = await _communicator(staff, origin=b"https://evil.example")
    connected, _ = await ws.connect(timeout=10)
    assert not connected


async def test_the_rollout_pages_feed_carries_no_chart_points(make_user: Any, deployment: Any) -> None:
    staff = await sync_to_async(make_user)("admin")
    ws = await _communicator(staff, path="/dashboard/ws/models/chat/?points=0")
    assert (await ws.connect(timeout=10))[0]
    update = await ws.receive_json_from(timeout=10)
    await ws.disconnect(timeout=10)
    assert update["points"] == {} and update["last_minute"] == {}
    assert {v["version"]: v["traffic_pct"] for v in update["versions"]} == {"v1": 100, "v2": 0}
    assert update["deployment"]["state"] == "provisioning"


async def test_each_update_reads_traffic_afresh(make_user: Any, chat: Any) -> None:
    from registry.services import routing_table_set

    staff = await sync_to_async(make_user)("admin")
    ws = await _communicator(staff, path="/dashboard/ws/models/chat/?points=0")
    assert (await ws.connect(timeout=10))[0]
    first = await ws.receive_json_from(timeout=10)
    assert {v["version"]: v["traffic_pct"] for v in first["versions"]} == {"v1": 100, "v2": 0}
    await sync_to_async(routing_table_set)(model=chat, weights={"v1": 0, "v2": 100})
    update = await ws.receive_json_from(timeout=10)
    while {v["version"]: v["traffic_pct"] for v in update["versions"]} != {"v1": 0, "v2": 100}:
        update = await ws.receive_json_from(timeout=10)  # at most one push was already on its way
    assert update["charted"] == ["v1", "v2"]  # v2 now has traffic: it gets its own series
    await ws.disconnect(timeout=10)


# --- the overview's feed ---------------------------------------------------------------------------------

OVERVIEW = "/dashboard/ws/overview/"


async def test_the_overview_feed_pushes_the_fleet_versions_and_replicas(
    make_user: Any, chat_with_traffic: Any
) -> None:
    staff = await sync_to_async(make_user)("admin")
    ws = await _communicator(staff, path=OVERVIEW)
    assert (await ws.connect(timeout=10))[0]
    update = await ws.receive_json_from(timeout=10)
    await ws.disconnect(timeout=10)

    assert update["type"] == "update"
    fleet = update["fleet"]
    assert fleet["states"] == {"loading": 1, "ready": 1} and fleet["num_replicas"] == 2
    assert fleet["kv_mean_pct"] == 25.0  # over ready replicas only: v2 is loading
    assert (fleet["load"], fleet["queue_depth"]) == (7, 5)
    (model,) = update["models"]
    assert model["name"] == "chat" and model["deployment"] is None
    (v1,) = model["versions"]  # v2 has no traffic, alias or deployment: not shown
    assert (v1["version"], v1["traffic_pct"], v1["state"], v1["aliases"]) == (
        "v1",
        100,
        "serving",
        ["stable"],
    )
    assert v1["err_pct"] == pytest.approx(5.0)  # 1 error in 20 requests over the last minute
    assert v1["ttft_p99_ms"] == pytest.approx(100.0, rel=0.02)
    assert [(r["version"], r["state"], r["queue_depth"], r["running"]) for r in update["replicas"]] == [
        ("v1", "ready", 1, 2),
        ("v2", "loading", 4, 0),
    ]


async def test_the_overview_feed_follows_replicas_and_traffic_without_reconnecting(
    make_user: Any, chat: Any, fake_fleet: list[Any]
) -> None:
    from registry.services import routing_table_set
    from tests.dashboard.conftest import replica

    staff = await sync_to_async(make_user)("admin")
    ws = await _communicator(staff, path=OVERVIEW)
    assert (await ws.connect(timeout=10))[0]
    first = await ws.receive_json_from(timeout=10)
    assert first["fleet"]["states"] == {"loading": 1, "ready": 1}

    fake_fleet[1] = replica("v2", kv=0.75, waiting=0, running=3)  # v2's replica finished loading
    await sync_to_async(routing_table_set)(model=chat, weights={"v1": 50, "v2": 50})

    def caught_up(update: dict[str, Any]) -> bool:
        traffic = {v["version"]: v["traffic_pct"] for v in update["models"][0]["versions"]}
        return update["fleet"]["states"] == {"ready": 2} and traffic == {"v1": 50, "v2": 50}

    update = await ws.receive_json_from(timeout=10)
    while not caught_up(update):  # pushes read before the change may be queued; a stuck feed times out
        update = await ws.receive_json_from(timeout=10)
    await ws.disconnect(timeout=10)
    assert update["fleet"]["kv_mean_pct"] == 50.0 and update["fleet"]["queue_depth"] == 1


async def test_the_overview_feed_is_for_staff_only(make_user: Any, chat: Any) -> None:
    assert await _refusal(await _communicator(None, path=OVERVIEW)) == 4403
    mallory = await sync_to_async(make_user)("mallory", is_staff=False)
    assert await _refusal(await _communicator(mallory, path=OVERVIEW)) == 4403


@pytest.mark.parametrize("change", ["no longer staff", "password reset", "logged out"])
async def test_an_open_feed_is_closed_once_its_user_is_no_longer_staff(
    make_user: Any, chat: Any, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """Staff rights taken away, or the password reset (what follows a stolen session): Django ends the
    session's other requests, and the feed with them."""
    from dashboard import consumers

    staff = await sync_to_async(make_user)("admin")
    ws = await _communicator(staff)
    assert (await ws.connect(timeout=10))[0]
    assert (await ws.receive_json_from(timeout=10))["type"] == "update"
    if change == "logged out":  # elsewhere: the session is gone from the store
        from django.contrib.sessions.models import Session

        await sync_to_async(Session.objects.all().delete)()
    else:
        if change == "no longer staff":
            staff.is_staff = False
        else:
            staff.set_password("a new one, after the old was stolen")
        await sync_to_async(staff.save)()
    # The feed's next pass rechecks, now that the change is in. Not before: its read, on a thread of its
    # own, would race the change for the test database's table lock (SQLite in memory, shared cache).
    monkeypatch.setattr(consumers, "STAFF_RECHECK_S", 0.0)
    for _ in range(100):  # the updates in flight, then the close (a feed left open fails the test)
        message = await ws.receive_output(timeout=10)
        if message["type"] == "websocket.close":
            break
    assert message == {"type": "websocket.close", "code": consumers.CLOSE_FORBIDDEN}


async def test_a_closed_feed_ends_though_a_read_lost_its_cancellation(
    make_user: Any, chat_with_traffic: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push reads the replica directory in Redis, whose client can lose a cancellation
    (serving/cancelling.py). A closed tab's feed must end all the same, not read on every 1.5 s for ever
    with its connection never finished."""
    import asyncio

    from dashboard.consumers import LiveFeedConsumer

    pushing, lost = asyncio.Event(), asyncio.Event()
    feeds: list[asyncio.Task[Any]] = []

    async def push_losing_the_cancellation(self: Any) -> None:
        feeds.append(asyncio.current_task())  # type: ignore[arg-type]
        pushing.set()
        if lost.is_set():
            return
        try:
            await asyncio.sleep(3600)  # the Redis read
        except asyncio.CancelledError:
            lost.set()

    returned = asyncio.Event()
    disconnect = LiveFeedConsumer.disconnect

    async def disconnect_watched(self: Any, code: int) -> None:
        await disconnect(self, code)
        returned.set()

    monkeypatch.setattr(LiveFeedConsumer, "push", push_losing_the_cancellation)
    monkeypatch.setattr(LiveFeedConsumer, "disconnect", disconnect_watched)
    ws = await _communicator(await sync_to_async(make_user)("admin"))
    connected, _ = await ws.connect(timeout=10)
    assert connected
    await asyncio.wait_for(pushing.wait(), timeout=10)
    # Not ws.disconnect's own timeout: at the end of it the communicator cancels the consumer, and that
    # second cancellation would end the feed whatever the consumer does.
    closing = asyncio.create_task(ws.disconnect(timeout=30))
    await asyncio.wait_for(returned.wait(), timeout=5)  # the consumer's disconnect() came back by itself
    await closing
    assert lost.is_set() and feeds[0].done()
