"""Shadow traffic in the embedded mode: a copy of each request runs on the mirror version, the client
only ever sees the primary, and the candidate's replica records the copies and how their text compared."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def other_weights_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from serving.engine.demo_model import DemoModelSpec, build_demo_model

    # The conftest demo model's shape with other random weights: same tokenizer, different text.
    spec = DemoModelSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    return build_demo_model(tmp_path_factory.mktemp("other-weights"), replace(spec, seed=1))


def _mirror_to(source_dir: Path, pct: int) -> None:
    from registry.services import alias_set, model_version_register, routing_mirror_set

    v2 = model_version_register(name="demo-chat", version="v2", source_dir=source_dir, created_by="test")
    alias_set(model=v2.model, name="canary", version=v2, actor="test")  # the alias gives it a replica
    routing_mirror_set(model=v2.model, version=v2, pct=pct)


async def _serve(acme, num_requests: int, **body: object) -> list[str]:
    served = []
    for i in range(num_requests):
        response = await AsyncClient().post(
            "/v1/models/demo-chat/infer",
            data=json.dumps({"input": f"hello {i}", "max_tokens": 8, **body}),
            content_type="application/json",
            headers=acme.auth,
        )
        assert response.status_code == 200, response.content
        served.append(response.headers["X-Served-Version"])
    return served


async def _windows(runtime, started: datetime) -> dict[str, object]:
    from serving.gateway import shadow
    from serving.telemetry.metrics_reads import version_window

    await shadow.wait_idle()
    for replica in runtime.replicas.values():
        await replica.flush_metrics()
    end = datetime.now(tz=UTC) + timedelta(seconds=5)
    return {
        version: await sync_to_async(version_window)(
            model_name="demo-chat", version=version, start=started, end=end
        )
        for version in ("v1", "v2")
    }


async def _start(make_tenant):  # type: ignore[no-untyped-def]
    from serving.runtime import get_runtime

    runtime = await get_runtime()
    assert await runtime.wait_ready()
    assert ("demo-chat", "v2") in runtime.replicas
    return runtime, await sync_to_async(make_tenant)("acme")


async def test_every_request_is_copied_to_the_mirror_and_same_weights_match(
    make_tenant, registered_model, demo_model_dir
) -> None:
    await sync_to_async(_mirror_to)(demo_model_dir, 100)
    runtime, acme = await _start(make_tenant)
    started = datetime.now(tz=UTC) - timedelta(seconds=5)

    assert await _serve(acme, 6, temperature=0) == ["v1"] * 6  # clients only see the primary
    windows = await _windows(runtime, started)
    v1, v2 = windows["v1"], windows["v2"]
    assert v1.num_requests == 6 and v2.num_requests == 6  # the copies are recorded like requests
    assert (v2.num_shadow_compared, v2.num_shadow_matched) == (6, 6)
    assert v2.output_tokens == 6 * 8


async def test_other_weights_do_not_match_and_unseeded_sampling_is_not_compared(
    make_tenant, registered_model, other_weights_dir
) -> None:
    await sync_to_async(_mirror_to)(other_weights_dir, 100)
    runtime, acme = await _start(make_tenant)
    started = datetime.now(tz=UTC) - timedelta(seconds=5)

    await _serve(acme, 4, temperature=0)
    await _serve(acme, 3, temperature=1.0)  # no seed: two versions need not agree, so no comparison
    v2 = (await _windows(runtime, started))["v2"]
    assert v2.num_requests == 7
    assert v2.num_shadow_compared == 4
    assert v2.num_shadow_matched == 0


async def test_no_mirror_no_copies(make_tenant, registered_model, demo_model_dir) -> None:
    from registry.services import alias_set, model_version_register

    v2 = await sync_to_async(model_version_register)(
        name="demo-chat", version="v2", source_dir=demo_model_dir, created_by="test"
    )
    await sync_to_async(alias_set)(model=v2.model, name="canary", version=v2, actor="test")
    runtime, acme = await _start(make_tenant)
    started = datetime.now(tz=UTC) - timedelta(seconds=5)
    await _serve(acme, 3, temperature=0)
    v2_window = (await _windows(runtime, started))["v2"]
    assert v2_window.num_requests == 0


async def test_copies_over_the_in_flight_cap_are_skipped_and_counted_in_metrics(
    make_tenant, registered_model, demo_model_dir, monkeypatch, settings
) -> None:
    from serving.gateway import shadow
    from serving.telemetry.shadow_copies import shadow_copy_counts

    await sync_to_async(_mirror_to)(demo_model_dir, 100)
    _, acme = await _start(make_tenant)
    before = shadow_copy_counts()
    monkeypatch.setattr(shadow, "MAX_IN_FLIGHT", 0)  # as if this process already ran its share
    assert await _serve(acme, 2, temperature=0) == ["v1", "v1"]  # the primary is never held up
    after = shadow_copy_counts()
    skipped = after.get(("demo-chat", "v2", "skipped"), 0) - before.get(("demo-chat", "v2", "skipped"), 0)
    assert skipped == 2
    settings.METRICS_TOKEN = "scrape"
    text = (await AsyncClient().get("/metrics", headers={"Authorization": "Bearer scrape"})).content.decode()
    assert 'switchyard_shadow_copies_total{model="demo-chat",outcome="skipped",version="v2"}' in text


async def test_a_copy_that_only_waits_for_its_primarys_text_holds_no_slot(
    make_tenant, registered_model, demo_model_dir, monkeypatch
) -> None:
    """A primary streaming to a slow client keeps its copy waiting, to compare, long after the copy has
    ended: such copies must not keep the next requests' copies out."""
    import asyncio

    from serving.gateway import shadow

    await sync_to_async(_mirror_to)(demo_model_dir, 100)
    runtime, _ = await _start(make_tenant)
    monkeypatch.setattr(shadow, "MAX_IN_FLIGHT", 1)

    class StreamingPrimary:  # its text is not in yet
        model_name = "demo-chat"
        version = "v1"

        def __init__(self, request_id: str) -> None:
            self.request_id = request_id
            self.text: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()

        def capture_text(self) -> asyncio.Future[str | None]:
            return self.text

    submission = {
        "reply_to": runtime.hub.channel_name,
        "input": "hello",
        "messages": None,
        "inputs": None,
        "params": {"max_tokens": 4, "temperature": 0.0},
        "tenant": "acme",
        "cache_group": None,
    }
    first, second = StreamingPrimary("first"), StreamingPrimary("second")
    assert shadow.start_mirror(first, runtime=runtime, version="v2", submission=submission)
    async with asyncio.timeout(30):
        while not shadow._waiting:  # the copy ran to its end on v2 and waits for the primary's text
            await asyncio.sleep(0.01)
    assert shadow.start_mirror(second, runtime=runtime, version="v2", submission=submission)
    for primary in (first, second):
        primary.text.set_result(None)
    await shadow.wait_idle()


