"""A tenant's own model (Model.owner) is its alone: other tenants neither see nor use it unless their quota
names it, and only its owner among the tenants deploys it (tests/rollouts/test_api.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.test import AsyncClient, Client

from registry.models import Model

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def tenants(make_tenant, registered_model, demo_model_dir: Path):  # type: ignore[no-untyped-def]
    """demo-chat, the platform's; acme-ft, acme's own; acme, globex (every model) and partner (named)."""
    from registry.services import model_version_register

    acme = make_tenant("acme")
    own = model_version_register(
        name="acme-ft", version="v1", source_dir=demo_model_dir, owner=acme.tenant
    ).model
    return {
        "acme": acme,
        "globex": make_tenant("globex"),
        "partner": make_tenant("partner", allowed_models=[own]),
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
    assert Model.objects.get(name="acme-ft").owner.name == "acme"


async def test_another_tenants_model_is_refused_before_any_replica(tenants) -> None:
    body = json.dumps({"input": "hi"})
    response = await AsyncClient().post(
        "/v1/models/acme-ft/infer", data=body, content_type="application/json", headers=tenants["globex"].auth
    )
    assert response.status_code == 403
    assert "may not use model 'acme-ft'" in response.json()["error"]["message"]
