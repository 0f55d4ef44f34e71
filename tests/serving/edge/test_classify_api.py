"""A text classifier behind POST /v1/models/{model}/infer, through the real ASGI application, the gateway
and an in-process replica whose dynamic batcher groups concurrent requests."""

from __future__ import annotations

import asyncio
import math

import pytest
from asgiref.sync import sync_to_async

from tests.serving.conftest import asgi_client, replica_of, serve_encoders

pytestmark = pytest.mark.django_db(transaction=True)

TEXTS = ["hello", "Readability counts.", "Once upon a time there was a little train", "The quick brown fox"]
INFER = "/v1/models/demo-classify/infer"


@pytest.fixture
async def classifier_runtime(  # type: ignore[no-untyped-def]
    registered_model, registered_classifier, registered_embedding_model, settings
):
    """The demo chat model, the classifier and an embedding model served in process."""
    return await serve_encoders(settings)


@pytest.fixture
async def failing_classifier_runtime(registered_classifier, settings):  # type: ignore[no-untyped-def]
    """The classifier alone, its replica failing every request it accepts (fault injection)."""
    settings.DEBUG = True  # fault injection is refused otherwise
    settings.FAULTS = "demo-classify:v1=error_rate:1"
    return await serve_encoders(settings)


@pytest.fixture
async def acme(make_tenant):  # type: ignore[no-untyped-def]
    return await sync_to_async(make_tenant)("acme")


def _replica(runtime):  # type: ignore[no-untyped-def]
    return replica_of(runtime, "demo-classify")


async def test_each_input_gets_every_label_scored_best_first(acme, classifier_runtime) -> None:
    async with asgi_client() as client:
        response = await client.post(INFER, json={"input": TEXTS[:2]}, headers=acme.auth)
    assert response.status_code == 200, response.text
    assert response.headers["X-Served-Version"] == "v1"
    body = response.json()
    assert (body["object"], body["model"], body["version"]) == ("classification", "demo-classify", "v1")
    assert len(body["predictions"]) == 2
    replica = _replica(classifier_runtime)
    for text, labels in zip(TEXTS[:2], body["predictions"], strict=True):
        assert {p["label"] for p in labels} == {"negative", "positive"}
        scores = [p["score"] for p in labels]
        assert scores == sorted(scores, reverse=True)
        assert math.isclose(sum(scores), 1.0, rel_tol=1e-5)  # a single-label model's softmax
        # the engine's own scores for this text alone, run outside the platform
        alone = replica.engine._forward([replica.engine.encode(text)])[0].tolist()
        by_label = {p["label"]: p["score"] for p in labels}
        assert [by_label["negative"], by_label["positive"]] == pytest.approx(alone, abs=1e-5)
    num_tokens = sum(len(replica.engine.encode(t)) for t in TEXTS[:2])
    assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}


async def test_top_k_keeps_the_best_labels_and_one_text_is_a_list_of_one(acme, classifier_runtime) -> None:
    async with asgi_client() as client:
        every = await client.post(INFER, json={"input": TEXTS[0]}, headers=acme.auth)
        best = await client.post(INFER, json={"input": TEXTS[0], "top_k": 1}, headers=acme.auth)
    assert every.status_code == best.status_code == 200
    (labels,) = every.json()["predictions"]
    assert best.json()["predictions"] == [labels[:1]]


async def test_concurrent_requests_share_forward_passes(acme, classifier_runtime) -> None:
    replica = _replica(classifier_runtime)
    batches_before = sum(replica.engine.batcher.num_closed.values())
    async with asgi_client() as client:
        responses = await asyncio.gather(
            *(client.post(INFER, json={"input": text}, headers=acme.auth) for text in TEXTS * 2)
        )
    assert [r.status_code for r in responses] == [200] * 8
    scores = [{p["label"]: p["score"] for p in r.json()["predictions"][0]} for r in responses]
    for first, again in zip(scores[:4], scores[4:], strict=True):  # the same text, the same scores
        assert first == pytest.approx(again, abs=1e-5)
    assert sum(replica.engine.batcher.num_closed.values()) - batches_before < 8
    await replica.wait_idle()
    assert not replica.engine.has_unfinished()
    totals = replica.metrics.snapshot().totals
    assert totals.counters["requests"] == 8 and totals.counters.get("empty_outputs", 0) == 0


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        (INFER, {"input": []}, 400, "non-empty list of strings"),
        (INFER, {"input": ["ok", ""]}, 400, "input[1] is empty"),
        (INFER, {"input": ["x"] * 2049}, 400, "the limit is 2048"),
        (INFER, {"input": "x" * 40_000}, 400, "the limit is 32768"),
        (INFER, {"input": "hi", "top_k": 0}, 400, "top_k must be a positive integer"),
        (INFER, {"input": "hi", "top_k": "2"}, 400, "top_k must be a positive integer"),
        (INFER, {"input": "hi", "stream": True}, 400, "unknown field(s) for a classifier: stream"),
        (INFER, {"input": "hi", "max_tokens": 4}, 400, "unknown field(s) for a classifier: max_tokens"),
        # longer than the model's 512 positions: refused by the replica, nothing cut short
        (INFER, {"input": "word " * 600}, 400, "this model takes at most 512"),
        (
            "/v1/completions",
            {"model": "demo-classify", "prompt": "hi"},
            400,
            "is of kind classifier; this endpoint serves causal-lm models",
        ),
        ("/v1/embeddings", {"model": "demo-classify", "input": "hi"}, 400, "is of kind classifier"),
        (
            "/v1/models/demo-embed/infer",
            {"input": "hi"},
            400,
            "is an embedding model: use POST /v1/embeddings",
        ),
        ("/v1/models/demo-clasify/infer", {"input": ["hi"]}, 404, "model 'demo-clasify' not found"),
    ],
)
async def test_bad_requests_get_the_json_error_and_leave_nothing_queued(
    acme, classifier_runtime, path: str, body: dict, status: int, message: str
) -> None:
    async with asgi_client() as client:
        response = await client.post(path, json=body, headers=acme.auth)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"]
    assert not _replica(classifier_runtime).engine.has_unfinished()


async def test_a_tenant_not_allowed_the_classifier_learns_nothing_of_it(
    make_tenant, registered_model, classifier_runtime
) -> None:
    other = await sync_to_async(make_tenant)("other", allowed_models=[registered_model.model])
    async with asgi_client() as client:
        refused = await client.post(INFER, json={"input": "hi", "max_tokens": 4}, headers=other.auth)
        not_json = await client.post(INFER, content=b"{not json", headers=other.auth)
    # 403 before the body is read as a classifier's: neither its kind nor its fields give it away
    assert (refused.status_code, not_json.status_code) == (403, 403)
    assert "may not use model 'demo-classify'" in refused.json()["error"]["message"]


async def test_a_replica_that_fails_the_request_gives_a_503_that_names_the_version(
    acme, failing_classifier_runtime
) -> None:
    async with asgi_client() as client:
        response = await client.post(INFER, json={"input": ["hello", "world"]}, headers=acme.auth)
    assert response.status_code == 503, response.text
    assert "injected fault" in response.json()["error"]["message"]
    assert response.headers["X-Served-Version"] == "v1" and response.headers["X-Request-Id"]
    replica = _replica(failing_classifier_runtime)
    await replica.wait_idle()
    assert not replica.engine.has_unfinished()  # the failed request's inputs left the batcher
