"""The Redis channel layers: for submissions and aborts, channels_redis's core layer sending and receiving
with one Redis command each where channels_redis uses four; for the token stream, its pub/sub layer with a
publisher that a replica's model thread uses directly.

channels_redis sends a message with four commands, each awaited in turn (drop expired messages, count
against the channel's capacity, add, refresh the expiry): ~0.8 ms per send here, on the path of every
request's time to first token. One Lua script does the same four steps atomically in one round trip.

Its receive guards each message against the receiver's cancellation with a backup queue: a Lua script
before the blocking pop, a ZADD of the popped message to the backup (awaited before the message is
returned) and a ZPOPMIN after it, which the next receive waits for. The backup is read back only by a
later receiver on the same channel, and a replica's channel is its own (its name ends in the replica's
id) and dies with it: a submission in flight when a replica stops is lost either way, and the gateway's
liveness check retries it elsewhere (serving/gateway/dispatch.py). So on plain channels (only replicas receive
on those) a receive here is the blocking pop alone. Process-local channels, groups and flushing are the
core layer's own. The token stream does not come this way: it uses the pub/sub layer
(settings.CHANNEL_LAYERS["replies"]; docs/architecture.md, "One message per step and inbox").

A replica's steps are published from its model thread rather than handed to its event loop first: on
a loaded 2-core machine the loop thread took a median ~0.8 ms to wake and win the GIL from the model
thread, on every first token's path (docs/architecture.md, "Steps published from the model thread"). The model
thread writes the PUBLISH and goes on with the next step; Redis's replies (subscriber counts) are read back at
the next publish, so the thread never waits for a round trip. What need not go out before the step's forward
pass (its acceptances) the publisher's own thread writes meanwhile (`publish_soon`): written by the model
thread, it held up each new request's prefill (the replica's queue_s, one request at a time, a median 1.64
against 1.47 ms over four runs alternated; docs/architecture.md, "Steps published from the model thread")."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from channels.exceptions import ChannelFull
from channels_redis.core import RedisChannelLayer
from channels_redis.pubsub import RedisPubSubChannelLayer
from channels_redis.utils import _consistent_hash, decode_hosts

from serving.cancelling import raise_if_cancelling
from serving.throttle import Throttle
from serving.transport.wire_signing import ForgedMessage, WireSigner

logger = logging.getLogger(__name__)
_forged_warning = Throttle()  # one warning per 10 s of a flood, not one per message

# Lua functions, so that the quota store's admission script can run a send too
# (serving/gateway/quota_redis.py):
# a channel's sorted set has room once expired messages are dropped; a message is added with its score
# and the set's expiry refreshed.
SEND_FUNCTIONS = """
local function channel_has_room(key, expired_before, capacity)
  redis.call('ZREMRANGEBYSCORE', key, 0, expired_before)
  return redis.call('ZCARD', key) < tonumber(capacity)
end
local function channel_add(key, score, message, expiry)
  redis.call('ZADD', key, score, message)
  redis.call('EXPIRE', key, expiry)
end
"""
# KEYS[1] the channel's sorted set. ARGV: expired-before score, capacity, score, message, expiry (s).
_SEND = (
    SEND_FUNCTIONS
    + """
