"""The inference endpoints' own Django handler, with a lean middleware stack (serving/edge/middleware.py says
why). Everything else (the dashboard, the admin, the control-plane API with session auth) keeps the
full settings.MIDDLEWARE."""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.http import HttpRequest
from django.urls import set_script_prefix

# Key-authenticated JSON/SSE endpoints only; /v1/models and the deployments API accept staff sessions.
INFERENCE_PATHS = re.compile(r"^/v1/(?:models/[^/]+/infer|completions|chat/completions|embeddings)$")
INFERENCE_MIDDLEWARE = ["serving.edge.middleware.InferenceSecurityMiddleware"]


class InferenceHandler(ASGIHandler):
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        # ASGIHandler wraps each request in a ThreadSensitiveContext, so the sync work Django does per
        # request runs on a thread pool of that request's own: a thread started and joined per request,
        # which held the event loop for about a third of its time under a 429 flood. handle() below
        # leaves that sync work out, so no context is needed.
        await self.handle(scope, receive, send)

    async def handle(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """ASGIHandler.handle without the request_started and request_finished signals. Their receivers
        (close_old_connections, close_caches, reset_urlconf) are synchronous, so Django runs them on a
        thread: one hop before the view, on every request's time to first token, and one after it.
        These views read the database only on worker threads that check their own connections
        (Channels' database_sync_to_async), so the receivers have nothing to do for them."""
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        set_script_prefix(get_script_prefix(scope))
        request, error_response = self.create_request(scope, body_file)
        try:
            if request is None:
                await self.send_response(error_response, send)
            else:
                await self._respond_unless_disconnected(request, receive, send)
        finally:
            if request is not None:
                request.close()
            body_file.close()

    async def _respond_unless_disconnected(self, request: HttpRequest, receive: Any, send: Any) -> None:
        async def respond() -> None:
            response = await self.run_get_response(request)
            try:
                with contextlib.suppress(asyncio.CancelledError):  # the client left while it was sent
                    await self.send_response(response, send)
            finally:
                # A streamed response's requests end with it, even where its body never started.
                close_dispatches = getattr(response, "close_dispatches", None)
                if close_dispatches is not None:
                    await close_dispatches()

        # A client that disconnects before its response is complete cancels the view; a streaming view
        # then aborts its sequence on the replica.
        disconnected = asyncio.create_task(self.listen_for_disconnect(receive))
        responded = asyncio.create_task(respond())
        try:
            await asyncio.wait((disconnected, responded), return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Cancelled once, not again: what the task does after its cancellation (closing its
            # dispatches: an abort to the replica, the quota settled) must run to its end. A cancellation
            # lost in a Redis read is caught where the stream reads (InFlightRequest._next_event).
            for task in (disconnected, responded):
                if not task.done():
                    task.cancel()
                with contextlib.suppress(asyncio.CancelledError, RequestAborted):
                    await task  # re-raises what the view raised, as Django's handler does

    def load_middleware(self, is_async: bool = False) -> None:
        # BaseHandler builds the chain from settings.MIDDLEWARE. inference_or() builds this handler
        # once, when config.asgi is imported and before any request is served; the list is swapped in
        # for that build only (a handler built concurrently in another thread would see it).
        full_stack = settings.MIDDLEWARE
        settings.MIDDLEWARE = INFERENCE_MIDDLEWARE
        try:
            super().load_middleware(is_async=is_async)
        finally:
            settings.MIDDLEWARE = full_stack


def inference_or(site: Any) -> Any:
    """An ASGI app: inference paths to the lean handler, the rest to `site`."""
    inference = InferenceHandler()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        root_path = scope.get("root_path", "")
        if root_path and path.startswith(root_path):  # mounted under a prefix
            path = path[len(root_path) :]
        if scope["type"] == "http" and INFERENCE_PATHS.match(path):
            await inference(scope, receive, send)
        else:
            await site(scope, receive, send)

    return app
