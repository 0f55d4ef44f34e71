"""OpenAI's `param` and `code` on an inference endpoint's HTTP error (docs/api.md, "Conventions"): the
request field a 400 names, and a machine-readable code for the refusals OpenAI's clients branch on. Read
from the refusal's own message, which names the field first ("temperature must be ...",
"response_format: ..."), so that no refusal site says it twice."""

from __future__ import annotations

import re

from serving.edge.openai_bodies import CHAT_FIELDS, COMPLETION_FIELDS, EMBEDDING_FIELDS
from serving.edge.request_bodies import INFER_FIELDS
from serving.gateway.errors import GatewayError

REQUEST_FIELDS = CHAT_FIELDS | COMPLETION_FIELDS | EMBEDDING_FIELDS | INFER_FIELDS
_LEADING_NAME = re.compile(r"^([a-z_]+)(?=[\s:\[(]|$)")
_CODES = (
    (404, re.compile(r"^model '.*' not found"), "model_not_found"),
    (400, re.compile(r"^this model's context is "), "context_length_exceeded"),
    (429, re.compile(r""), "rate_limit_exceeded"),
)


def param_of(status: int, message: str) -> str | None:
    """The request field a 400 is about, when its message starts with one; None otherwise."""
    if status != 400:
        return None
    match = _LEADING_NAME.match(message)
    return match.group(1) if match and match.group(1) in REQUEST_FIELDS else None


def code_of(status: int, message: str) -> str | None:
    for code_status, pattern, code in _CODES:
        if status == code_status and pattern.match(message):
            return code
    return None


def error_fields(exc: GatewayError) -> dict[str, str | None]:
    """A refusal's `param` and `code`, as registry.errors.error_response takes them."""
    return {"param": param_of(exc.status, exc.message), "code": code_of(exc.status, exc.message)}
