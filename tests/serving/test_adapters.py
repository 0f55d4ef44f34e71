"""LoRA adapters served on their base's replicas (docs/architecture.md, "Adapters on a shared base"): a
request for an adapter model, once its version is chosen (split, alias, pin), runs on the base version's
replica with the adapter, through the whole application and the `openai` client; no replica is started
for an adapter version; its requests have metrics of their own and the replica reports its resident
adapters; a tenant's adapter is another tenant's 404; an adapter the replica cannot load is a clear error
(a 503 saying why), never a 500."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient

from registry.models import Model, ModelVersion
from registry.services import alias_set, model_version_register, routing_table_set
from serving.gateway.router import routing_cache
from serving.telemetry import metric_window as m
from serving.telemetry.prometheus import SwitchyardCollector
from tests.lora_adapters import build_peft_adapter
from tests.serving.conftest import asgi_client, openai_on

pytestmark = pytest.mark.django_db(transaction=True)

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> list[Path]:
    """Two adapters of the demo model, with other weights (other seeds)."""
    root = tmp_path_factory.mktemp("adapters")
    return [build_peft_adapter(demo_model_dir, root / f"lora-{seed}", seed=seed) for seed in (1, 2)]


@pytest.fixture
async def acme(runtime: Any, make_tenant: Any, adapter_dirs: list[Path], settings: Any) -> Any:
    """Tenant acme, which may pin, with its own adapter model acme-tune: v1 (all of its traffic) and v2
    (none), both of the running demo-chat:v1."""
    settings.ALLOWED_HOSTS = ["localhost", "testserver"]
    tenant = await sync_to_async(make_tenant)(
        "acme", may_pin=True, requests_per_second=1000, tokens_per_minute=10**8
    )

    def register() -> None:
        base = ModelVersion.objects.get(model__name="demo-chat", version="v1")
        for version, directory in zip(("v1", "v2"), adapter_dirs, strict=True):
            model_version_register(
                name="acme-tune", version=version, source_dir=directory, owner=tenant.tenant, adapter_of=base
            )

    await sync_to_async(register)()
    return tenant


@pytest.fixture
async def client(acme: Any) -> AsyncIterator[openai.AsyncOpenAI]:
    async with asgi_client() as http:
        yield openai_on(http, acme.key)


async def _complete(client: openai.AsyncOpenAI, model: str, **headers: str) -> tuple[str, dict[str, str]]:
    raw = await client.completions.with_raw_response.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_headers=headers or None
    )
    completion = raw.parse()
    assert completion.choices[0].finish_reason == "length"
    return completion.choices[0].text, dict(raw.headers)


async def test_an_adapter_request_is_served_by_its_bases_replica_and_differs_from_the_base(
    runtime: Any, client: openai.AsyncOpenAI
) -> None:
    base_text, base_headers = await _complete(client, "demo-chat")
    text, headers = await _complete(client, "acme-tune")
    again, _ = await _complete(client, "acme-tune")

    assert headers["x-served-version"] == "v1"
    # The base's one replica served both; none was started for the adapter.
    assert headers["x-served-replica"] == base_headers["x-served-replica"]
    replica = runtime.replicas[("demo-chat", "v1")]
    assert headers["x-served-replica"] == replica.replica_id
    assert set(runtime.replicas) == {("demo-chat", "v1")}
    assert text != base_text and again == text  # the adapter's greedy output, the same each time
    # Streamed through the same path, the same text.
    stream = await client.completions.create(
        model="acme-tune", prompt=PROMPT, max_tokens=12, temperature=0, stream=True
    )
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == text

    # Its requests have metrics of their own, under its version; the base's replica reports the adapter.
    await runtime.supervisor.reconcile(await sync_to_async(_wanted)())
    assert set(runtime.replicas) == {("demo-chat", "v1")}  # the supervisor starts none for it either
    (tune,) = replica.metrics.adapter_recorders()
    adapter_version = await sync_to_async(ModelVersion.objects.get)(model__name="acme-tune", version="v1")
    assert (tune.model_name, tune.version, tune.version_id) == ("acme-tune", "v1", adapter_version.pk)
    assert tune.snapshot().totals.counters[m.REQUESTS] == 3
    assert tune.snapshot().totals.histograms["ttft_s"].count == 3
    assert replica.metrics.snapshot().totals.counters[m.REQUESTS] == 1  # the base's own request
    assert replica.load_report.num_adapters == 1
    assert replica.heartbeat().num_adapters == 1
    assert [h.num_adapters for h in runtime.local_replicas()] == [1]  # the dashboard's replica rows
    exposed = {metric.name: metric for metric in SwitchyardCollector().collect()}
    resident = exposed["switchyard_resident_adapters"].samples
    assert [(s.labels["model"], s.value) for s in resident] == [("demo-chat", 1.0)]
    ttft_models = {s.labels["model"] for s in exposed["switchyard_ttft_seconds"].samples}
    assert {"demo-chat", "acme-tune"} <= ttft_models
    await sync_to_async(replica.metrics.flush)()  # the adapter's windows are stored with the replica's
    stored = await sync_to_async(_stored_versions)()
    assert adapter_version.pk in stored


def _wanted() -> list[Any]:
    from registry.selectors import versions_to_serve

    return versions_to_serve()


def _stored_versions() -> set[int]:
    from serving.models import MetricWindow

    return set(MetricWindow.objects.values_list("version_id", flat=True))


async def test_pins_aliases_and_traffic_moves_choose_among_adapter_versions(
    runtime: Any, client: openai.AsyncOpenAI
) -> None:
    v1, _ = await _complete(client, "acme-tune")
    v2, headers = await _complete(client, "acme-tune", **{"X-Version-Pin": "v2"})
    assert headers["x-served-version"] == "v2" and v2 != v1

    def alias_and_move(weights: dict[str, int]) -> None:
        model = Model.objects.get(name="acme-tune")
        alias_set(model=model, name="canary", version=model.versions.get(version="v2"), actor="test")
        routing_table_set(model=model, weights=weights, actor="test")
        routing_cache.clear()  # as every gateway's would be within its revalidation period

    await sync_to_async(alias_and_move)({"v1": 0, "v2": 100})
    aliased, headers = await _complete(client, "acme-tune@canary")
    assert (aliased, headers["x-served-version"]) == (v2, "v2")
    promoted, headers = await _complete(client, "acme-tune")
    assert (promoted, headers["x-served-version"]) == (v2, "v2")
    await sync_to_async(alias_and_move)({"v1": 100, "v2": 0})  # rolled back: a routing edit
    rolled_back, headers = await _complete(client, "acme-tune")
    assert (rolled_back, headers["x-served-version"]) == (v1, "v1")
    assert set(runtime.replicas) == {("demo-chat", "v1")}
    assert len(runtime.replicas[("demo-chat", "v1")].preparer.adapters) == 2


async def test_a_tenants_adapter_is_another_tenants_404(acme: Any, make_tenant: Any) -> None:
    globex = await sync_to_async(make_tenant)("globex", may_pin=True)
    listed = await AsyncClient().get("/v1/models", headers=acme.auth)
    assert "acme-tune" in {m["id"] for m in listed.json()["data"]}
    listed = await AsyncClient().get("/v1/models", headers=globex.auth)
    assert "acme-tune" not in {m["id"] for m in listed.json()["data"]}

    async def answer(model: str, **headers: str) -> tuple[int, Any]:
        response = await AsyncClient().post(
            "/v1/completions",
            {"model": model, "prompt": PROMPT, "max_tokens": 2},
            content_type="application/json",
            headers={**globex.auth, **headers},
        )
        body = response.json()
        return response.status_code, body["error"]["message"].replace(model.split("@")[0], "M")

    assert await answer("acme-tune") == await answer("no-such-model") == (404, "model 'M' not found")
    assert (await answer("acme-tune", **{"X-Version-Pin": "v2"}))[0] == 404
    assert (await answer("acme-tune@stable"))[0] == 404


async def test_an_adapter_the_replica_cannot_load_is_a_clear_error_not_a_500(
    runtime: Any, client: openai.AsyncOpenAI
) -> None:
    def corrupt() -> None:
        stored = Path(ModelVersion.objects.get(model__name="acme-tune", version="v2").artifact_uri)
        (stored / "adapter_model.safetensors").write_bytes(b"changed after registration")

    await sync_to_async(corrupt)()
    with pytest.raises(openai.APIStatusError) as excinfo:
        await _complete(client, "acme-tune", **{"X-Version-Pin": "v2"})
    assert excinfo.value.status_code == 503
    assert "adapter acme-tune:v2 could not be loaded" in excinfo.value.message
    assert "registered digest" in excinfo.value.message
    # The replica serves on: the base and the other adapter as before.
    text, headers = await _complete(client, "acme-tune")
    assert headers["x-served-version"] == "v1" and text
    tune_v2 = [
        r for r in runtime.replicas[("demo-chat", "v1")].metrics.adapter_recorders() if r.version == "v2"
    ]
    assert tune_v2[0].snapshot().totals.counters[m.ERRORS] == 1  # counted as the adapter version's


def test_an_adapter_version_with_traffic_wants_its_bases_replica_not_its_own(
    db: None, demo_model_dir: Path, adapter_dirs: list[Path]
) -> None:
    from registry.selectors import versions_to_serve, versions_with_traffic

    model_version_register(name="demo-chat", version="v1", source_dir=demo_model_dir)
    base_v2 = model_version_register(name="demo-chat", version="v2", source_dir=demo_model_dir)  # no traffic
    model_version_register(name="tune", version="v1", source_dir=adapter_dirs[0], adapter_of=base_v2)
    assert {(r.model_name, r.version) for r in versions_with_traffic()} == {
        ("demo-chat", "v1"),
        ("tune", "v1"),
    }
    assert {(r.model_name, r.version) for r in versions_to_serve()} == {
        ("demo-chat", "v1"),
        ("demo-chat", "v2"),
    }


async def test_a_deployment_of_an_adapter_version_is_ready_once_its_bases_replica_is(
    runtime: Any, acme: Any
) -> None:
    from rollouts.services import candidate_is_ready, deployment_create

    def deploy() -> bool:
        model = Model.objects.get(name="acme-tune")
        deployment = deployment_create(model=model, version="v2", created_by="test")
        return candidate_is_ready(deployment)

    assert await sync_to_async(deploy)()  # no replica of its own is started, nor waited for
    assert set(runtime.replicas) == {("demo-chat", "v1")}
