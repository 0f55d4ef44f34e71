"""The Redis channel layer for submissions and aborts: channels_redis's core layer, sending and receiving
with one Redis command each where channels_redis uses four.

channels_redis sends a message with four commands, each awaited in turn (drop expired messages, count
against the channel's capacity, add, refresh the expiry): ~0.8 ms per send here, on the path of every
request's time to first token. One Lua script does the same four steps atomically in one round trip.

Its receive guards each message against the receiver's cancellation with a backup queue: a Lua script
before the blocking pop, a ZADD of the popped message to the backup (awaited before the message is
returned) and a ZPOPMIN after it, which the next receive waits for. The backup is read back only by a
later receiver on the same channel, and a replica's channel is its own (its name ends in the replica's
id) and dies with it: a submission in flight when a replica stops is lost either way, and the gateway's
liveness check retries it elsewhere (serving/dispatch.py). So on plain channels (only replicas receive
on those) a receive here is the blocking pop alone. Process-local channels, groups and flushing are the
core layer's own. The token stream does not come this way: it uses the pub/sub layer
(settings.CHANNEL_LAYERS["replies"], ARCHITECTURE.md)."""

from __future__ import annotations

import time
from typing import Any

from channels.exceptions import ChannelFull
from channels_redis.core import RedisChannelLayer

# KEYS[1] the channel's sorted set. ARGV: expired-before score, capacity, score, message, expiry (s).
_SEND = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], 0, ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return 1
"""


class OneTripRedisChannelLayer(RedisChannelLayer):  # type: ignore[misc]
    async def send(self, channel: str, message: dict[str, Any]) -> None:
        assert isinstance(message, dict), "message is not a dict"
        assert self.require_valid_channel_name(channel), "Channel name not valid"
        assert "__asgi_channel__" not in message
        if "!" in channel:  # process-local: the receiving process demultiplexes on the full name
            message = {**message, "__asgi_channel__": channel}
            index = self.consistent_hash(channel)
            channel_key = self.prefix + self.non_local_name(channel)
        else:
            index = next(self._send_index_generator)
            channel_key = self.prefix + channel
        now = time.time()
        added = await self.connection(index).eval(
            _SEND,
            1,
            channel_key,
            int(now) - int(self.expiry),
            self.get_capacity(channel),
            now,
            self.serialize(message),
            int(self.expiry),
        )
        if not added:
            raise ChannelFull()

    async def receive(self, channel: str) -> dict[str, Any]:
        if "!" in channel:
            return await super().receive(channel)  # type: ignore[no-any-return]
        assert self.require_valid_channel_name(channel, receive=True), "Channel name not valid"
        connection = self.connection(next(self._receive_index_generator))
        while True:
            popped = await connection.bzpopmin(self.prefix + channel, timeout=self.brpop_timeout)
            if popped is not None:
                _, member, _ = popped
                message: dict[str, Any] = self.deserialize(member)
                message.pop("__asgi_channel__", None)  # set by a group send; the core layer drops it too
                return message
