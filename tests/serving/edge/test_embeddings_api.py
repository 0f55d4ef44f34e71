"""POST /v1/embeddings (the OpenAI shape) through the real ASGI application, the gateway and an
in-process replica of an embedding model, whose dynamic batcher groups concurrent requests."""

from __future__ import annotations

import asyncio
import base64
import math

import numpy as np
import pytest
from asgiref.sync import sync_to_async

from tests.serving.conftest import asgi_client, replica_of, serve_encoders

pytestmark = pytest.mark.django_db(transaction=True)

TEXTS = ["hello", "Readability counts.", "Once upon a time there was a little train", "The quick brown fox"]


@pytest.fixture
async def embedding_runtime(registered_model, registered_embedding_model, settings):  # type: ignore[no-untyped-def]
    """Both demo models served in process."""
    return await serve_encoders(settings)


@pytest.fixture
async def acme(make_tenant):  # type: ignore[no-untyped-def]
    return await sync_to_async(make_tenant)("acme")


def _embedding_replica(runtime):  # type: ignore[no-untyped-def]
    return replica_of(runtime, "demo-embed")


async def test_float_and_base64_encodings_give_the_same_normalized_vectors(acme, embedding_runtime) -> None:
    async with asgi_client() as client:
        as_float = await client.post(
            "/v1/embeddings", json={"model": "demo-embed", "input": TEXTS[:2]}, headers=acme.auth
        )
        as_base64 = await client.post(
            "/v1/embeddings",
            json={"model": "demo-embed", "input": TEXTS[:2], "encoding_format": "base64"},
            headers=acme.auth,
        )
        as_null = await client.post(  # null reads as absent: the default, float
            "/v1/embeddings",
            json={"model": "demo-embed", "input": TEXTS[:2], "encoding_format": None},
            headers=acme.auth,
        )
    assert as_float.status_code == 200, as_float.text
    assert as_null.status_code == 200 and as_null.json()["data"] == as_float.json()["data"]
    body = as_float.json()
    assert body["object"] == "list" and body["model"] == "demo-embed"
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert as_float.headers["X-Served-Version"] == "v1"
    replica = _embedding_replica(embedding_runtime)
    num_tokens = sum(len(replica.engine.encode(t)) for t in TEXTS[:2])
    assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    for as_list, as_text in zip(body["data"], as_base64.json()["data"], strict=True):
        vector = np.frombuffer(base64.b64decode(as_text["embedding"]), dtype="<f4")
        assert vector.tolist() == as_list["embedding"]  # float32 both ways, bit for bit
        assert len(vector) == replica.engine.dimension
        assert math.isclose(float(np.linalg.norm(vector)), 1.0, rel_tol=1e-5)


async def test_concurrent_requests_share_forward_passes_and_each_gets_its_own_vector(
    acme, embedding_runtime
) -> None:
    replica = _embedding_replica(embedding_runtime)
    batches_before = sum(replica.engine.batcher.num_closed.values())
    async with asgi_client() as client:
        responses = await asyncio.gather(
            *(
                client.post("/v1/embeddings", json={"model": "demo-embed", "input": text}, headers=acme.auth)
                for text in TEXTS * 2
            )
        )
    assert [r.status_code for r in responses] == [200] * 8
    vectors = np.array([r.json()["data"][0]["embedding"] for r in responses])
    # The same text, the same vector, whichever batch it was in (to float error: another batch pads it
    # to another length, and the matrix products then sum in another order); four different texts.
    np.testing.assert_allclose(vectors[:4], vectors[4:], atol=1e-5)
    assert min(np.linalg.norm(vectors[i] - vectors[j]) for i in range(4) for j in range(i)) > 1e-3
    # Eight requests in batches of at most four: fewer forward passes than requests.
    assert sum(replica.engine.batcher.num_closed.values()) - batches_before < 8
    await replica.wait_idle()  # set after the last step's metrics are recorded
    assert not replica.engine.has_unfinished()
    totals = replica.metrics.snapshot().totals
    closed = {k: v for k, v in totals.counters.items() if k.startswith("batches_closed.")}
    assert sum(closed.values()) == sum(replica.engine.batcher.num_closed.values())
    assert closed.get("batches_closed.full", 0) >= 1  # four of the eight made a full batch
    assert totals.histograms["batch_fill_s"].count == sum(closed.values())
    assert totals.counters["requests"] == 8 and totals.counters.get("empty_outputs", 0) == 0


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"model": "demo-embed", "input": []}, 400, "non-empty list of strings"),
        ({"model": "demo-embed", "input": [1, 2, 3]}, 400, "non-empty list of strings"),
        ({"model": "demo-embed", "input": ["ok", ""]}, 400, "input[1] is empty"),
        ({"model": "demo-embed", "input": ["x"] * 2049}, 400, "the limit is 2048"),
        ({"model": "demo-embed", "input": "x" * 40_000}, 400, "the limit is 32768"),
        ({"model": "demo-embed", "input": "hi", "dimensions": 8}, 400, "dimensions is not supported"),
        ({"model": "demo-embed", "input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
        # only absent or null defaults to "float": these used to read as it
        ({"model": "demo-embed", "input": "hi", "encoding_format": False}, 400, "encoding_format"),
        ({"model": "demo-embed", "input": "hi", "encoding_format": 0}, 400, "encoding_format"),
        ({"model": "demo-embed", "input": "hi", "encoding_format": ""}, 400, "encoding_format"),
        ({"model": "demo-embed", "input": "hi", "encoding_format": []}, 400, "encoding_format"),
        ({"model": "demo-embed", "input": "hi", "temperature": 0}, 400, "unsupported field(s): temperature"),
        ({"input": "hi"}, 400, "model must be a non-empty string"),
        (
            {"model": "demo-chat", "input": "hi"},
            400,
            "is of kind causal-lm; this endpoint serves embedding models",
        ),
        ({"model": "no-such-model", "input": "hi"}, 404, "not found"),
        # longer than the model's 512 positions: refused by the replica, nothing cut short
        ({"model": "demo-embed", "input": "word " * 600}, 400, "this model takes at most 512"),
    ],
)
async def test_bad_requests_get_the_json_error_and_leave_nothing_queued(
    acme, embedding_runtime, body: dict, status: int, message: str
) -> None:
    async with asgi_client() as client:
        response = await client.post("/v1/embeddings", json=body, headers=acme.auth)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"]
    assert not _embedding_replica(embedding_runtime).engine.has_unfinished()


