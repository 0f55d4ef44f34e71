"""The one error shape every API answers with: {"error": {"type", "message"}}."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import DisallowedHost
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.views import defaults
from rest_framework import exceptions as drf_exceptions
from rest_framework.response import Response
from rest_framework.views import exception_handler

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "method_not_allowed",
    406: "not_acceptable",
    408: "request_timeout",
    409: "conflict_error",
    413: "request_too_large",
    415: "unsupported_media_type",
    422: "unprocessable_error",
    429: "rate_limit_error",
    431: "request_headers_too_large",
    500: "internal_error",
    503: "service_unavailable",
}


def error_body(status: int, message: str, error_type: str | None = None) -> dict[str, Any]:
    return {"error": {"type": error_type or ERROR_TYPES.get(status, "error"), "message": message}}


def error_response(
    status: int,
    message: str,
    *,
    error_type: str | None = None,
    headers: dict[str, str] | None = None,
    openai: dict[str, str | None] | None = None,
) -> JsonResponse:
    """`openai`: OpenAI's `param` and `code`, which the inference endpoints' errors carry beside the
    type and message (serving/edge/error_fields.py)."""
    body = error_body(status, message, error_type)
    if openai is not None:
        body["error"].update(openai)
    return JsonResponse(body, status=status, headers=headers)


def drf_exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    response = exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, drf_exceptions.ValidationError):
        detail = exc.detail
        message = (
            "; ".join(f"{k}: {v[0] if isinstance(v, list) else v}" for k, v in detail.items())
            if isinstance(detail, dict)
            else str(detail[0] if isinstance(detail, list) else detail)
        )
    else:
        message = str(getattr(exc, "detail", exc))
    response.data = error_body(response.status_code, message)
    return response


def _is_api(request: HttpRequest) -> bool:
    return request.path_info.startswith("/v1/")  # path_info: the same under a script prefix


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """Django's 404 handler (config.urls.handler404): the API's error shape under /v1/, Django's page
    elsewhere (the dashboard, the admin)."""
    if _is_api(request):
        return error_response(404, f"no such endpoint: {request.method} {request.path}")
    return defaults.page_not_found(request, exception or Http404())


def bad_request(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """Django's 400 handler, for what it refuses before any view runs: a Host outside ALLOWED_HOSTS and
    its other SuspiciousOperations. Under /v1/ the API's error shape, without the exception's text (it
    can name the settings to change; Django's own page shows none either); Django's page elsewhere."""
    if not _is_api(request):
        return defaults.bad_request(request, exception)
    if isinstance(exception, DisallowedHost):
        return error_response(400, "the Host header names no host this server answers for")
    return error_response(400, "bad request")


def server_error(request: HttpRequest) -> HttpResponse:
    """Django's 500 handler: under /v1/ the API's error shape, with nothing of the exception (the log
    has it); Django's page elsewhere."""
    if _is_api(request):
        return error_response(500, "internal error: the server failed on this request")
    return defaults.server_error(request)
