"""The Redis layer submissions travel on: channels_redis's core layer with a one-round-trip send. What a
sender and a receiver see must not change: order, process-local channels, capacity, JSON on the wire."""

from __future__ import annotations

import json
import uuid

import pytest
import redis
from channels.exceptions import ChannelFull

from serving.channel_layer import OneTripRedisChannelLayer


def _layer(redis_url: str, **config: object) -> OneTripRedisChannelLayer:
    hosts = [{"address": redis_url, "socket_timeout": None}]
    return OneTripRedisChannelLayer(
        hosts=hosts, prefix=f"test-{uuid.uuid4().hex[:8]}", serializer_format="json", **config
    )


@pytest.mark.redis
async def test_messages_arrive_in_order_on_plain_and_process_local_channels(redis_url: str) -> None:
    layer = _layer(redis_url)
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
async def test_a_full_channel_refuses_and_the_wire_carries_json(redis_url: str) -> None:
    layer = _layer(redis_url, capacity=2)
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
    layer = _layer(redis_url)
    try:
        await layer.send("switchyard.replica.c", {"type": "submit", "n": 1})
        client = layer.connection(0)
        commands: list[str] = []
        execute = client.execute_command

        async def counted(*args: object, **options: object) -> object:
            commands.append(str(args[0]).upper())
            return await execute(*args, **options)

        client.execute_command = counted
        assert await layer.receive("switchyard.replica.c") == {"type": "submit", "n": 1}
        assert commands == ["BZPOPMIN"]
        client.execute_command = execute
        keys = redis.Redis.from_url(redis_url).keys(f"{layer.prefix}*")
        assert keys == []  # nothing left behind: no backup queue
    finally:
        await layer.flush()
