"""The dashboard's live feeds, staff only, each pushing one `{"type": "update", ...}` message every
LIVE_INTERVAL_S (the client sends nothing):

- the model page's: `ws://host/dashboard/ws/models/{model}/?range=15m` (dashboard.selectors.live_update):
  the last few chart points of each version (one series per version, never merged), traffic and states,
  and the replicas' KV-cache use and queue depth as they are now;
- the overview's: `ws://host/dashboard/ws/overview/` (dashboard.selectors.overview_update):
  replica states, each version's traffic and last-minute rates, fleet KV-cache use.

Mounted with config.routing.session_route (session auth + the allowed-hosts origin check). Anyone but
staff is closed with 4403 as soon as the handshake ends (an unknown model 4404), and an open feed is
closed with 4403 within STAFF_RECHECK_S of its user logging out or losing staff."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.core.serializers.json import DjangoJSONEncoder

from dashboard import charts, selectors
from serving.cancelling import cancel_and_wait, raise_if_cancelling

logger = logging.getLogger(__name__)

CLOSE_FORBIDDEN = 4403
CLOSE_NOT_FOUND = 4404
STAFF_RECHECK_S = 30.0


def _is_still_staff(scope: dict[str, Any]) -> bool:
    """The handshake's session read afresh, as a request's would be: gone (a logout anywhere), its user's
    password changed since (Django's session auth hash), or its user no longer active staff."""
    from types import SimpleNamespace

    from django.contrib.auth import get_user

    session = scope.get("session")
    if session is None or not session.session_key:
        return False
    # A session gone from the store loads empty, and its user is anonymous.
    user = get_user(SimpleNamespace(session=session.__class__(session.session_key)))  # type: ignore[arg-type]
    return bool(user.is_authenticated and user.is_active and user.is_staff)


class _PushingConsumer(AsyncJsonWebsocketConsumer):  # type: ignore[misc]
    """Staff check at the handshake, then push() every interval_s until the socket closes."""

    interval_s: float = selectors.LIVE_INTERVAL_S
    _task: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        # Refusals are closes after the handshake: one before it is an HTTP 403 at the server (uvicorn),
        # and the browser sees only 1006, which live.js takes for a dropped feed and retries for ever.
        await self.accept()
        user = self.scope.get("user")
        if user is None or not (user.is_authenticated and user.is_active and user.is_staff):
            await self.close(code=CLOSE_FORBIDDEN)
            return
        if not await self.prepare():
            await self.close(code=CLOSE_NOT_FOUND)
            return
        self._task = asyncio.get_running_loop().create_task(
            self._push_forever(), name=f"dashboard live feed {self.scope.get('path')}"
        )

    async def prepare(self) -> bool:
        """Read the handshake's parameters; False when what the feed follows does not exist."""
        return True

    async def disconnect(self, code: int) -> None:
        if self._task is not None:
            # Cancelled again if a Redis read lost the first cancellation; the feed has nothing to clean up.
            await cancel_and_wait([self._task])  # logs it, had it failed

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        pass  # the feed only pushes

    async def _push_forever(self) -> None:
        loop = asyncio.get_running_loop()
        checked_at = loop.time()
        while True:
            raise_if_cancelling()  # one lost in a Redis read must not leave the feed running for ever
            if loop.time() - checked_at >= STAFF_RECHECK_S:
                checked_at = loop.time()
                with contextlib.suppress(Exception):  # a database hiccup is no verdict: the next check
                    if not await database_sync_to_async(_is_still_staff, thread_sensitive=False)(self.scope):
                        await self.close(code=CLOSE_FORBIDDEN)
                        return
            try:
                await self.push()
            except asyncio.CancelledError:
                raise
            except selectors.ModelGone:
                await self.close(code=CLOSE_NOT_FOUND)
                return
            except Exception:  # a failed read (database busy, runtime restarting) skips one push
                logger.exception("dashboard live feed %s: update failed", self.scope.get("path"))
            await asyncio.sleep(self.interval_s)

    async def push(self) -> None:
        raise NotImplementedError

    @classmethod
    async def encode_json(cls, content: Any) -> str:
        return json.dumps(content, cls=DjangoJSONEncoder, separators=(",", ":"))


class OverviewFeedConsumer(_PushingConsumer):
    async def push(self) -> None:
        replicas = await selectors.fleet_replicas()
        await self.send_json(
            await database_sync_to_async(selectors.overview_update, thread_sensitive=False)(replicas=replicas)
        )


class LiveFeedConsumer(_PushingConsumer):
    _pushed = False

    async def prepare(self) -> bool:
        query = parse_qs(self.scope.get("query_string", b"").decode("latin-1"))
        self.chart = charts.chart_range((query.get("range") or [None])[0])
        self.with_points = (query.get("points") or ["1"])[0] != "0"  # the rollout page needs no charts
        # The versions the page drew at load (it may show a version with data but no traffic now).
        self.charted: list[str] = [v for v in ",".join(query.get("versions", [])).split(",") if v]
        self.model_name = self.scope["url_route"]["kwargs"]["model"]
        return (
            await database_sync_to_async(selectors.model_get, thread_sensitive=False)(name=self.model_name)
            is not None
        )

    async def push(self) -> None:
        replicas = await selectors.fleet_replicas()
        update = await database_sync_to_async(selectors.live_update, thread_sensitive=False)(
            model_name=self.model_name,
            chart=self.chart,
            charted=self.charted,
            replicas=replicas,
            with_points=self.with_points,
            whole_range=not self._pushed,  # what the page lacks since it loaded, or since its last feed
        )
        self.charted = update["charted"]
        await self.send_json(update)
        self._pushed = True
