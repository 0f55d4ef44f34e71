"""Helpers the serving tests share: a submissions layer on the test Redis, and a record of the commands
a redis.asyncio client issues."""

from __future__ import annotations

import uuid
from typing import Any

from serving.channel_layer import OneTripRedisChannelLayer


def one_trip_layer(redis_url: str, **config: object) -> OneTripRedisChannelLayer:
    """The submissions layer on the test Redis, under a prefix of its own."""
    return OneTripRedisChannelLayer(
        hosts=[{"address": redis_url, "socket_timeout": None}],
        prefix=f"test-{uuid.uuid4().hex[:8]}",
        serializer_format="json",
        **config,
    )


def record_commands(client: Any) -> list[tuple[Any, ...]]:
    """The commands (name first, then their arguments) a redis.asyncio client issues from now on; the
    client still runs them."""
    commands: list[tuple[Any, ...]] = []
    execute = client.execute_command

    async def recorded(*args: Any, **options: Any) -> Any:
        commands.append((str(args[0]).upper(), *args[1:]))
        return await execute(*args, **options)

    client.execute_command = recorded
    return commands
