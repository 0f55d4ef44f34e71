"""The inference endpoints' own Django handler, with a lean middleware stack (serving/middleware.py says
why). Everything else (the dashboard, the admin, the control-plane API with session auth) keeps the
full settings.MIDDLEWARE."""

from __future__ import annotations

import re
from typing import Any

from django.conf import settings
from django.core.handlers.asgi import ASGIHandler

# Key-authenticated JSON/SSE endpoints only; /v1/models and the deployments API accept staff sessions.
INFERENCE_PATHS = re.compile(r"^/v1/(?:models/[^/]+/infer|completions|chat/completions)$")
INFERENCE_MIDDLEWARE = ["serving.middleware.InferenceSecurityMiddleware"]


class InferenceHandler(ASGIHandler):
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        # ASGIHandler wraps each request in a ThreadSensitiveContext, so the sync work Django does per
        # request (request_started/finished receivers, response.close) runs on a thread pool of that
        # request's own: a thread started and joined per request, which held the event loop for about a
        # third of its time under a 429 flood. These views touch no database or other thread-bound
        # state on that thread, so the receivers can share asgiref's one process-wide thread instead.
        await self.handle(scope, receive, send)

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
