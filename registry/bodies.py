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


def read_body(request: Request, serializer_class: type[serializers.Serializer]) -> dict[str, Any]:  # type: ignore[type-arg]
    """The body's fields, validated; a field the serializer does not name is refused rather than
    ignored: a misspelt one would otherwise change nothing and answer success."""
    body = request.data
    if not isinstance(body, dict):
        raise ValidationError("the body must be a JSON object")
    unknown = sorted(set(body) - set(serializer_class().fields))
    if unknown:
        raise ValidationError(f"unknown field(s): {', '.join(map(str, unknown))}")
    serializer = serializer_class(data=body)
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)