if not channel_has_room(KEYS[1], ARGV[1], ARGV[2]) then return 0 end
channel_add(KEYS[1], ARGV[3], ARGV[4], ARGV[5])
return 1
"""
)


@dataclass(frozen=True, slots=True)
class PreparedSend:
    """A send as the Lua functions above take it: the key and arguments, for the connection it goes on."""

    connection_index: int
    key: str
    args: tuple[object, ...]  # expired-before score, capacity, score, message, expiry (s)


class OneTripRedisChannelLayer(RedisChannelLayer):  # type: ignore[misc]
    def __init__(self, *args: Any, signing_key: str | None = None, **kwargs: Any) -> None:
        """`signing_key`: every message carries an HMAC from it, and one received without a matching
        HMAC is dropped and counted in `forged` by channel (serving/transport/wire_signing.py)."""
        super().__init__(*args, **kwargs)
        self._signer = WireSigner(signing_key) if signing_key else None
        self.forged: collections.Counter[str] = collections.Counter()

    def serialize(self, message: dict[str, Any]) -> bytes:
        body: bytes = super().serialize(message)
        return body if self._signer is None else self._signer.sign(body)

    def deserialize(self, message: bytes) -> dict[str, Any]:
        body = message if self._signer is None else self._signer.unsign(message)
        return super().deserialize(body)  # type: ignore[no-any-return]

    async def send(self, channel: str, message: dict[str, Any]) -> None:
        prepared = self.prepare_send(channel, message)
        added = await self.connection(prepared.connection_index).eval(_SEND, 1, prepared.key, *prepared.args)
        if not added:
            raise ChannelFull()

    def prepare_send(self, channel: str, message: dict[str, Any]) -> PreparedSend:
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
        args = (
            int(now) - int(self.expiry),
            self.get_capacity(channel),
            now,
            self.serialize(message),
            int(self.expiry),
        )
        return PreparedSend(index, channel_key, args)

    def single_address(self) -> str | None:
        """The Redis URL every send goes to when this layer has one host (None with several: a send's
        server then depends on the channel)."""
        return self.hosts[0].get("address") if len(self.hosts) == 1 else None  # decoded by the core layer

    async def receive(self, channel: str) -> dict[str, Any]:
        if "!" in channel:
            return await super().receive(channel)  # type: ignore[no-any-return]
        assert self.require_valid_channel_name(channel, receive=True), "Channel name not valid"
        connection = self.connection(next(self._receive_index_generator))
        while True:
            popped = await connection.bzpopmin(self.prefix + channel, timeout=self.brpop_timeout)
            if popped is None:
                # The client may have lost a cancellation that came with its timeout reply; without this
                # the loop would block again, and whoever cancelled would wait for ever. A message in
                # hand is returned first: the next timeout ends the loop.
                raise_if_cancelling()
            else:
                _, member, _ = popped
                try:
                    message: dict[str, Any] = self.deserialize(member)
                except ForgedMessage:
                    self.forged[channel] += 1
                    if _forged_warning.is_due():
                        logger.warning("dropped a message on %s whose HMAC does not match", channel)
                    continue
                message.pop("__asgi_channel__", None)  # set by a group send; the core layer drops it too
                return message


class StepPubSubChannelLayer(RedisPubSubChannelLayer):  # type: ignore[misc]
    """channels_redis's pub/sub layer, unchanged for its receivers, plus `blocking_publisher()`."""

    def blocking_publisher(self) -> BlockingPublisher | None:
        """A publisher for a thread without an event loop, on the same shards and serializer as this
        layer's own sends; None for hosts it cannot connect to itself (Sentinel), which keep the
        event loop's sends."""
        hosts = decode_hosts(self._kwargs.get("hosts", self._args[0] if self._args else None))
        if not all("address" in host for host in hosts):
            return None
        return BlockingPublisher(hosts, self.serialize)


