"""The write endpoints' request bodies: a JSON object with only the fields its serializer names, each
checked by it. Anything else is a 400 in the one error shape (registry/errors.py), before any write."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers
from rest_framework.exceptions import APIException, ValidationError
from rest_framework.request import Request


class Refused(APIException):
    """A refusal with its status, answered as {"error": {"type", "message"}}."""

    def __init__(self, status_code: int, message: str) -> None:
        self.status_code = status_code
        super().__init__(message)


FORM = "application/x-www-form-urlencoded"


def json_body(request: Request) -> Any:
    """The request's parsed body. A JSON object sent as a form, as `curl -d '{…}'` sends it without a
    Content-Type, parses as one form key holding the whole text: refused with a 415 that says so, rather
    than a 400 naming that text as an unknown field."""
    body = request.data
    if (request.content_type or "").startswith(FORM) and any(str(k).lstrip().startswith("{") for k in body):
        raise Refused(
            415,
            "the body came as a form (curl -d sends one): send it as JSON, with the header "
            "'Content-Type: application/json'",
        )
    return body


def read_body(request: Request, serializer_class: type[serializers.Serializer]) -> dict[str, Any]:  # type: ignore[type-arg]
    """The body's fields, validated; a field the serializer does not name is refused rather than
    ignored: a misspelt one would otherwise change nothing and answer success."""
    body = json_body(request)
    if not isinstance(body, dict):
        raise ValidationError("the body must be a JSON object")
    unknown = sorted(set(body) - set(serializer_class().fields))
    if unknown:
        raise ValidationError(f"unknown field(s): {', '.join(map(str, unknown))}")
    serializer = serializer_class(data=body)
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)