async def test_copies_the_candidate_cannot_serve_count_as_its_errors(
    make_tenant, registered_model, demo_model_dir, monkeypatch
) -> None:
    """In a shadow deployment the judge reads only the copies: a candidate whose replicas are gone must
    not look healthy for serving none of them."""
    await sync_to_async(_mirror_to)(demo_model_dir, 100)
    runtime, acme = await _start(make_tenant)
    started = datetime.now(tz=UTC) - timedelta(seconds=5)
    real_candidates = runtime.candidates

    async def candidates(model_name: str, version: str):  # type: ignore[no-untyped-def]
        return [] if version == "v2" else await real_candidates(model_name, version)

    monkeypatch.setattr(runtime, "candidates", candidates)  # v2's replica crashed, say
    assert await _serve(acme, 3, temperature=0) == ["v1"] * 3  # the clients never notice
    from serving.gateway import shadow

    await shadow.wait_idle()
    await runtime.flush_failures()
    windows = await _windows(runtime, started)
    assert (windows["v2"].num_requests, windows["v2"].num_errors) == (3, 3)
    assert (windows["v1"].num_requests, windows["v1"].num_errors) == (3, 0)


async def test_a_shutdown_ends_a_mirror_whose_cancellation_was_lost() -> None:
    """A mirror's Redis calls can lose a cancellation (serving/cancelling.py); the runtime's shutdown
    must still end it, not leave it running against replicas that have stopped."""
    import asyncio

    from serving.gateway import shadow

    lost = asyncio.Event()

    async def mirror_losing_one_cancellation() -> None:
        try:
            await asyncio.Event().wait()  # a round trip under way when the shutdown comes
        except asyncio.CancelledError:
            lost.set()
        await asyncio.Event().wait()  # goes on as if its call had returned

    task = asyncio.get_running_loop().create_task(mirror_losing_one_cancellation(), name="mirror-test")
    shadow._in_flight.add(task)
    task.add_done_callback(shadow._in_flight.discard)
    await asyncio.sleep(0)  # it starts its call
    await shadow.cancel_all()
    assert lost.is_set()
    assert task.cancelled()
    assert task not in shadow._in_flight


async def test_a_shutdown_lets_a_mirror_finish_aborting_its_copy(monkeypatch) -> None:
    """cancel_all cancels again a mirror still running a second on; one that is closing (its abort to the
    candidate on its way) must not have that cut short, or the copy runs on there for nobody."""
    import asyncio

    from serving.gateway import shadow

    closed, submitted = asyncio.Event(), asyncio.Event()

    class SlowToClose:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        async def submit(self) -> None:
            submitted.set()
            await asyncio.Event().wait()

        async def close(self) -> None:
            await asyncio.sleep(1.5)  # the abort's round trip to a slow Redis, past the re-cancel at 1 s
            closed.set()

    monkeypatch.setattr(shadow, "InFlightRequest", SlowToClose)
    task = asyncio.get_running_loop().create_task(
        shadow._run(None, "demo-chat", "v2", {}, None),
        name="mirror-slow-close",  # type: ignore[arg-type]
    )
    shadow._in_flight.add(task)
    task.add_done_callback(shadow._in_flight.discard)
    await submitted.wait()
    await shadow.cancel_all()
    await asyncio.wait_for(closed.wait(), timeout=10)
