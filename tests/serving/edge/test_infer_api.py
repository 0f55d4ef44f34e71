"""The inference endpoint's gateway path: every refusal happens before a replica is involved."""

import json

import pytest
from django.test import AsyncClient

from tests.serving.conftest import asgi_client

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/v1/models/demo-chat/infer"


async def _post(
    client: AsyncClient, body: object, headers: dict[str, str], url: str = URL, raw: bytes | None = None
):
    data = raw if raw is not None else json.dumps(body)
    return await client.post(url, data=data, content_type="application/json", headers=headers)


@pytest.mark.parametrize(
    "name", ["demo-chat\x00", "Demo-Chat", "x" * 300], ids=["a NUL", "capitals", "too long"]
)
async def test_a_model_name_no_model_can_have_is_404_without_a_database_read(acme, name, monkeypatch) -> None:
    """Postgres refuses a NUL in a query, which the routing cache took for the table being unavailable
    (a 503 to retry); a name outside the registry's pattern is answered without asking."""
    from serving.gateway import router

    def no_read(**kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the routing table was read")

    monkeypatch.setattr(router, "routing_revision", no_read)
    monkeypatch.setattr(router, "routing_snapshot", no_read)
    body = {"model": name, "prompt": "hi", "max_tokens": 1}
    response = await _post(AsyncClient(), body, acme.auth, url="/v1/completions")
    assert response.status_code == 404, response.content
    assert response.json()["error"]["type"] == "not_found_error"


async def test_missing_or_bad_key_is_401(acme) -> None:
    client = AsyncClient()
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic abc"}):
        response = await _post(client, {"input": "hi"}, headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"


async def test_unknown_model_is_404(acme) -> None:
    response = await _post(AsyncClient(), {"input": "hi"}, acme.auth, url="/v1/models/nope/infer")
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "type": "not_found_error",
            "message": "model 'nope' not found",
            "param": None,
            "code": "model_not_found",  # OpenAI's
        }
    }


async def test_a_tenant_not_allowed_the_model_is_403(make_tenant, registered_model, demo_model_dir) -> None:
    from asgiref.sync import sync_to_async

    from registry.services import model_version_register

    other = await sync_to_async(model_version_register)(name="other", version="v1", source_dir=demo_model_dir)
    limited = await sync_to_async(make_tenant)("limited", allowed_models=[other.model])
    response = await _post(AsyncClient(), {"input": "hi"}, limited.auth)
    assert response.status_code == 403
    assert "may not use model 'demo-chat'" in response.json()["error"]["message"]


async def test_pinning_without_permission_is_403(acme) -> None:
    response = await _post(AsyncClient(), {"input": "hi"}, {**acme.auth, "X-Version-Pin": "v1"})
    assert response.status_code == 403
    assert "may not pin" in response.json()["error"]["message"]


async def test_a_request_its_replica_refuses_says_which_version_refused_it(acme) -> None:
    """A token id past the model's vocabulary is the replica's to refuse (the gateway does not know the
    vocabulary): with a split over versions of different vocabularies, the client must be able to tell
    which refused it, as a served response says which version served it."""
    body = {"input": "hi", "max_tokens": 1, "logit_bias": {"99999999": 1}}
    response = await _post(AsyncClient(), body, acme.auth)
    assert response.status_code == 400, response.content
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert response["X-Served-Version"] == "v1" and response["X-Request-Id"]


@pytest.mark.parametrize("url", [URL, "/v1/completions", "/v1/chat/completions"])
async def test_another_method_is_a_405_that_names_post(acme, url: str) -> None:
    response = await AsyncClient().get(url, headers=acme.auth)
    assert response.status_code == 405 and response["Allow"] == "POST"
    assert response.json()["error"]["type"] == "method_not_allowed"


async def test_an_empty_or_blank_version_pin_header_is_no_pin(acme) -> None:
    """A proxy or a client library can send the header with nothing in it: that names no version, so a
    tenant without the right to pin is served by the traffic split rather than refused."""
    for blank in ("", "   "):
        response = await _post(
            AsyncClient(), {"input": "hi", "max_tokens": 1}, {**acme.auth, "X-Version-Pin": blank}
        )
        assert response.status_code == 200, (blank, response.content)
        assert response["X-Served-Version"] == "v1"