class BlockingPublisher:
    """PUBLISH from a plain thread without waiting for Redis's replies: a publish is one socket write.
    The replies (subscriber counts) are read back, as far as they have arrived, at the next publish;
    that read is also where a connection Redis closed is found and replaced. One connection per shard,
    so messages to one channel arrive in the order published.

    One thread publishes (`publish`, `publish_soon`); the publisher's own thread writes what
    `publish_soon` left, unless the next `publish` comes first and writes it itself, before its own
    message. Either way every message goes out once and in the order the owning thread gave them."""

    # A write blocks only once Redis has stopped reading; past this the publish fails rather than
    # stopping its thread for good. The same bound for connecting.
    SOCKET_TIMEOUT_S = 5.0

    def __init__(self, hosts: Sequence[dict[str, Any]], serialize: Callable[[dict[str, Any]], bytes]) -> None:
        self._hosts = list(hosts)
        self._serialize = serialize
        self._connections: list[redis.connection.AbstractConnection | None] = [None] * len(self._hosts)
        self._unanswered = [0] * len(self._hosts)  # PUBLISHes written on each connection, reply unread
        # Taken for a whole write, pending messages included, so none overtakes another. Then _pending's.
        self._writing = threading.Lock()
        self._pending: list[tuple[str, dict[str, Any]]] = []  # publish_soon's, oldest first
        self._has_pending = threading.Condition()  # guards _pending and _closed
        self._closed = False
        self._writer: threading.Thread | None = None

    def connect(self) -> None:
        """Open every shard's connection now rather than on the first publish; raises if Redis is down."""
        with self._writing:
            for index in range(len(self._hosts)):
                self._ready_connection(index)

    def publish(self, channel: str, message: dict[str, Any]) -> None:
        """Write the message, after any that publish_soon left unwritten. Raises redis.RedisError or
        OSError when it could not be written; the next publish reconnects. A message written just before
        Redis closed the connection is lost unseen, as it would be on any pub/sub connection."""
        with self._writing:
            self._write_pending()
            self._write(channel, message)

    def publish_soon(self, channel: str, message: dict[str, Any]) -> None:
        """Leave the message to the publisher's thread and return at once. A failed write is logged
        (no one is left to raise to), and the next write reconnects."""
        with self._has_pending:
            if self._closed:
                return
            self._pending.append((channel, message))
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_soon, name="step-publisher", daemon=True)
                self._writer.start()
            self._has_pending.notify()

    def flush(self) -> None:
        """Write now whatever publish_soon left, rather than on the publisher's thread."""
        with self._writing:
            self._write_pending()

    def close(self) -> None:
        with self._has_pending:
            self._closed = True
            self._has_pending.notify()
            writer = self._writer
        if writer is not None:
            writer.join()
        with self._writing:
            for index in range(len(self._hosts)):
                self._await_replies(index)
                self._drop(index)

    def _await_replies(self, index: int) -> None:
        """Read every reply still owed on the shard's connection: closed with replies unread, a socket is
        reset rather than closed, and Redis may drop the last PUBLISHes it had not read yet (the final
        steps of a replica that drains and exits)."""
        connection = self._connections[index]
        try:
            while connection is not None and self._unanswered[index] > 0:
                self._read_reply(index, connection)
        except (redis.RedisError, OSError):
            logger.warning("could not read Redis's last replies to the step publisher", exc_info=True)

    def _read_reply(self, index: int, connection: redis.connection.AbstractConnection) -> None:
        self._unanswered[index] -= 1
        try:
            connection.read_response()
        except redis.ResponseError as exc:  # a refused PUBLISH (an ACL, say): not retried
            logger.warning("Redis refused a PUBLISH: %s", exc)

    def _write_soon(self) -> None:
        while True:
            with self._has_pending:
                while not (self._pending or self._closed):
                    self._has_pending.wait()
                if not self._pending:
                    return
            with self._writing:
                self._write_pending()

    def _write_pending(self) -> None:
        """Under _writing. A message that cannot be written is logged and dropped; the next reconnects."""
        with self._has_pending:
            pending, self._pending = self._pending, []
        for channel, message in pending:
            try:
                self._write(channel, message)
            except (redis.RedisError, OSError):
                logger.exception("could not publish a message to %s", channel)

    def _write(self, channel: str, message: dict[str, Any]) -> None:
        data = self._serialize(message)
        index = _consistent_hash(channel, len(self._hosts))
        connection = self._ready_connection(index)
        try:
            command = connection.pack_command("PUBLISH", channel, data)
            connection.send_packed_command(command, check_health=False)
            self._unanswered[index] += 1
        except (redis.RedisError, OSError):
            self._drop(index)
            raise

    def _ready_connection(self, index: int) -> redis.connection.AbstractConnection:
        """The shard's connection, with the replies that have arrived read; a new one if it was closed."""
        connection = self._connections[index]
        if connection is not None:
            try:
                while connection.can_read(timeout=0):
                    self._read_reply(index, connection)
                return connection
            except (redis.ConnectionError, OSError):  # Redis closed it (a restart, a CLIENT KILL)
                self._drop(index)
        host = {
            **self._hosts[index],
            "socket_timeout": self.SOCKET_TIMEOUT_S,
            "socket_connect_timeout": self.SOCKET_TIMEOUT_S,
        }
        address = host.pop("address")
        connection = redis.ConnectionPool.from_url(address, **host).make_connection()
        connection.connect()
        self._connections[index] = connection
        return connection

    def _drop(self, index: int) -> None:
        connection, self._connections[index] = self._connections[index], None
        self._unanswered[index] = 0
        if connection is not None:
            connection.disconnect()
