"""Streams end when the key that opened them is revoked: every KEY_RECHECK_S the gateway asks the
registry, in one query, which of the keys behind its open streams still authenticate, and ends the streams
of any that does not (an SSE stream's final event, a WebSocket's error then close 4401), so a revoked key
stops within KEY_RECHECK_S plus a query on every gateway, not when its longest stream ends. A database
that cannot be read revokes nothing: streams run on, as keys checked lately pass (serving/gateway/auth.py)."""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Protocol

from channels.db import database_sync_to_async

from registry.selectors import live_api_key_hashes
from serving.throttle import Throttle

logger = logging.getLogger(__name__)

KEY_RECHECK_S = 2.0
_read_warning = Throttle()


class Revocable(Protocol):
    is_finished: bool

    def end_revoked(self) -> None: ...


class KeyWatch:
    """One per event loop (a process's gateway): the open streams by key hash, held weakly, so that a
    stream that ended and was dropped needs no unwatching."""

    def __init__(self) -> None:
        self._streams: dict[str, weakref.WeakSet[Revocable]] = {}
        self._task: asyncio.Task[None] | None = None

    def watch(self, key_hash: str, stream: Revocable) -> None:
        if not key_hash:
            return  # a caller with no key (a load generator in the process)
        self._streams.setdefault(key_hash, weakref.WeakSet()).add(stream)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._recheck_forever(), name="key-watch")

    async def _recheck_forever(self) -> None:
        while self._streams:
            await asyncio.sleep(KEY_RECHECK_S)
            await self.recheck()

    async def recheck(self) -> int:
        """End the streams of every watched key that no longer authenticates; how many it ended."""
        for key_hash in [h for h, streams in self._streams.items() if not _open(streams)]:
            del self._streams[key_hash]
        if not self._streams:
            return 0
        try:
            live = await database_sync_to_async(live_api_key_hashes, thread_sensitive=False)(
                list(self._streams)
            )
        except Exception as exc:
            if _read_warning.is_due():
                logger.warning(
                    "key watch: the registry could not be read (%s); revoking nothing", type(exc).__name__
                )
            return 0
        ended = 0
        for key_hash in set(self._streams) - live:
            for stream in _open(self._streams.pop(key_hash)):
                stream.end_revoked()
                ended += 1
        if ended:
            logger.warning("key watch: ended %d streams of revoked API keys", ended)
        return ended


def _open(streams: weakref.WeakSet[Revocable]) -> list[Revocable]:
    return [s for s in streams if not s.is_finished]


_watches: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, KeyWatch] = weakref.WeakKeyDictionary()


def key_watch() -> KeyWatch:
    """This event loop's watch."""
    loop = asyncio.get_running_loop()
    watch = _watches.get(loop)
    if watch is None:
        watch = _watches[loop] = KeyWatch()
    return watch