@pytest.mark.parametrize(
    ("body", "raw", "status", "fragment"),
    [
        (None, b"{not json", 400, "not valid JSON"),
        (None, b'{"input": "hi", "max_tokens": ' + b"9" * 5000 + b"}", 400, "not valid JSON"),  # 4,300 digits
        (None, b"[" * 5000 + b"]" * 5000, 400, "nested too deeply"),
        ([1, 2], None, 400, "JSON object"),
        ({}, None, 400, "input must be a non-empty string"),
        ({"input": 5}, None, 400, "input must be a non-empty string"),
        ({"input": "hi", "max_tokens": 0}, None, 400, "max_tokens"),
        ({"input": "hi", "max_tokens": 10**6}, None, 400, "max_tokens"),
        ({"input": "hi", "max_tokens": "5"}, None, 400, "max_tokens"),
        ({"input": "hi", "max_tokens": True}, None, 400, "max_tokens"),
        ({"input": "hi", "temperature": -1}, None, 400, "temperature"),
        ({"input": "hi", "top_p": 0}, None, 400, "top_p"),
        ({"input": "hi", "stream": "yes"}, None, 400, "stream"),
        ({"input": "hi", "stop": [""]}, None, 400, "stop"),
        ({"input": "hi", "seed": 2**63}, None, 400, "seed"),
        ({"input": "hi", "bogus": 1}, None, 400, "unknown field(s): bogus"),
        ({"input": "hi", "frequency_penalty": 2.5}, None, 400, "frequency_penalty"),
        ({"input": "hi", "presence_penalty": "1"}, None, 400, "presence_penalty"),
        ({"input": "hi", "logit_bias": [[1, 2]]}, None, 400, "logit_bias must be an object"),
        ({"input": "hi", "logit_bias": {"x": 1}}, None, 400, "token ids"),
        ({"input": "hi", "logit_bias": {"-1": 1}}, None, 400, "token ids"),
        ({"input": "hi", "logit_bias": {"5": 100, "05": 100}}, None, 400, "token ids"),  # one id, twice
        ({"input": "hi", "temperature": 10**400}, None, 400, "temperature"),
        ({"input": "hi", "logit_bias": {"5": 101}}, None, 400, "from -100 to 100"),
        ({"input": "hi", "logit_bias": {str(i): 1 for i in range(301)}}, None, 400, "at most 300"),
        ({"input": "hi", "logit_bias": {"99999999": 1}}, None, 400, "vocabulary"),  # the replica's check
        ({"input": "x" * 40_000}, None, 400, "limit is 32768"),
    ],
)
async def test_bad_bodies_get_the_json_error_before_any_model_work(acme, body, raw, status, fragment) -> None:
    response = await _post(AsyncClient(), body, acme.auth, raw=raw)
    assert response.status_code == status
    error = response.json()["error"]
    assert fragment in error["message"]
    assert set(error) == {"type", "message", "param", "code"}  # OpenAI's four


@pytest.mark.parametrize(
    ("method", "url"),
    [
        ("POST", "/v1/chat/completions"),  # the inference endpoints' own handler and middleware
        ("POST", URL),
        ("GET", "/v1/models"),  # the control plane's, under Django's full middleware
    ],
)
async def test_a_host_outside_allowed_hosts_gets_the_json_error_under_v1(settings, method, url) -> None:
    """Django's 400 handler answered with its HTML page, "Bad Request (400)", which no API client reads."""
    settings.ALLOWED_HOSTS = ["localhost"]
    async with asgi_client() as client:
        response = await client.request(method, url, json={}, headers={"Host": "evil.example"})
        page = await client.get("/dashboard/", headers={"Host": "evil.example"})
    assert response.status_code == 400, response.text
    assert response.headers["Content-Type"] == "application/json"
    assert response.json() == {
        "error": {
            "type": "invalid_request_error",
            "message": "the Host header names no host this server answers for",
        }
    }
    # Outside /v1/ (the dashboard, the admin), Django's page as before.
    assert page.status_code == 400 and page.headers["Content-Type"].startswith("text/html")


