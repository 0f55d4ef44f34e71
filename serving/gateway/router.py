"""Version choice (pin, alias, weighted split) and replica choice (least loaded of two random picks).

Routing tables are cached per process and revalidated by their revision number at most every
`REVALIDATE_S`, so a rollback reaches every gateway within a second; when the database cannot be read,
the last table known good keeps serving."""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Protocol, TypeVar

from channels.db import database_sync_to_async

from registry.models import is_valid_name
from registry.selectors import RoutingSnapshot, routing_revision, routing_snapshot
from serving.gateway.errors import GatewayError

logger = logging.getLogger(__name__)

REVALIDATE_S = 0.5


@dataclass(slots=True)
class _CacheEntry:
    snapshot: RoutingSnapshot | None
    checked_at: float
    used_at: float


# A table used this recently is revalidated ahead of time by the runtime's refresher (due_for_refresh), so
# a request finds it fresh and routes without a database read or a thread hop.
REFRESH_WHILE_USED_S = 30.0
# Past this many cached names, those of no model are dropped before another is added.
MAX_ENTRIES = 1000


class RoutingCache:
    def __init__(self, *, revalidate_s: float = REVALIDATE_S) -> None:
        self._entries: dict[str, _CacheEntry] = {}
        self._reading: set[str] = set()  # names whose table a thread is reading from the database now
        self._lock = threading.Lock()
        self._revalidate_s = revalidate_s

    def get_fresh(self, model_name: str) -> tuple[bool, RoutingSnapshot | None]:
        """(True, snapshot) when the cached entry needs no revalidation yet; (False, None) otherwise.
        No database access, so async callers can skip the thread hop while the entry is fresh."""
        if not is_valid_name(model_name):
            return True, None  # no model is named so (get)
        now = time.monotonic()
        with self._lock:
            entry = self._entries.get(model_name)
            if entry is not None:
                entry.used_at = now
        if entry is not None and now - entry.checked_at < self._revalidate_s:
            return True, entry.snapshot
        return False, None

    async def aget(self, model_name: str) -> RoutingSnapshot | None:
        """get() for async code: from memory while the entry is fresh (no thread hop), else on a worker
        thread."""
        is_fresh, snapshot = self.get_fresh(model_name)
        if not is_fresh:
            snapshot = await database_sync_to_async(self.get, thread_sensitive=False)(model_name)
        return snapshot

    def get(self, model_name: str, *, max_age_s: float | None = None) -> RoutingSnapshot | None:
        """Blocking (database); call from a thread in async code. Revalidates an entry older than
        `max_age_s` (default: the revalidation period)."""
        if not is_valid_name(model_name):
            # No model has such a name, and nothing a client put in it reaches the database (a NUL, which
            # Postgres refuses, read as the table being unavailable) or takes a place in the cache.
            return None
        max_age_s = self._revalidate_s if max_age_s is None else max_age_s
        now = time.monotonic()
        with self._lock:
            entry = self._entries.get(model_name)
            if entry is not None and now - entry.checked_at < max_age_s:
                return entry.snapshot
            if entry is not None and entry.snapshot is not None and model_name in self._reading:
                # One revalidation at a time: the others route on the table it is checking. A database
                # that hangs (a partition: no refusal, no error) then holds one worker thread, not every
                # request's, and the last good table serves meanwhile instead of after the hang.
                return entry.snapshot
            self._reading.add(model_name)
        try:
            return self._read(model_name, entry, now)
        finally:
            with self._lock:
                self._reading.discard(model_name)

    def _read(self, model_name: str, entry: _CacheEntry | None, now: float) -> RoutingSnapshot | None:
        try:
            if (
                entry is not None
                and entry.snapshot is not None
                and routing_revision(model_name=model_name)
                == (entry.snapshot.revision, entry.snapshot.owner_id)
            ):
                entry.checked_at = now
                return entry.snapshot
            snapshot = routing_snapshot(model_name=model_name)
        except Exception as exc:
            if entry is not None and entry.snapshot is not None:
                # Tried again a period after the failure, not by every request meanwhile: a database
                # that hangs would otherwise gather every worker thread in the connect (stamped with the
                # start, a failure that took longer than the period would be due again at once).
                entry.checked_at = time.monotonic()
                logger.warning(
                    "routing table for %s unreadable (%s); using revision %s",
                    model_name,
                    type(exc).__name__,
                    entry.snapshot.revision,
                )
                return entry.snapshot
            raise GatewayError(503, "routing table unavailable", retry_after_s=1) from exc
        with self._lock:
            if snapshot is None and len(self._entries) >= MAX_ENTRIES:
                # Names of no model, which any client may send (each a 404): they take no place a real
                # model's table needs.
                for name in [n for n, e in self._entries.items() if e.snapshot is None]:
                    del self._entries[name]
            self._entries[model_name] = _CacheEntry(snapshot, now, entry.used_at if entry else now)
        return snapshot

    def due_for_refresh(self) -> list[str]:
        """Tables used in the last REFRESH_WHILE_USED_S and past half their revalidation period (no
        database access): the runtime's refresher revalidates them before a request would have to."""
        now = time.monotonic()
        with self._lock:
            return [
                name
                for name, entry in self._entries.items()
                if entry.snapshot is not None  # a name of no model is read again when next asked for
                and now - entry.used_at < REFRESH_WHILE_USED_S
                and now - entry.checked_at >= self._revalidate_s / 2
            ]

    def refresh(self, names: list[str]) -> None:
        """Blocking (database). Revalidate these tables early (see due_for_refresh)."""
        for name in names:
            with contextlib.suppress(GatewayError):  # unreadable and nothing cached: a request will say so
                self.get(name, max_age_s=self._revalidate_s / 2)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


routing_cache = RoutingCache()


def split_model_name(path_model: str) -> tuple[str, str | None]:
    """`chat-model@stable` -> ("chat-model", "stable")."""
    name, _, alias = path_model.partition("@")
    return name, alias or None


def choose_version(
    snapshot: RoutingSnapshot, *, pin: str | None, alias: str | None, rng: random.Random
) -> str:
    if pin is not None:
        if pin not in snapshot.versions:
            raise GatewayError(404, f"version {pin!r} of model {snapshot.model_name!r} not found")
        return pin
    if alias is not None:
        version = snapshot.aliases.get(alias)
        if version is None:
            raise GatewayError(404, f"alias {alias!r} of model {snapshot.model_name!r} not found")
        return version
    if snapshot.weights:
        versions = list(snapshot.weights)
        return rng.choices(versions, weights=[snapshot.weights[v] for v in versions])[0]
    if "stable" in snapshot.aliases:
        return snapshot.aliases["stable"]
    raise GatewayError(503, f"model {snapshot.model_name!r} has no version taking traffic", retry_after_s=5)


class Loaded(Protocol):
    @property
    def load(self) -> int: ...
    @property
    def is_ready(self) -> bool: ...


R = TypeVar("R", bound=Loaded)


def choose_replica(replicas: list[R], *, rng: random.Random) -> R | None:
    """Power of two choices: nearly the balance of least-loaded without every gateway herding onto the
    same replica from a stale view."""
    healthy = [r for r in replicas if r.is_ready]
    if not healthy:
        return None
    if len(healthy) == 1:
        return healthy[0]
    a, b = rng.sample(healthy, 2)
    return a if a.load <= b.load else b
