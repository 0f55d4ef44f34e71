"""WebSocket routes, composed once here and mounted in config/asgi.py.

API streams authenticate with an API key in the handshake or the first message, never with cookies, so
they need no origin check (and non-browser clients send no Origin). Browser routes that rely on the
session cookie (the dashboard's live feed) are built with `session_route`: behind the session and auth
middleware and the allowed-hosts origin check, which stops cross-site WebSocket hijacking."""

from typing import Any

from channels.auth import AuthMiddlewareStack
from channels.security.websocket import AllowedHostsOriginValidator
from django.urls import URLPattern, path

from dashboard.consumers import LiveFeedConsumer, OverviewFeedConsumer
from serving.consumers import InferenceStreamConsumer


def session_route(route: str, consumer: Any) -> URLPattern:
    return path(route, AllowedHostsOriginValidator(AuthMiddlewareStack(consumer.as_asgi())))


websocket_urlpatterns: list[URLPattern] = [
    path("v1/models/<str:model>/stream", InferenceStreamConsumer.as_asgi()),
    session_route("dashboard/ws/models/<str:model>/", LiveFeedConsumer),
    session_route("dashboard/ws/overview/", OverviewFeedConsumer),
]