async def test_bodies_that_are_not_json_and_other_methods_are_refused(acme, embedding_runtime) -> None:
    async with asgi_client() as client:
        not_json = await client.post("/v1/embeddings", content=b"{not json", headers=acme.auth)
        bad_utf8 = await client.post("/v1/embeddings", content=b'{"input": "\xff"}', headers=acme.auth)
        get = await client.get("/v1/embeddings", headers=acme.auth)
        no_key = await client.post("/v1/embeddings", json={"model": "demo-embed", "input": "hi"})
    assert (not_json.status_code, bad_utf8.status_code, get.status_code, no_key.status_code) == (
        400,
        400,
        405,
        401,
    )
    assert "valid JSON" in not_json.json()["error"]["message"]
    assert get.headers["Allow"] == "POST"  # as HTTP requires of a 405


async def test_an_embedding_model_is_refused_by_the_generative_endpoints(acme, embedding_runtime) -> None:
    async with asgi_client() as client:
        response = await client.post(
            "/v1/completions", json={"model": "demo-embed", "prompt": "hi"}, headers=acme.auth
        )
    assert response.status_code == 400
    assert (
        "is of kind embedding; this endpoint serves causal-lm models" in response.json()["error"]["message"]
    )


async def test_over_quota_is_a_429_while_another_tenant_is_served(
    make_tenant, acme, embedding_runtime
) -> None:
    flooder = await sync_to_async(make_tenant)("flooder", requests_per_second=0.001)
    body = {"model": "demo-embed", "input": "hi"}
    async with asgi_client() as client:
        statuses = [
            (await client.post("/v1/embeddings", json=body, headers=flooder.auth)).status_code
            for _ in range(3)
        ]
        refused = await client.post("/v1/embeddings", json=body, headers=flooder.auth)
        served = await client.post("/v1/embeddings", json=body, headers=acme.auth)
    assert statuses == [200, 429, 429]  # a burst of one request
    assert refused.status_code == 429 and "Retry-After" in refused.headers
    assert served.status_code == 200


async def test_the_tokens_per_minute_quota_is_charged_every_inputs_tokens(
    make_tenant, embedding_runtime
) -> None:
    """The replica's acceptance counts the tokens the gateway settles the quota with: an encoder's
    request is charged the tokens of all its inputs, as its usage reports them, not one per input."""
    from serving.gateway.quota_store import quota_store

    tenant = await sync_to_async(make_tenant)("counted", tokens_per_minute=1200)  # refills 20 a second
    texts = [" ".join(TEXTS) * 3, TEXTS[2] * 2]
    async with asgi_client() as client:
        response = await client.post(
            "/v1/embeddings", json={"model": "demo-embed", "input": texts}, headers=tenant.auth
        )
    assert response.status_code == 200, response.text
    used = quota_store().usage([tenant.context])[tenant.context.tenant_id]
    num_tokens = response.json()["usage"]["prompt_tokens"]
    assert num_tokens > 60
    assert used.num_in_flight == 0
    assert num_tokens - 20 < used.tokens_drawn <= num_tokens  # what refilled in the second since
