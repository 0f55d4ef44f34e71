"""The Redis layers: the one submissions travel on (channels_redis's core layer with a one-round-trip
send), and the pub/sub one steps travel on, with a publisher a replica's model thread uses directly. What
a sender and a receiver see must not change: order, process-local channels, capacity, JSON on the wire."""

from __future__ import annotations

import asyncio
import json
import random
import uuid

import pytest
import redis
from channels.exceptions import ChannelFull

from serving.transport.channel_layers import (
    BlockingPublisher,
    OneTripRedisChannelLayer,
    StepPubSubChannelLayer,
)
from tests.serving.conftest import one_trip_layer, record_commands


@pytest.mark.redis
async def test_messages_arrive_in_order_on_plain_and_process_local_channels(redis_url: str) -> None:
    layer = one_trip_layer(redis_url)
    try:
        for i in range(3):
            await layer.send("switchyard.replica.a", {"type": "submit", "i": i})
        assert [(await layer.receive("switchyard.replica.a"))["i"] for _ in range(3)] == [0, 1, 2]
        inbox = await layer.new_channel("switchyard.inbox.")
        await layer.send(inbox, {"type": "replica.step", "items": [{"request_id": "r", "events": []}]})
        assert await layer.receive(inbox) == {
            "type": "replica.step",
            "items": [{"request_id": "r", "events": []}],
        }
    finally:
        await layer.flush()


@pytest.mark.redis
async def test_a_cancelled_receive_ends_though_the_client_lost_the_cancellation(redis_url: str) -> None:
    """With a socket timeout (redis-py's default is 5 s), redis-py can lose a cancellation that lands
    as a blocking pop's timeout reply comes (serving/cancelling.py). The receive must end all the same:
    a replica's stop cancels its listener and waits for it."""
    layer = OneTripRedisChannelLayer(
        hosts=[{"address": redis_url, "socket_timeout": 5}],
        prefix=f"test-{uuid.uuid4().hex[:8]}",
        serializer_format="json",
    )
    layer.brpop_timeout = 0.02  # many timeout replies, so that cancellations often land with one
    rng = random.Random(2028)
    try:
        for _ in range(300):  # 8 of 300 lost here: all 300 kept by chance about once in 3,000 runs
            receiving = asyncio.create_task(layer.receive("switchyard.replica.quiet"))
            await asyncio.sleep(rng.uniform(0, 0.04))
            receiving.cancel()
            done, _ = await asyncio.wait({receiving}, timeout=2.0)
            assert done, "a cancelled receive went on waiting"
            assert receiving.cancelled()
    finally:
        await layer.flush()


@pytest.mark.redis
async def test_a_full_channel_refuses_and_the_wire_carries_json(redis_url: str) -> None:
    layer = one_trip_layer(redis_url, capacity=2)
    try:
        await layer.send("switchyard.replica.b", {"type": "submit", "n": 1})
        await layer.send("switchyard.replica.b", {"type": "submit", "n": 2})
        with pytest.raises(ChannelFull):
            await layer.send("switchyard.replica.b", {"type": "submit", "n": 3})
        (raw,) = redis.Redis.from_url(redis_url).zrange(layer.prefix + "switchyard.replica.b", 0, 0)
        assert json.loads(raw[12:]) == {"type": "submit", "n": 1}  # after channels_redis's random prefix
        assert (await layer.receive("switchyard.replica.b"))["n"] == 1
    finally:
        await layer.flush()


@pytest.mark.redis
async def test_a_receive_on_a_replica_channel_is_one_round_trip(redis_url: str) -> None:
    """channels_redis's receive adds three commands around the blocking pop (a backup of each message,
    one on the path before the message is returned); a replica's channel dies with it, so they buy
    nothing here."""
    layer = one_trip_layer(redis_url)
    try:
        await layer.send("switchyard.replica.c", {"type": "submit", "n": 1})
        commands = record_commands(layer.connection(0))
        assert await layer.receive("switchyard.replica.c") == {"type": "submit", "n": 1}
        assert [command[0] for command in commands] == ["BZPOPMIN"]
        keys = redis.Redis.from_url(redis_url).keys(f"{layer.prefix}*")
        assert keys == []  # nothing left behind: no backup queue
    finally:
        await layer.flush()


def _pubsub_layer(redis_url: str, **host: object) -> StepPubSubChannelLayer:
    return StepPubSubChannelLayer(
        hosts=[{"address": redis_url, "socket_timeout": None, **host}],
        prefix=f"test-{uuid.uuid4().hex[:8]}",
        serializer_format="json",
    )


