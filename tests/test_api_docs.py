"""docs/api.md against the OpenAPI schema the server publishes (/v1/schema, drf-spectacular's generator).

Every operation (method and path) in the schema has a section in docs/api.md's "Operations", and that
section documents no operation the schema lacks. Each section's summary lines must agree with the schema:

    - Body: `model` (required), `version` (required), `steps`     the JSON body's fields
    - Body, classify (classifier): `input` (required), `top_k`    one line per titled alternative
    - Query: `limit`                                              query parameters
    - Headers: `X-Version-Pin`                                    header parameters
    - Responses: 200, 400, 401                                    the status codes

A line that is absent documents none. A new endpoint therefore fails this test until its section is
written. The WebSocket routes are not in the OpenAPI schema: docs/api.md's "WebSocket" section has to
name each of them, and its text is not compared with anything."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.conftest import REPO_ROOT

API_DOC = REPO_ROOT / "docs" / "api.md"
METHODS = ("get", "put", "post", "delete", "patch", "head", "options", "trace")
HEADING = re.compile(r"^### `([A-Z]+) (/\S*)`\s*$")
SUMMARY = re.compile(r"^- (?P<kind>Body|Query|Headers|Responses)(?:, (?P<title>[^:]+))?: (?P<rest>.*)$")
FIELD = re.compile(r"`([^`]+)`( \(required\))?")

Operation = tuple[str, str]  # ("POST", "/v1/deployments")
# Per operation: ("Body", alternative title or "") -> {field: required}; ("Query" | "Headers", "") -> the
# same with required False; ("Responses", "") -> {status code: False}.
Summary = dict[tuple[str, str], dict[str, bool]]


def _section(text: str, title: str) -> str:
    """The body of the level-2 section `title`, up to the next level-2 heading."""
    match = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match is not None, f"docs/api.md has no '## {title}' section"
    return match.group(1)


def documented_operations(text: str) -> dict[Operation, Summary]:
    operations: dict[Operation, Summary] = {}
    current: Summary | None = None
    for line in _section(text, "Operations").splitlines():
        heading = HEADING.match(line)
        if heading:
            operation = (heading.group(1), heading.group(2))
            assert operation not in operations, f"{operation} is documented twice"
            current = operations[operation] = {}
            continue
        summary = SUMMARY.match(line)
        if summary and current is not None:
            kind, title, rest = summary.group("kind"), summary.group("title") or "", summary.group("rest")
            key = (kind, title)
            assert key not in current, f"{kind} {title!r} twice in one section"
            if kind == "Responses":
                current[key] = dict.fromkeys(re.findall(r"\b\d{3}\b", rest), False)
            else:
                current[key] = {name: bool(required) for name, required in FIELD.findall(rest)}
    return operations


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = schema["components"]["schemas"][node["$ref"].rsplit("/", 1)[-1]]
    return node


def _fields(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, bool]:
    node = _resolve(schema, node)
    required = set(node.get("required", ()))
    return {name: name in required for name in node.get("properties", {})}


def schema_summary(schema: dict[str, Any], operation: dict[str, Any]) -> Summary:
    summary: Summary = {("Responses", ""): dict.fromkeys(operation.get("responses", {}), False)}
    body = operation.get("requestBody", {}).get("content", {}).get("application/json")
    if body is not None:
        node = _resolve(schema, body.get("schema", {}))
        alternatives = node.get("anyOf") or node.get("oneOf")
        if alternatives:
            for alternative in alternatives:
                alternative = _resolve(schema, alternative)
                summary[("Body", alternative.get("title", ""))] = _fields(schema, alternative)
        else:
            summary[("Body", "")] = _fields(schema, node)
    for kind, location in (("Query", "query"), ("Headers", "header")):
        names = [p["name"] for p in operation.get("parameters", ()) if p.get("in") == location]
        if names:
            summary[(kind, "")] = dict.fromkeys(names, False)
    return summary


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    from drf_spectacular.generators import SchemaGenerator

    # What GET /v1/schema and `manage.py spectacular` serve: the public schema, for no particular caller.
    return SchemaGenerator().get_schema(request=None, public=True)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def documented() -> dict[Operation, Summary]:
    return documented_operations(API_DOC.read_text())


def _schema_operations(schema: dict[str, Any]) -> dict[Operation, dict[str, Any]]:
    return {
        (method.upper(), path): operation
        for path, item in schema["paths"].items()
        for method, operation in item.items()
        if method in METHODS
    }


def test_every_operation_in_the_schema_is_documented_and_no_other(
    schema: dict[str, Any], documented: dict[Operation, Summary]
) -> None:
    in_schema = set(_schema_operations(schema))
    missing = sorted(in_schema - set(documented))
    extra = sorted(set(documented) - in_schema)
    assert not missing, f"docs/api.md has no '### `METHOD PATH`' section under Operations for {missing}"
    assert not extra, f"docs/api.md documents operations the schema does not have: {extra}"


def test_each_documented_body_parameter_and_status_matches_the_schema(
    schema: dict[str, Any], documented: dict[Operation, Summary]
) -> None:
    disagreements = []
    for operation, spec in _schema_operations(schema).items():
        if operation not in documented:
            continue  # the test above names it
        expected, written = schema_summary(schema, spec), documented[operation]
        for key in sorted(set(expected) | set(written)):
            if expected.get(key, {}) != written.get(key, {}):
                line = f"- {key[0]}{', ' + key[1] if key[1] else ''}"
                disagreements.append(
                    f"{' '.join(operation)}: '{line}' documents {written.get(key, {})}, "
                    f"the schema has {expected.get(key, {})}"
                )
    assert not disagreements, "\n".join(disagreements)


def test_every_websocket_route_is_documented() -> None:
    from config.routing import websocket_urlpatterns

    section = _section(API_DOC.read_text(), "WebSocket")
    routes = [str(p.pattern) for p in websocket_urlpatterns if str(p.pattern) != "(?s)^.*$"]  # the 404
    paths = [re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", route) for route in routes]
    assert routes  # the platform serves WebSockets: a change to config.routing must not empty this test
    assert not [p for p in paths if f"/{p}`" not in section], section
