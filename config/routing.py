"""WebSocket routes, composed once here and mounted in config/asgi.py.

API streams authenticate with an API key in the handshake or the first message, never with cookies.
Non-browser clients send no Origin and are let in; a handshake that names an Origin outside
ALLOWED_HOSTS is a page on another site, and is refused (403) before any key is read. Browser routes
that rely on the session cookie (the dashboard's live feed) are built with `session_route`: behind the
session and auth middleware and the allowed-hosts origin check, which requires an Origin, and stops
cross-site WebSocket hijacking."""

from typing import Any
from urllib.parse import ParseResult

from channels.auth import AuthMiddlewareStack
from channels.security.websocket import AllowedHostsOriginValidator, OriginValidator
from django.conf import settings
from django.urls import URLPattern, path, re_path

from config.unrouted import unrouted_websocket
from dashboard.consumers import LiveFeedConsumer, OverviewFeedConsumer
from serving.edge.websocket import InferenceStreamConsumer


class ForeignOriginRefuser(OriginValidator):  # type: ignore[misc]
    """The allowed-hosts check for key-authenticated routes: no Origin (a non-browser client) passes."""

    def valid_origin(self, parsed_origin: ParseResult | None) -> bool:
        return parsed_origin is None or bool(self.validate_origin(parsed_origin))


def session_route(route: str, consumer: Any) -> URLPattern:
    return path(route, AllowedHostsOriginValidator(AuthMiddlewareStack(consumer.as_asgi())))


def api_route(route: str, consumer: Any) -> URLPattern:
    # The hosts AllowedHostsOriginValidator allows, its DEBUG fallback included. ALLOWED_HOSTS "*" lets
    # every Origin in, here as there.
    hosts = settings.ALLOWED_HOSTS or (["localhost", "127.0.0.1", "[::1]"] if settings.DEBUG else [])
    return path(route, ForeignOriginRefuser(consumer.as_asgi(), hosts))


websocket_urlpatterns: list[URLPattern] = [
    api_route("v1/models/<str:model>/stream", InferenceStreamConsumer),
    session_route("dashboard/ws/models/<str:model>/", LiveFeedConsumer),
    session_route("dashboard/ws/overview/", OverviewFeedConsumer),
    # Last: any other path is a 404 to the handshake, not Channels' "No route found" (a 500).
    re_path(r"(?s)^.*$", unrouted_websocket),
]