async def test_an_oversized_body_is_413(acme, settings) -> None:
    response = await _post(AsyncClient(), None, acme.auth, raw=b'{"input": "' + b"a" * 300_000 + b'"}')
    assert response.status_code == 413


async def test_over_the_request_rate_is_429_with_retry_after_while_others_are_served(
    make_tenant, runtime
) -> None:
    from asgiref.sync import sync_to_async

    slow = await sync_to_async(make_tenant)("slow", requests_per_second=0.5)
    fast = await sync_to_async(make_tenant)("fast")
    client = AsyncClient()
    body = {"input": "hello", "max_tokens": 4, "temperature": 0}

    first = await _post(client, body, slow.auth)
    assert first.status_code == 200, first.content
    refused = await _post(client, body, slow.auth)
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert int(refused["Retry-After"]) >= 1

    served = await _post(client, body, fast.auth)
    assert served.status_code == 200
    assert served["X-Served-Version"] == "v1"
    assert served.json()["usage"]["completion_tokens"] == 4


async def test_streaming_infer_sends_one_event_per_token_then_the_final_event(acme) -> None:
    response = await _post(
        AsyncClient(), {"input": "hello", "max_tokens": 6, "stream": True, "temperature": 0}, acme.auth
    )
    assert response.status_code == 200
    assert response["Content-Type"] == "text/event-stream"
    assert response["X-Served-Version"] == "v1"
    chunks = [chunk async for chunk in response.streaming_content]
    events = [json.loads(line[6:]) for line in b"".join(chunks).decode().split("\n\n") if line]
    assert [e["index"] for e in events[:-1]] == list(range(6))
    assert events[-1]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 6


async def test_a_stream_gets_its_status_and_headers_before_its_first_forward_pass_ends(acme, runtime) -> None:
    """The replica accepts a request before running the step that prefills it, so the response starts
    while the prompt is being prefilled instead of on the first token's path."""
    import asyncio
    import threading

    engine = runtime.replicas[("demo-chat", "v1")].engine
    release = threading.Event()
    real_step = engine.step

    def held_step():  # type: ignore[no-untyped-def]
        release.wait(timeout=30)  # no step of this request can end before the test lets it
        return real_step()

    engine.step = held_step
    try:
        async with asyncio.timeout(10):
            response = await _post(
                AsyncClient(),
                {"input": "hello", "max_tokens": 3, "stream": True, "temperature": 0},
                acme.auth,
            )
        assert response.status_code == 200
        assert response["X-Served-Version"] == "v1"
    finally:
        release.set()
    body = b"".join([chunk async for chunk in response.streaming_content]).decode()
    events = [json.loads(line[6:]) for line in body.split("\n\n") if line]
    assert [e["index"] for e in events[:-1]] == [0, 1, 2]
    assert events[-1]["finish_reason"] == "length"


async def test_seeded_sampling_reproduces_and_greedy_is_deterministic(acme) -> None:
    client = AsyncClient()

    async def output(body: dict[str, object]) -> str:
        response = await _post(client, {"input": "hello", "max_tokens": 8, **body}, acme.auth)
        assert response.status_code == 200
        return response.json()["output"]

    assert await output({"temperature": 0}) == await output({"temperature": 0})
    assert await output({"seed": 7}) == await output({"seed": 7})


async def test_a_pinned_version_is_served_when_allowed(
    make_tenant, runtime, demo_model_dir, settings
) -> None:  # type: ignore[no-untyped-def]
    from asgiref.sync import sync_to_async

    from registry.services import model_version_register

    await sync_to_async(model_version_register)(name="demo-chat", version="v2", source_dir=demo_model_dir)
    pinner = await sync_to_async(make_tenant)("pinner", may_pin=True)
    client = AsyncClient()
    # v2 has no traffic, so no embedded replica: the pin is honoured (not silently rerouted), by a
    # replica started for it (tests/serving/runtime/test_pins.py), or, past REPLICA_MAX_PINNED, a 503.
    settings.REPLICA_MAX_PINNED = 0
    response = await _post(client, {"input": "hi"}, {**pinner.auth, "X-Version-Pin": "v2"})
    assert response.status_code == 503
    assert "v2" in response.json()["error"]["message"]
    response = await _post(client, {"input": "hi", "max_tokens": 2}, {**pinner.auth, "X-Version-Pin": "v1"})
    assert response.status_code == 200 and response["X-Served-Version"] == "v1"
    response = await _post(client, {"input": "hi"}, {**pinner.auth, "X-Version-Pin": "v9"})
    assert response.status_code == 404


