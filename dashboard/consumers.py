"""The model page's live feed: `ws://host/dashboard/ws/models/{model}/?range=15m`.

Mounted with config.routing.session_route (session auth + the allowed-hosts origin check). Staff only:
anyone else is refused at the handshake (close code 4403; an unknown model 4404). Once open, it pushes
one `{"type": "update", ...}` message (dashboard.selectors.live_update) every LIVE_INTERVAL_S: the last
few chart points of each version (one series per version, never merged), traffic and states, and the
replicas' KV-cache use and load as they are now. The client sends nothing."""

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

logger = logging.getLogger(__name__)

CLOSE_FORBIDDEN = 4403
CLOSE_NOT_FOUND = 4404


class LiveFeedConsumer(AsyncJsonWebsocketConsumer):  # type: ignore[misc]
    interval_s: float = selectors.LIVE_INTERVAL_S
    _task: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not (user.is_authenticated and user.is_active and user.is_staff):
            await self.close(code=CLOSE_FORBIDDEN)
            return
        query = parse_qs(self.scope.get("query_string", b"").decode("latin-1"))
        self.chart = charts.chart_range((query.get("range") or [None])[0])
        self.with_points = (query.get("points") or ["1"])[0] != "0"  # the rollout page needs no charts
        # The versions the page drew at load (it may show a version with data but no traffic now).
        self.charted: list[str] = [v for v in ",".join(query.get("versions", [])).split(",") if v]
        self.model_name = self.scope["url_route"]["kwargs"]["model"]
        if await database_sync_to_async(selectors.model_get)(name=self.model_name) is None:
            await self.close(code=CLOSE_NOT_FOUND)
            return
        await self.accept()
        self._task = asyncio.get_running_loop().create_task(self._push_forever())

    async def disconnect(self, code: int) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        pass  # the feed only pushes

    async def _push_forever(self) -> None:
        while True:
            try:
                await self.push()
            except asyncio.CancelledError:
                raise
            except selectors.ModelGone:
                await self.close(code=CLOSE_NOT_FOUND)
                return
            except Exception:  # a failed read (database busy, runtime restarting) skips one push
                logger.exception("dashboard live feed: update for %s failed", self.model_name)
            await asyncio.sleep(self.interval_s)

    async def push(self) -> None:
        replicas = await selectors.fleet_replicas()
        update = await database_sync_to_async(selectors.live_update)(
            model_name=self.model_name,
            chart=self.chart,
            charted=self.charted,
            replicas=replicas,
            with_points=self.with_points,
        )
        self.charted = update["charted"]
        await self.send_json(update)

    @classmethod
    async def encode_json(cls, content: Any) -> str:
        return json.dumps(content, cls=DjangoJSONEncoder, separators=(",", ":"))
