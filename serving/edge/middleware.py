"""The inference endpoints' middleware: what they need of Django's stack, without its thread hops.

Django runs a sync-style middleware (every one in django.middleware and django.contrib) around an
async view by moving each of its methods to a thread, twice per middleware and request. The full
stack cost ~2.8 ms of CPU per request on this machine, which capped one gateway process at ~330
refusals per second. The inference endpoints (config.asgi.INFERENCE_PATHS) authenticate by API key
and answer JSON or SSE, so sessions, cookie auth, CSRF, messages and frame options have nothing to do
there; they get this one async middleware instead: SecurityMiddleware's headers and HTTPS redirect,
and the ALLOWED_HOSTS check that CommonMiddleware makes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from django.http import HttpRequest, HttpResponseBase
from django.middleware.security import SecurityMiddleware


class InferenceSecurityMiddleware(SecurityMiddleware):
    sync_capable = False
    async_capable = True

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        # SecurityMiddleware's methods only read settings and headers: nothing that needs a thread.
        request.get_host()  # DisallowedHost: a 400, as under CommonMiddleware
        response = self.process_request(request)
        if response is None:
            get_response: Callable[[HttpRequest], Awaitable[HttpResponseBase]] = self.get_response
            response = await get_response(request)
        return self.process_response(request, response)
