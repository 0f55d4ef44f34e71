"""WebSocket routes. Streaming inference and the dashboard's live feed register here as they land."""

from django.urls import URLPattern

websocket_urlpatterns: list[URLPattern] = []
