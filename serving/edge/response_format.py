"""`response_format` checked at the edge (docs/api.md, "Structured outputs"): OpenAI's three shapes, a
schema's size, and whether llguidance can compile it, all before anything is sent or allocated. What
crosses to the replica is the response_format itself, as plain JSON in the submission's params; the
replica compiles it again, against its model's tokenizer (serving/engine/grammar.py).

Compiling here needs no tokenizer and no torch (llguidance's core is a Rust extension): ~0.1-0.6 ms
for a typical schema, and the verdicts of the last few hundred distinct schemas are kept, so a client
that sends one schema with every request pays it once.
"""

from __future__ import annotations

import functools
import json
import re
from typing import TYPE_CHECKING, Any

from django.conf import settings
from llguidance import LLMatcher

from serving.gateway.errors import GatewayError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# The engine's own options (serving/engine/grammar.py, JSON_COMPILE_OPTIONS); a test holds them equal.
JSON_COMPILE_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # as OpenAI's json_schema.name
_FORMAT_FIELDS = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
_JSON_SCHEMA_FIELDS = frozenset({"name", "description", "schema", "strict"})


def _refuse(message: str) -> GatewayError:
    return GatewayError(400, f"response_format: {message}")


def parse_response_format(value: Any) -> dict[str, Any] | None:
    """The response_format to send the replica, or None where there is nothing to constrain (absent,
    null, or {"type": "text"}). Raises GatewayError(400), naming response_format and why, for any other
    shape, a schema over MAX_RESPONSE_SCHEMA_BYTES, or one llguidance cannot compile."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _refuse('must be an object, {"type": "text" | "json_object" | "json_schema", …}')
    kind = value.get("type")
    if not isinstance(kind, str) or kind not in _FORMAT_FIELDS:
        raise _refuse('type must be "text", "json_object" or "json_schema"')
    unknown = sorted(k for k, v in value.items() if k not in _FORMAT_FIELDS[kind] and v is not None)
    if unknown:
        raise _refuse(f"unsupported field(s) for type {kind!r}: {', '.join(unknown)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _refuse('json_schema must be an object: {"name": …, "schema": {…}, "strict": true}')
    unknown = sorted(k for k, v in spec.items() if k not in _JSON_SCHEMA_FIELDS and v is not None)
    if unknown:
        raise _refuse(f"unsupported json_schema field(s): {', '.join(unknown)}")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _refuse("json_schema.name must be 1 to 64 letters, digits, underscores or dashes")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _refuse("json_schema.strict must be true or false")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise _refuse("json_schema.schema must be a JSON schema object")
    compact = json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    size = len(compact.encode())
    if size > settings.MAX_RESPONSE_SCHEMA_BYTES:
        raise _refuse(
            f"json_schema.schema is {size} bytes of JSON; the limit is {settings.MAX_RESPONSE_SCHEMA_BYTES}"
        )
    error = compile_error(compact)
    if error:
        raise _refuse(f"the schema cannot be enforced: {error}")
    # Always enforced, strict or not: a schema we accept is one the output will match.
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@functools.lru_cache(maxsize=256)
def compile_error(schema_json: str) -> str:
    """Why llguidance cannot compile this schema (its canonical JSON) into a grammar; "" if it can."""
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema_json, defaults=JSON_COMPILE_OPTIONS)
    except ValueError as exc:
        return str(exc)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return (messages[0] if messages else "it does not compile") if is_error else ""