async def _inbox_and_publisher(redis_url: str) -> tuple[StepPubSubChannelLayer, str, BlockingPublisher]:
    """A pub/sub layer with an inbox subscribed on it, and the layer's publisher for a thread."""
    layer = _pubsub_layer(redis_url)
    inbox = await layer.new_channel("switchyard.inbox.")
    publisher = layer.blocking_publisher()
    assert publisher is not None
    return layer, inbox, publisher


@pytest.mark.redis
async def test_a_threads_publisher_reaches_the_layers_receiver_in_order(redis_url: str) -> None:
    """What a replica's model thread publishes arrives, whole and in order, at a gateway's inbox that
    receives on the layer as before, with the layer's own serializer on the wire."""
    layer, inbox, publisher = await _inbox_and_publisher(redis_url)

    def publish_steps() -> None:
        publisher.connect()
        for i in range(500):
            publisher.publish(inbox, {"type": "replica.step", "items": [{"request_id": "r", "events": [i]}]})

    try:
        await asyncio.to_thread(publish_steps)
        received = [await asyncio.wait_for(layer.receive(inbox), timeout=5) for _ in range(500)]
        assert [m["items"][0]["events"][0] for m in received] == list(range(500))
        assert received[0] == {"type": "replica.step", "items": [{"request_id": "r", "events": [0]}]}
    finally:
        publisher.close()
        await layer.flush()


@pytest.mark.redis
async def test_what_publish_soon_leaves_goes_out_before_anything_published_after_it(redis_url: str) -> None:
    """A replica's acceptances go out by publish_soon while its model thread starts the forward pass,
    and its tokens by publish after it: a token must never reach the gateway before its acceptance,
    whichever thread wrote which."""
    layer, inbox, publisher = await _inbox_and_publisher(redis_url)

    def publish_steps() -> None:
        publisher.connect()
        for i in range(600):
            message = {"type": "replica.step", "items": [{"request_id": "r", "events": [i]}]}
            if i % 3 == 2:
                publisher.publish(inbox, message)
            else:
                publisher.publish_soon(inbox, message)
        publisher.close()  # writes what is still left

    try:
        await asyncio.to_thread(publish_steps)
        received = [await asyncio.wait_for(layer.receive(inbox), timeout=5) for _ in range(600)]
        assert [m["items"][0]["events"][0] for m in received] == list(range(600))
    finally:
        publisher.close()
        await layer.flush()


@pytest.mark.redis
async def test_publish_soon_returns_without_writing_and_the_publishers_thread_writes(redis_url: str) -> None:
    layer, inbox, publisher = await _inbox_and_publisher(redis_url)
    try:
        await asyncio.to_thread(publisher.connect)
        with publisher._writing:  # as if a write were under way: publish_soon must not wait for it
            await asyncio.wait_for(
                asyncio.to_thread(publisher.publish_soon, inbox, {"type": "replica.step", "n": 1}), timeout=5
            )
        # Nothing else publishes: the publisher's own thread writes it.
        assert (await asyncio.wait_for(layer.receive(inbox), timeout=5))["n"] == 1
    finally:
        publisher.close()
        await layer.flush()


@pytest.mark.redis
async def test_a_publisher_whose_connection_redis_closed_reconnects(redis_url: str) -> None:
    """A Redis restart or a CLIENT KILL closes the publisher's connection; the next publish finds that
    out before it writes and goes out on a new connection, so no step after the close is lost."""
    name = f"sy-publisher-{uuid.uuid4().hex[:8]}"
    layer = _pubsub_layer(redis_url, client_name=name)  # the layer's own subscriber gets the name too
    inbox = await layer.new_channel("switchyard.inbox.")
    publisher = layer.blocking_publisher()
    assert publisher is not None
    admin = redis.Redis.from_url(redis_url)
    try:
        await asyncio.to_thread(publisher.publish, inbox, {"type": "replica.step", "n": 1})
        assert (await asyncio.wait_for(layer.receive(inbox), timeout=5))["n"] == 1
        (client,) = [c for c in admin.client_list() if c["name"] == name and c["cmd"] == "publish"]
        admin.client_kill_filter(_id=client["id"])
        await asyncio.to_thread(publisher.publish, inbox, {"type": "replica.step", "n": 2})
        assert (await asyncio.wait_for(layer.receive(inbox), timeout=5))["n"] == 2
        assert [c["id"] for c in admin.client_list() if c["name"] == name and c["cmd"] == "publish"] != [
            client["id"]
        ]
    finally:
        publisher.close()
        await layer.flush()


def test_sentinel_hosts_keep_the_event_loops_sends() -> None:
    layer = StepPubSubChannelLayer(
        hosts=[{"master_name": "mymaster", "sentinels": [("127.0.0.1", 26379)]}], serializer_format="json"
    )
    assert layer.blocking_publisher() is None
