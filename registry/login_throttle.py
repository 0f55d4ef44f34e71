"""The staff login (the admin's, which the dashboard uses too) throttled per client address and user name:
past AUTH_FAILURE_LIMIT failures within AUTH_FAILURE_WINDOW_S, a POST to the login page is answered 429
with Retry-After and not checked at all, the right password included (registry/auth_throttle.py).
Failures are counted from Django's user_login_failed signal, which every authentication backend sends."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse

from registry.auth_throttle import login_attempt, login_failures


def record_failed_login(
    sender: Any, credentials: dict[str, Any], request: HttpRequest | None = None, **_: Any
) -> None:
    """user_login_failed's receiver (connected in RegistryConfig.ready)."""
    client = request.META.get("REMOTE_ADDR") if request is not None else None
    login_failures.record(login_attempt(client, credentials.get("username")))


class LoginThrottleMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.method == "POST" and request.path == settings.LOGIN_URL:
            attempt = login_attempt(request.META.get("REMOTE_ADDR"), request.POST.get("username"))
            wait_s = login_failures.retry_after_s(attempt)
            if wait_s is not None:
                response = HttpResponse(
                    "Too many failed sign-ins. Try again later.\n", status=429, content_type="text/plain"
                )
                response["Retry-After"] = str(max(1, math.ceil(wait_s)))
                return response
        return self.get_response(request)