async def test_an_alias_other_than_stable_chooses_a_version_as_a_pin_does(make_tenant, runtime) -> None:
    """`canary` points at a deployment's candidate: a tenant without the right to pin could otherwise send
    it all the traffic it liked and steer the rollout judge. `stable` is anyone's."""
    from asgiref.sync import sync_to_async

    from registry.models import ModelVersion
    from registry.services import alias_set

    v1 = await sync_to_async(ModelVersion.objects.select_related("model").get)(model__name="demo-chat")
    await sync_to_async(alias_set)(model=v1.model, name="canary", version=v1, actor="test")
    user = await sync_to_async(make_tenant)("user")
    pinner = await sync_to_async(make_tenant)("pinner", may_pin=True)
    client, body = AsyncClient(), {"input": "hi", "max_tokens": 1}
    refused = await _post(client, body, user.auth, url="/v1/models/demo-chat@canary/infer")
    assert refused.status_code == 403
    assert "may not choose a version by alias (demo-chat@canary)" in refused.json()["error"]["message"]
    for tenant, alias in ((user, "stable"), (pinner, "canary"), (pinner, "stable")):
        served = await _post(client, body, tenant.auth, url=f"/v1/models/demo-chat@{alias}/infer")
        assert served.status_code == 200 and served["X-Served-Version"] == "v1", (tenant, alias)


@pytest.mark.parametrize(
    ("url", "body"),
    [
        (URL, b'{"input": "my number is 123-45-6789 \\ud800"}'),
        (
            "/v1/chat/completions",
            b'{"model": "demo-chat", "messages": [{"role": "user", "content": "\\udc00"}]}',
        ),
    ],
    ids=["infer", "chat"],
)
async def test_an_escaped_lone_surrogate_is_a_400_before_anything_is_sent(acme, url, body, caplog) -> None:
    """JSON lets a string hold half a UTF-16 pair, which is no text: on the Redis layer its encoder
    failed with the whole prompt in the error, logged, and the client got a 503 to retry for ever."""
    response = await _post(AsyncClient(), None, acme.auth, url=url, raw=body)
    assert response.status_code == 400, response.content
    assert "surrogate" in response.json()["error"]["message"]
    assert "123-45-6789" not in caplog.text
    # Nor unescaped: UTF-8's encoding of a surrogate (which json.loads would decode, surrogatepass), or
    # a body in UTF-16 (JSON on the wire is UTF-8).
    for other in (
        body.replace(b"\\ud800", b"\xed\xa0\x80").replace(b"\\udc00", b"\xed\xb0\x80"),
        body.decode().encode("utf-16"),
    ):
        response = await _post(AsyncClient(), None, acme.auth, url=url, raw=other)
        assert response.status_code == 400, response.content
        assert "not valid JSON" in response.json()["error"]["message"]  # at the edge, not by a replica
    # A whole pair is one character, and welcome.
    pair = body.replace(b"\\ud800", b"\\ud83d\\ude00").replace(b"\\udc00", b"\\ud83d\\ude00")
    assert (await _post(AsyncClient(), None, acme.auth, url=url, raw=pair)).status_code == 200


@pytest.mark.parametrize("escape", ['"\\ud800"', '"a"'])
def test_json_nested_to_any_depth_parses_or_is_a_value_error(escape: str) -> None:
    """Near the recursion limit a body can parse and then fail the lone-surrogate check, which nests one
    call deeper: still the 400's ValueError, never a RecursionError (a 500, or a WebSocket dropped
    without its error message)."""
    import contextlib

    from serving.edge.request_bodies import loads_json

    for depth in range(1, 1500):
        with contextlib.suppress(ValueError):
            loads_json("[" * depth + escape + "]" * depth)
