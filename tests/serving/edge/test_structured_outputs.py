"""Structured outputs through the `openai` client on the whole application and the random-weight demo
model (docs/api.md, "Structured outputs"): whatever the model writes, a json_schema response parses and
validates, json_object output parses, streaming concatenates to the JSON, and a schema that cannot be
enforced (or is too large) is a 400 saying why, before anything reaches a replica."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import openai
import pytest
from asgiref.sync import sync_to_async

from serving.edge import response_format as edge_format
from serving.engine import grammar as engine_grammar
from tests.serving.conftest import asgi_client

pytestmark = pytest.mark.django_db(transaction=True)

# Nested: objects, an array, enums, required fields, numbers with bounds; every string, array and number
# bounded, so that a completion closes well within MAX_TOKENS whatever the random model prefers.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "label": {"type": "string", "maxLength": 6},
                    "weight": {"type": "number", "minimum": 0, "maximum": 1},
                },
                "required": ["label"],
                "additionalProperties": False,
            },
            "maxItems": 2,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "kind", "address"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MAX_TOKENS = 200
HELLO = [{"role": "user", "content": "Describe a person as JSON."}]


def test_the_edge_compiles_with_the_engines_options() -> None:
    assert edge_format.JSON_COMPILE_OPTIONS == engine_grammar.JSON_COMPILE_OPTIONS


async def test_a_hundred_sampled_completions_all_parse_and_validate(
    openai_client: openai.AsyncOpenAI,
) -> None:
    """100 choices at temperature 1, each with a seed of its own (a request's choice i draws from
    seed + i), 10 requests of n=10 at once: constrained rows share the replica's steps."""
    responses = await asyncio.gather(
        *(
            openai_client.chat.completions.create(
                model="demo-chat",
                messages=HELLO,
                max_tokens=MAX_TOKENS,
                temperature=1.0,
                seed=1000 * request,
                n=10,
                response_format=JSON_SCHEMA,  # type: ignore[arg-type]
            )
            for request in range(10)
        )
    )
    choices = [choice for response in responses for choice in response.choices]
    assert len(choices) == 100
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
    assert len({choice.message.content for choice in choices}) > 90


async def test_json_object_output_parses(openai_client: openai.AsyncOpenAI) -> None:
    """Any object: the random model may ramble inside one past max_tokens (then it is an object's
    beginning, finish_reason "length", as OpenAI's); every one that ends is a whole object."""
    response = await openai_client.chat.completions.create(
        model="demo-chat",
        messages=HELLO,
        max_tokens=64,
        temperature=1.0,
        seed=0,
        n=8,
        response_format={"type": "json_object"},
    )
    ended = [c for c in response.choices if c.finish_reason == "stop"]
    assert ended
    for choice in response.choices:
        content = choice.message.content or ""
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(content), dict)
        else:
            assert choice.finish_reason == "length" and content.startswith("{")


async def test_a_constrained_and_a_free_request_together_give_what_they_give_alone(
    openai_client: openai.AsyncOpenAI,
) -> None:
    async def constrained() -> str:
        response = await openai_client.chat.completions.create(
            model="demo-chat",
            messages=HELLO,
            max_tokens=MAX_TOKENS,
            temperature=0,
            response_format=JSON_SCHEMA,  # type: ignore[arg-type]
        )
        return response.choices[0].message.content or ""

    async def free() -> str:
        response = await openai_client.chat.completions.create(
            model="demo-chat", messages=HELLO, max_tokens=32, temperature=0
        )
        return response.choices[0].message.content or ""

    alone = (await constrained(), await free())
    together = await asyncio.gather(constrained(), free())
    assert tuple(together) == alone
    jsonschema.validate(json.loads(alone[0]), SCHEMA)
    with pytest.raises(json.JSONDecodeError):
        json.loads(alone[1])  # unconstrained, the demo model writes word salad


async def test_a_streamed_constrained_response_concatenates_to_valid_json(
    openai_client: openai.AsyncOpenAI,
) -> None:
    whole = await openai_client.chat.completions.create(
        model="demo-chat",
        messages=HELLO,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=7,
        logprobs=True,
        response_format=JSON_SCHEMA,  # type: ignore[arg-type]
    )
    stream = await openai_client.chat.completions.create(
        model="demo-chat",
        messages=HELLO,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=7,
        stream=True,
        response_format=JSON_SCHEMA,  # type: ignore[arg-type]
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.content and all(e.logprob <= 0 for e in logprobs.content)


async def test_completions_and_infer_take_a_response_format_too(openai_client: openai.AsyncOpenAI) -> None:
    completion = await openai_client.completions.create(
        model="demo-chat",
        prompt="A person: ",
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=3,
        extra_body={"response_format": JSON_SCHEMA},
    )
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMA)
    async with asgi_client() as http:
        infer = await http.post(
            "/v1/models/demo-chat/infer",
            json={"input": "A person: ", "max_tokens": MAX_TOKENS, "seed": 4, "response_format": JSON_SCHEMA},
            headers={"Authorization": f"Bearer {openai_client.api_key}"},
        )
    assert infer.status_code == 200, infer.text
    assert infer.json()["finish_reason"] == "stop"
    jsonschema.validate(json.loads(infer.json()["output"]), SCHEMA)


def _schema_format(schema: Any, **spec: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, **spec}}


# Each refused at the edge with a message naming response_format and why.
REFUSED: list[tuple[Any, str]] = [
    (_schema_format({"type": "array", "uniqueItems": True}), 'Unimplemented keys: ["uniqueItems"]'),
    (_schema_format({"type": "string", "not": {"const": "a"}}), "not"),
    (_schema_format({"type": "string", "pattern": "(?<=a)b"}), "look-around"),
    (_schema_format({"$ref": "#/$defs/missing"}), "does not exist"),
    (_schema_format({"type": "strange"}), "strange"),
    # Over 64 KiB of JSON: an enum of 5,000 strings of 12 characters.
    (_schema_format({"enum": [f"value-{i:06d}" for i in range(5000)]}), "bytes of JSON; the limit is 65536"),
    ({"type": "xml"}, 'type must be "text", "json_object" or "json_schema"'),
    ("json", "must be an object"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "json_schema.name"),
    (_schema_format([1]), "json_schema.schema must be a JSON schema object"),
    (_schema_format({}, strict="yes"), "json_schema.strict"),
    (_schema_format({}, extra=1), "unsupported json_schema field(s): extra"),
    ({"type": "json_object", "schema": {}}, "unsupported field(s) for type 'json_object': schema"),
]


async def test_a_response_format_that_cannot_be_enforced_is_a_400_saying_why(
    runtime: Any, make_tenant: Any, settings: Any
) -> None:
    settings.ALLOWED_HOSTS = ["localhost"]
    acme = await sync_to_async(make_tenant)("acme", requests_per_second=1000)
    replica = next(iter(runtime.replicas.values()))
    async with asgi_client() as http:
        for response_format, fragment in REFUSED:
            for path, body in [
                ("/v1/chat/completions", {"model": "demo-chat", "messages": HELLO}),
                ("/v1/completions", {"model": "demo-chat", "prompt": "hi"}),
                ("/v1/models/demo-chat/infer", {"input": "hi"}),
            ]:
                body = {**body, "response_format": response_format}
                response = await http.post(path, json=body, headers=acme.auth)
                assert response.status_code == 400, (path, response_format, response.text)
                error = response.json()["error"]
                assert error["type"] == "invalid_request_error"
                message = error["message"]
                assert message.startswith("response_format: ") and fragment in message, message
    assert replica.engine.grammars.num_compiled == 0  # refused at the edge: nothing reached the replica
