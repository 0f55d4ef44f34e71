"""A model's aliases and traffic split by hand over REST: staff on any model, a tenant allowed to deploy
on its own; another tenant's model is not found, one it does not own or may not deploy is a 403; bad
input a 400 and a deployment in flight a 409, each with nothing changed. Each edit lands in the audit log
once, as the caller, and moves the routing revision gateways follow."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from audit.models import AuditEntry
from registry.models import Alias, AliasEvent, Model, RoutingEntry, RoutingTable
from rollouts.services import deployment_create
from tests.audit.conftest import last_id, logged
from tests.rollouts.conftest import routing_state

pytestmark = pytest.mark.django_db


def put(client: Client, path: str, body: Any, **headers: str):  # type: ignore[no-untyped-def]
    data = body if isinstance(body, str) else json.dumps(body)
    return client.put(path, data=data, content_type="application/json", headers=headers)


def refused(response, status: int) -> str:  # type: ignore[no-untyped-def]
    assert response.status_code == status, response.content
    return str(response.json()["error"]["message"])


def everything() -> tuple[Any, ...]:
    return (
        sorted(Alias.objects.values_list("model__name", "name", "version__version")),
        AliasEvent.objects.count(),
        sorted(RoutingEntry.objects.values_list("table__model__name", "version__version", "weight")),
        sorted(RoutingTable.objects.values_list("model__name", "revision")),
        AuditEntry.objects.count(),
    )


@pytest.fixture
def models(make_model, make_tenant):  # type: ignore[no-untyped-def]
    """chat, the platform's; acme-ft, acme's own (acme may deploy); globex, a tenant that may deploy."""
    chat, own = make_model("chat"), make_model("acme-ft", versions=("v1", "v2"))
    acme = make_tenant("acme", may_deploy=True)
    Model.objects.filter(pk=own.pk).update(owner=acme.tenant)
    return {"chat": chat, "own": own, "acme": acme, "globex": make_tenant("globex", may_deploy=True)}


def test_staff_move_an_alias_and_set_the_split(staff_client: Client, models) -> None:  # type: ignore[no-untyped-def]
    revision = routing_state(models["chat"])[0]
    start = last_id()
    moved = put(staff_client, "/v1/models/chat/aliases/stable", {"version": "v2", "reason": "v1 is slow"})
    assert moved.status_code == 200, moved.content
    assert moved.json() == {"model": "chat", "alias": "stable", "version": "v2"}
    split = put(staff_client, "/v1/models/chat/traffic", {"weights": {"v2": 90, "v3": 10}})
    assert split.status_code == 200, split.content
    assert split.json()["weights"] == {"v2": 90, "v3": 10}
    new_revision, weights, aliases = routing_state(models["chat"])
    assert weights == {"v2": 90, "v3": 10} and aliases == {"stable": "v2"} and new_revision > revision
    event = AliasEvent.objects.latest("id")
    assert (event.actor, event.reason) == ("staff:alice", "v1 is slow")
    assert logged(start) == [
        ("staff:alice", "update", "alias", "chat@stable"),
        ("staff:alice", "update", "routing_table", "chat"),
    ]


def test_a_tenant_edits_its_own_models_traffic(client: Client, models) -> None:  # type: ignore[no-untyped-def]
    auth = models["acme"].auth
    start = last_id()
    assert put(client, "/v1/models/acme-ft/aliases/eval", {"version": "v2"}, **auth).status_code == 200
    split = put(client, "/v1/models/acme-ft/traffic", {"weights": {"v1": 50, "v2": 50}}, **auth)
    assert split.status_code == 200, split.content
    assert logged(start) == [
        ("tenant:acme", "create", "alias", "acme-ft@eval"),
        ("tenant:acme", "update", "routing_table", "acme-ft"),
    ]


def test_other_tenants_and_callers_without_the_right_change_nothing(
    client: Client, models, make_tenant
) -> None:  # type: ignore[no-untyped-def]
    viewer = make_tenant("viewer", may_deploy=False)
    Model.objects.filter(name="acme-ft").update(owner=viewer.tenant)  # its own, but it may not deploy
    own_without_right = "acme-ft"
    globex = models["globex"]
    user = Client()
    user.force_login(get_user_model().objects.create_user("bob", is_staff=False))
    before = everything()
    for path, body in (
        (f"/v1/models/{own_without_right}/aliases/stable", {"version": "v2"}),
        (f"/v1/models/{own_without_right}/traffic", {"weights": {"v2": 100}}),
    ):
        assert (
            refused(put(client, path, body, **globex.auth), 404) == f"model {own_without_right!r} not found"
        )
        assert "may not deploy" in refused(put(client, path, body, **viewer.auth), 403)
        refused(put(user, path, body), 403)
    for path, body in (
        ("/v1/models/chat/aliases/stable", {"version": "v2"}),  # the platform's: every tenant's traffic
        ("/v1/models/chat/traffic", {"weights": {"v2": 100}}),
    ):
        assert "only its own models" in refused(put(client, path, body, **globex.auth), 403)
    assert everything() == before


def test_another_tenants_model_is_not_found_for_its_aliases_or_traffic(client: Client, models) -> None:  # type: ignore[no-untyped-def]
    before = everything()
    globex = models["globex"].auth
    refused(put(client, "/v1/models/acme-ft/aliases/stable", {"version": "v2"}, **globex), 404)
    refused(put(client, "/v1/models/acme-ft/traffic", {"weights": {"v2": 100}}, **globex), 404)
    assert everything() == before


def test_bad_input_is_a_400_that_changes_nothing(staff_client: Client, models) -> None:  # type: ignore[no-untyped-def]
    before = everything()
    cases = [
        ("/v1/models/chat/aliases/stable", {"version": "v9"}, "has no version 'v9'"),
        ("/v1/models/chat/aliases/Not!", {"version": "v2"}, "invalid alias name"),
        ("/v1/models/chat/aliases/stable", {"version": "v2", "force": True}, "unknown field"),
        ("/v1/models/chat/aliases/stable", {}, "version"),
        ("/v1/models/chat/traffic", {"weights": {"v1": 90}}, "sum to 100"),
        ("/v1/models/chat/traffic", {"weights": {"v1": "90", "v2": 10}}, "integer percentage"),
        ("/v1/models/chat/traffic", {"weights": {"v1": True, "v2": 99}}, "integer percentage"),
        ("/v1/models/chat/traffic", {"weights": {"v1": 50, "v9": 50}}, "unknown version(s) of chat: v9"),
        ("/v1/models/chat/traffic", {"weights": {"v1": 50, "v\u0000": 50}}, "unknown version"),
        ("/v1/models/chat/traffic", {"weights": [100]}, "weights"),
        ("/v1/models/chat/traffic", "[1]", "JSON object"),
    ]
    for path, body, why in cases:
        message = refused(put(staff_client, path, body), 400)
        assert why in message, (path, body, message)
    assert everything() == before


def test_a_deployment_in_flight_makes_the_canary_alias_and_the_split_a_409(
    staff_client: Client, models
) -> None:  # type: ignore[no-untyped-def]
    deployment = deployment_create(model=models["chat"], version="v2", created_by="staff:alice")
    before = everything()
    canary = put(staff_client, "/v1/models/chat/aliases/canary", {"version": "v3"})
    assert f"deployment {deployment.pk}" in refused(canary, 409)
    assert canary.json()["error"]["type"] == "conflict_error"
    assert "in flight" in refused(put(staff_client, "/v1/models/chat/traffic", {"weights": {"v3": 100}}), 409)
    assert everything() == before
