"""A tenant's own model (Model.owner) is its alone: other tenants neither see nor use it unless their quota
names it, as if it did not exist, and its owner always may, whatever its quota names. Gateways decide by
the owner their routing cache holds, rechecked each second, so a change of owner counts within a second,
on open WebSockets too.
(Deploying: tests/rollouts/test_api.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from django.test import AsyncClient, Client

from registry.models import Model
from serving.gateway.router import routing_cache

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def tenants(make_tenant, registered_model, demo_model_dir: Path):  # type: ignore[no-untyped-def]
    """demo-chat, the platform's; acme-ft, acme's own. acme names demo-chat only (yet keeps its own),
    globex names nothing, partner names acme-ft (shared with it)."""
    from registry.services import model_version_register

    acme = make_tenant("acme", allowed_models=[registered_model.model])
    own = model_version_register(name="acme-ft", version="v1", source_dir=demo_model_dir, owner=acme.tenant)
    return {
        "acme": acme,
        "globex": make_tenant("globex"),
        "partner": make_tenant("partner", allowed_models=[own.model]),
    }


def _names(response) -> set[str]:  # type: ignore[no-untyped-def]
    assert response.status_code == 200, response.content
    return {m["id"] for m in response.json()["data"]}


def test_another_tenants_model_is_not_listed_nor_found(tenants) -> None:
    client = Client()
    acme, globex, partner = tenants["acme"], tenants["globex"], tenants["partner"]
    assert _names(client.get("/v1/models", headers=acme.auth)) == {"demo-chat", "acme-ft"}
    assert _names(client.get("/v1/models", headers=globex.auth)) == {"demo-chat"}
    assert _names(client.get("/v1/models", headers=partner.auth)) == {"acme-ft"}  # named in its quota
    assert client.get("/v1/models/acme-ft", headers=acme.auth).status_code == 200
    hidden = client.get("/v1/models/acme-ft", headers=globex.auth)
    assert hidden.status_code == 404 and hidden.json()["error"]["message"] == "model 'acme-ft' not found"


async def _post(path: str, body: dict[str, object], tenant: Any) -> Any:
    client = AsyncClient()
    return await client.post(
        path, data=json.dumps(body), content_type="application/json", headers=tenant.auth
    )


async def test_another_tenants_model_is_not_found_on_any_endpoint_before_any_replica(tenants) -> None:
    globex = tenants["globex"]
    for path, body in (
        ("/v1/models/acme-ft/infer", {"input": "hi"}),
        ("/v1/completions", {"model": "acme-ft", "prompt": "hi"}),
        ("/v1/chat/completions", {"model": "acme-ft", "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/embeddings", {"model": "acme-ft", "input": "hi"}),
    ):
        response = await _post(path, body, globex)
        assert response.status_code == 404, (path, response.content)
        assert response.json()["error"]["message"] == "model 'acme-ft' not found"


async def test_another_tenants_model_is_not_found_over_a_websocket(tenants) -> None:
    from channels.testing import WebsocketCommunicator

    from config.asgi import application

    auth = [(b"authorization", f"Bearer {tenants['globex'].key}".encode())]
    socket = WebsocketCommunicator(application, "/v1/models/acme-ft/stream", headers=auth)
    connected, _ = await socket.connect(timeout=10)
    assert connected
    await socket.send_json_to({"type": "infer", "input": "hi", "max_tokens": 2})
    error = await socket.receive_json_from(timeout=10)
    await socket.disconnect()
    assert error["type"] == "error" and error["error"]["message"] == "model 'acme-ft' not found"


def test_a_change_of_owner_counts_at_the_routing_caches_next_check(tenants) -> None:
    from registry.selectors import tenant_context
    from serving.gateway.auth import authorize_model
    from serving.gateway.errors import GatewayError

    globex = tenant_context(tenant=tenants["globex"].tenant)  # as a gateway has it cached
    authorize_model(globex, routing_cache.get("demo-chat", max_age_s=0), pinned_version=None)
    # Given to acme by any means (the admin, a shell, an update): the routing table's revision is the same.
    Model.objects.filter(name="demo-chat").update(owner=tenants["acme"].tenant)
    # The next revalidation (within a second) reads the new owner; the tenant's context is the same.
    with pytest.raises(GatewayError) as refused:
        authorize_model(globex, routing_cache.get("demo-chat", max_age_s=0), pinned_version=None)
    assert refused.value.status == 404


def test_a_signed_in_user_who_is_not_staff_sees_no_model(tenants) -> None:
    from django.contrib.auth import get_user_model

    client = Client()
    client.force_login(get_user_model().objects.create_user("bob", is_staff=False))
    for path in ("/v1/models", "/v1/models/acme-ft", "/v1/models/acme-ft/versions"):
        assert client.get(path).status_code == 403, path
    client.force_login(get_user_model().objects.create_user("alice", is_staff=True))
    assert _names(client.get("/v1/models")) == {"demo-chat", "acme-ft"}


@pytest.mark.parametrize("how", ["its own page", "the list's bulk action"])
def test_an_alias_deleted_in_the_admin_stops_routing_at_the_caches_next_check(
    registered_model, how: str
) -> None:
    """Gateways keep a model's routing until its revision moves; the admin's deletions move it too."""
    from django.contrib.auth import get_user_model

    from registry.models import Alias, RoutingTable
    from registry.services import alias_set

    model = registered_model.model
    alias = alias_set(model=model, name="stable", version=registered_model, actor="test")
    assert routing_cache.get("demo-chat", max_age_s=0).aliases == {"stable": "v1"}
    revision = RoutingTable.objects.get(model=model).revision
    client = Client()
    client.force_login(get_user_model().objects.create_user("alice", is_staff=True, is_superuser=True))
    if how == "its own page":
        response = client.post(f"/admin/registry/alias/{alias.pk}/delete/", {"post": "yes"})
    else:
        response = client.post(
            "/admin/registry/alias/",
            {"action": "delete_selected", "_selected_action": [alias.pk], "post": "yes"},
        )
    assert response.status_code == 302 and not Alias.objects.exists()
    assert RoutingTable.objects.get(model=model).revision > revision
    assert routing_cache.get("demo-chat", max_age_s=0).aliases == {}


def test_scaling_bounds_and_a_mirror_changed_in_the_admin_reach_the_routing_caches_next_check(
    registered_model,
) -> None:
    """A model set to scale to zero in the admin: a gateway that kept the old table would neither wait
    for a replica to start nor ask for one, and answer 503s; a mirror cleared there would go on."""
    from django.contrib.auth import get_user_model

    from registry.models import RoutingTable
    from rollouts.models import ScalingBounds

    model = registered_model.model
    bounds = ScalingBounds.objects.create(model=model, min_replicas=1, max_replicas=2)
    assert routing_cache.get("demo-chat", max_age_s=0).scales_to_zero is False
    client = Client()
    client.force_login(get_user_model().objects.create_user("alice", is_staff=True, is_superuser=True))
    response = client.post(
        f"/admin/rollouts/scalingbounds/{bounds.pk}/change/",
        {"model": model.pk, "min_replicas": 0, "max_replicas": 2},
    )
    assert response.status_code == 302, response.content
    assert routing_cache.get("demo-chat", max_age_s=0).scales_to_zero is True

    table = RoutingTable.objects.get(model=model)
    table.mirror_version, table.mirror_pct = registered_model, 20
    table.save()  # as a shadow deployment leaves it, then cleared by hand:
    routing_table_revision = RoutingTable.objects.get(model=model).revision
    response = client.post(
        f"/admin/registry/routingtable/{table.pk}/change/",
        {
            "mirror_version": "",
            "mirror_pct": 0,
            # the read-only inline of its entries, as the page sends it back
            "entries-TOTAL_FORMS": table.entries.count(),
            "entries-INITIAL_FORMS": table.entries.count(),
            **{f"entries-{i}-id": entry.pk for i, entry in enumerate(table.entries.order_by("pk"))},
            **{f"entries-{i}-table": table.pk for i in range(table.entries.count())},
        },
    )
    assert response.status_code == 302, response.content
    table.refresh_from_db()
    assert table.revision > routing_table_revision and (table.mirror_version, table.mirror_pct) == (None, 0)


def test_the_admin_refuses_another_models_version_as_a_mirror_and_an_alias_it_cannot_fill() -> None:
    """Gateways keep only the mirror's version name: another model's "v2" would be mirrored to this
    model's "v2" while replicas were started for the other's. An alias's admin page has every field
    read-only, so its add form could only fail."""
    from django.contrib.auth import get_user_model

    from registry.models import ModelVersion, RoutingTable
    from tests.conftest import model_rows

    chat, other = model_rows("chat", ("v1", "v2")), model_rows("other", ("v1", "v2"))
    table = RoutingTable.objects.get(model=chat)
    revision = table.revision
    client = Client()
    client.force_login(get_user_model().objects.create_user("alice", is_staff=True, is_superuser=True))
    response = client.post(
        f"/admin/registry/routingtable/{table.pk}/change/",
        {
            "mirror_version": ModelVersion.objects.get(model=other, version="v2").pk,
            "mirror_pct": 20,
            "entries-TOTAL_FORMS": table.entries.count(),
            "entries-INITIAL_FORMS": table.entries.count(),
            **{f"entries-{i}-id": entry.pk for i, entry in enumerate(table.entries.order_by("pk"))},
            **{f"entries-{i}-table": table.pk for i in range(table.entries.count())},
        },
    )
    assert response.status_code == 200 and b"must be a version of this model" in response.content
    table.refresh_from_db()
    assert (table.mirror_version, table.mirror_pct, table.revision) == (None, 0, revision)
    assert client.get("/admin/registry/alias/add/").status_code == 403
    assert client.get("/admin/registry/routingtable/add/").status_code == 403  # it comes with its model


def test_the_admin_neither_deletes_a_deployment_or_routing_table_nor_renames_a_model(
    registered_model, demo_model_dir
) -> None:
    """Deleting an in-flight deployment left its canary with its traffic and nothing to judge it; a
    deleted table made the next version registered the model's first (all traffic, no canary); a
    renamed model orphaned the metrics and replicas keyed by its name."""
    from django.contrib.auth import get_user_model

    from registry.models import Model, RoutingTable
    from registry.services import model_version_register
    from rollouts import services as rollouts
    from rollouts.models import Deployment

    model = registered_model.model
    table = RoutingTable.objects.get(model=model)
    model_version_register(name="demo-chat", version="v2", source_dir=demo_model_dir)
    deployment = rollouts.deployment_create(model=model, version="v2", created_by="t")
    client = Client()
    client.force_login(get_user_model().objects.create_user("alice", is_staff=True, is_superuser=True))
    for path in (
        f"/admin/rollouts/deployment/{deployment.pk}/delete/",
        f"/admin/registry/routingtable/{table.pk}/delete/",
    ):
        assert client.post(path, {"post": "yes"}).status_code == 403, path
    assert Deployment.objects.filter(pk=deployment.pk).exists() and table.entries.exists()

    response = client.post(
        f"/admin/registry/model/{model.pk}/change/",
        {"name": "renamed", "kind": "embedding", "description": "d", "owner": ""},
    )
    assert response.status_code == 302, response.content
    model = Model.objects.get(pk=model.pk)
    assert (model.name, model.kind, model.description) == ("demo-chat", "causal-lm", "d")
