"""The deployments API: who may call it, what it answers, and bad input that changes nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from registry.models import Alias, AliasEvent, RoutingEntry, RoutingTable
from rollouts import judge_tick, services
from rollouts.models import Deployment, DeploymentEvent
from tests.rollouts.conftest import FakeMetrics

pytestmark = pytest.mark.django_db

BODY = {
    "model": "chat",
    "version": "v2",
    "strategy": "canary",
    "steps": [{"pct": 1}, {"pct": 5}, {"pct": 25}, {"pct": 100}],
    "bake_seconds": 30,
    "thresholds": {"tpot_sla_ms": 50, "min_samples": 40},
}


def post(client, path: str, body: Any = None, **headers: str):  # type: ignore[no-untyped-def]
    return client.post(
        path,
        data=json.dumps(body if body is not None else {}),
        content_type="application/json",
        headers=headers,
    )


@pytest.fixture
def chat(make_model):  # type: ignore[no-untyped-def]
    return make_model()


def everything(model) -> tuple[Any, ...]:  # type: ignore[no-untyped-def]
    """Every row a deployment request could touch."""
    return (
        list(Deployment.objects.values_list("id", "state")),
        DeploymentEvent.objects.count(),
        AliasEvent.objects.count(),
        sorted(Alias.objects.values_list("name", "version__version")),
        RoutingTable.objects.get(model=model).revision,
        sorted(RoutingEntry.objects.values_list("version__version", "weight")),
    )


def test_staff_create_get_rollback(staff_client, chat) -> None:
    response = post(staff_client, "/v1/deployments", BODY)
    assert response.status_code == 202, response.content
    body = response.json()
    assert body == {"deployment_id": body["deployment_id"], "state": "provisioning"}
    assert response["Location"] == f"/v1/deployments/{body['deployment_id']}"

    detail = staff_client.get(f"/v1/deployments/{body['deployment_id']}").json()
    assert detail["state"] == "provisioning"
    assert detail["steps"] == BODY["steps"]
    assert detail["current_step"] == 0
    assert detail["thresholds"]["tpot_sla_ms"] == 50
    assert detail["thresholds"]["alpha"] == 0.01
    assert detail["created_by"] == "staff:alice"
    assert [e["to_state"] for e in detail["events"]] == ["pending", "provisioning"]
    assert all(e["reason"] for e in detail["events"])

    rolled = post(staff_client, f"/v1/deployments/{body['deployment_id']}/rollback", {"reason": "not today"})
    assert rolled.status_code == 202
    assert rolled.json()["state"] == "rolled_back"
    assert rolled.json()["rollback"]["edit_ms"] is None  # still provisioning: no traffic to move back
    detail = staff_client.get(f"/v1/deployments/{body['deployment_id']}").json()
    assert detail["events"][-2]["reason"] == "not today"
    assert detail["rollback"]["decided_at"]
    again = post(staff_client, f"/v1/deployments/{body['deployment_id']}/rollback")
    assert again.status_code == 409
    assert again.json()["error"]["type"] == "conflict_error"


def test_tenant_allowed_to_deploy_promotes(client, chat, make_tenant) -> None:
    # chat is the platform's, and an admin granted acme its rollouts.
    acme = make_tenant("acme", may_deploy=True, allowed_models=[chat], deployable_models=[chat])
    response = post(client, "/v1/deployments", BODY, **acme.auth)
    assert response.status_code == 202, response.content
    deployment_id = response.json()["deployment_id"]
    assert Deployment.objects.get(pk=deployment_id).created_by == "tenant:acme"
    # Promotion waits for a ready candidate: one judge tick takes it from provisioning to ramping.
    judge_tick.deployment_judge(
        deployment=Deployment.objects.get(pk=deployment_id), read_window=FakeMetrics()
    )

    promoted = post(client, f"/v1/deployments/{deployment_id}/promote", **acme.auth)
    assert promoted.status_code == 202
    assert promoted.json()["state"] == "promoted"
    assert Alias.objects.get(model=chat, name="stable").version.version == "v2"
    assert AliasEvent.objects.filter(alias__name="stable").last().actor == "tenant:acme"


def test_callers_without_the_right_get_403_and_change_nothing(client, chat, make_model, make_tenant) -> None:
    other = make_model("other", versions=("v1",))
    viewer = make_tenant("viewer", may_deploy=False)
    elsewhere = make_tenant("elsewhere", may_deploy=True, allowed_models=[other])
    # Allowed every model and to deploy, but chat is the platform's (no owner), then another tenant's:
    # its traffic is every tenant's, and its deployments are none of this one's business. Naming it in
    # the quota is leave to use it, not to deploy it.
    user = make_tenant("user", may_deploy=True)
    named = make_tenant("named", may_deploy=True, allowed_models=[chat])
    granted_elsewhere = make_tenant("granted", may_deploy=False, deployable_models=[chat])
    deployment = services.deployment_create(model=chat, version="v2", created_by="staff:alice")
    before = everything(chat)

    for tenant in (viewer, user, named, granted_elsewhere):
        for method, path in (
            ("post", "/v1/deployments"),
            ("get", f"/v1/deployments/{deployment.pk}"),
            ("post", f"/v1/deployments/{deployment.pk}/rollback"),
            ("post", f"/v1/deployments/{deployment.pk}/promote"),
        ):
            if method == "get":
                response = client.get(path, headers=tenant.auth)
            else:
                response = post(client, path, {**BODY, "version": "v3"}, **tenant.auth)
            assert response.status_code == 403, (tenant.tenant, path, response.content)
            assert response.json()["error"]["type"] == "permission_error"

    # Allowed to deploy, but not to use chat at all: as the registry answers it, chat does not exist.
    for response in (
        post(client, "/v1/deployments", {**BODY, "version": "v3"}, **elsewhere.auth),
        client.get(f"/v1/deployments/{deployment.pk}", headers=elsewhere.auth),
        post(client, f"/v1/deployments/{deployment.pk}/rollback", **elsewhere.auth),
    ):
        assert response.status_code == 404, response.content
    assert "chat" not in response.json()["error"]["message"]
    assert client.get("/v1/models/chat/versions", headers=elsewhere.auth).status_code == 404
    assert everything(chat) == before

    plain = get_user_model().objects.create_user("bob", is_staff=False)
    client.force_login(plain)
    assert post(client, "/v1/deployments", BODY).status_code == 403
    client.logout()
    anonymous = post(client, "/v1/deployments", BODY)
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["type"] == "authentication_error"
    # Another tenant's own model: as if it did not exist.
    chat.owner = elsewhere.tenant
    chat.save()
    hidden = post(client, "/v1/deployments", {**BODY, "version": "v3"}, **user.auth)
    assert hidden.status_code == 404 and hidden.json()["error"]["message"] == "model 'chat' not found"
    by_id = client.get(f"/v1/deployments/{deployment.pk}", headers=user.auth)
    assert by_id.status_code == 404 and "chat" not in by_id.json()["error"]["message"]
    assert everything(chat) == before


def test_a_tenant_deploys_its_own_model_without_naming_it(client, chat, make_model, make_tenant) -> None:
    owner = make_tenant("owner", may_deploy=True)  # a quota that names no model
    chat.owner = owner.tenant
    chat.save()
    response = post(client, "/v1/deployments", BODY, **owner.auth)
    assert response.status_code == 202, response.content
    # An owner whose quota names other models keeps its own.
    named = make_tenant("named", may_deploy=True, allowed_models=[make_model("other", versions=("v1",))])
    chat.owner = named.tenant
    chat.save()
    rolled = post(client, f"/v1/deployments/{response.json()['deployment_id']}/rollback", **named.auth)
    assert rolled.status_code == 202, rolled.content


def test_unknown_deployment_or_model_is_404(staff_client, chat) -> None:
    assert staff_client.get("/v1/deployments/999").status_code == 404
    assert post(staff_client, "/v1/deployments/999/rollback").status_code == 404
    for name in ("nope", "chat\x00"):  # a NUL: no model has it, and Postgres refuses it in a query
        response = post(staff_client, "/v1/deployments", {**BODY, "model": name})
        assert response.status_code == 404
        assert response.json()["error"]["type"] == "not_found_error"
    for path in ("/v1/models/chat%00x", "/v1/models/chat%00x/versions"):
        response = staff_client.get(path)
        assert response.status_code == 404, response.content
        assert response.json()["error"]["type"] == "not_found_error"
    assert staff_client.get("/dashboard/models/chat%00x/").status_code == 404


BAD_INPUT = [
    ({"version": "v9"}, 400, "has no version 'v9'"),
    ({"version": "v\x00"}, 400, "has no version 'v\\x00'"),  # Postgres refuses a NUL in a query
    ({"version": "only-elsewhere"}, 400, "model 'chat' has no version 'only-elsewhere'"),
    ({"steps": [{"pct": 5}, {"pct": 5}, {"pct": 100}]}, 400, "strictly increasing"),
    ({"steps": [{"pct": 25}, {"pct": 5}, {"pct": 100}]}, 400, "strictly increasing"),
    ({"steps": [{"pct": 5}, {"pct": 50}]}, 400, "last step must be 100%"),
    ({"steps": [{"pct": 0}, {"pct": 100}]}, 400, "from 1 to 100"),
    ({"steps": [{"pct": 5}, {"pct": 101}]}, 400, "from 1 to 100"),
    ({"steps": [{"pct": 2.5}, {"pct": 100}]}, 400, "integer"),
    ({"steps": []}, 400, "non-empty"),
    ({"steps": [{"pct": 5, "bake": 3}, {"pct": 100}]}, 400, "exactly one key"),
    ({"bake_seconds": -1}, 400, "non-negative"),
    ({"bake_seconds": 10**9}, 400, "up to 604800"),
    ({"bake_seconds": "soon"}, 400, "non-negative integer"),
    ({"thresholds": {"p999_ms": 5}}, 400, "unknown threshold(s): p999_ms"),
    ({"thresholds": {"\ud800": 5}}, 400, "unpaired UTF-16 surrogate"),  # the renderer failed on it: a 500
    ({"thresholds": {"alpha": 0}}, 400, "alpha"),
    ({"thresholds": {"min_samples": 0}}, 400, "positive integer"),
    ({"thresholds": {"latency_ratio": True}}, 400, "must be a number"),
    ({"thresholds": {"latency_ratio": 1e308}}, 400, "latency_ratio may be at most 1000"),  # froze the judge
    ({"thresholds": {"min_output_length_ratio": 2}}, 400, "at most 1"),
    ({"thresholds": {"min_agreement": 1.5}}, 400, "min_agreement must be in [0, 1]"),
    ({"thresholds": {"min_agreement": -0.1}}, 400, "min_agreement must be in [0, 1]"),
    ({"strategy": "blue-green"}, 400, "strategy must be one of"),
    ({"replicas": 3}, 400, "unknown field(s): replicas"),
    ({"version": "v1"}, 409, "already the stable version"),
]


@pytest.mark.parametrize(("change", "status", "message"), BAD_INPUT)
def test_bad_input_is_refused_with_the_error_shape_and_nothing_changes(
    staff_client, chat, make_model, change, status, message
) -> None:
    make_model("other", versions=("v1", "only-elsewhere"))
    before = everything(chat)
    response = post(staff_client, "/v1/deployments", {**BODY, **change})
    assert response.status_code == status, response.content
    error = response.json()["error"]
    assert set(error) == {"type", "message"}
    assert message in error["message"]
    assert everything(chat) == before


def test_malformed_json_and_non_object_bodies_are_400(staff_client, chat) -> None:
    broken = staff_client.post("/v1/deployments", data="{not json", content_type="application/json")
    assert broken.status_code == 400
    assert broken.json()["error"]["type"] == "invalid_request_error"
    deep = staff_client.post("/v1/deployments", data="[" * 5000 + "]" * 5000, content_type="application/json")
    assert deep.status_code == 400 and "nested too deeply" in deep.json()["error"]["message"]
    assert post(staff_client, "/v1/deployments", [1, 2]).status_code == 400
    assert Deployment.objects.count() == 0


def test_json_sent_as_a_form_is_a_415_that_names_the_header(staff_client, chat) -> None:
    """`curl -d '{…}'` without a Content-Type sends a form, whose one key is the whole JSON text: the
    README's own rollout example answered "unknown field(s): {"model": …}"."""
    form = staff_client.post(
        "/v1/deployments",
        data=json.dumps({"model": "chat", "version": "v2"}),
        content_type="application/x-www-form-urlencoded",
    )
    assert form.status_code == 415, form.content
    assert "Content-Type: application/json" in form.json()["error"]["message"]
    assert Deployment.objects.count() == 0


def test_a_second_deployment_for_a_model_with_one_in_flight_is_409_and_changes_nothing(staff_client, chat):
    assert post(staff_client, "/v1/deployments", BODY).status_code == 202
    before = everything(chat)
    response = post(staff_client, "/v1/deployments", {**BODY, "version": "v3"})
    assert response.status_code == 409
    assert "already has deployment" in response.json()["error"]["message"]
    assert everything(chat) == before


@pytest.mark.parametrize("end", ["rollback", "promote"])
def test_the_default_reasons_name_no_one_another_tenant_may_not_know(client, chat, make_tenant, end) -> None:
    """Without a reason of its own, an event's reason said who asked ("rollback requested by staff:alice"):
    beside an actor shown to acme as "another tenant" or "staff", it named them."""
    acme = make_tenant("acme", may_deploy=True, allowed_models=[chat], deployable_models=[chat])
    globex = make_tenant("globex", may_deploy=True, allowed_models=[chat], deployable_models=[chat])
    deployment_id = post(client, "/v1/deployments", BODY, **acme.auth).json()["deployment_id"]
    deployment = Deployment.objects.get(pk=deployment_id)
    judge_tick.deployment_judge(deployment=deployment, read_window=FakeMetrics())  # ramping: promotable
    response = post(client, f"/v1/deployments/{deployment_id}/{end}", **globex.auth)
    assert response.status_code == 202, response.content
    events = client.get(f"/v1/deployments/{deployment_id}", headers=acme.auth).json()["events"]
    assert any(e["actor"] == "another tenant" for e in events)
    assert not any("globex" in (e["reason"] or "") for e in events)


def test_a_min_samples_no_traffic_reaches_is_accepted(staff_client, chat) -> None:
    """How the rollback benchmark holds a canary at its step for good: an integer, only ever compared."""
    response = post(staff_client, "/v1/deployments", {**BODY, "thresholds": {"min_samples": 10**9}})
    assert response.status_code == 202, response.content


def test_a_threshold_too_large_for_a_float_is_a_400(staff_client, chat) -> None:
    response = post(staff_client, "/v1/deployments", {**BODY, "thresholds": {"ttft_sla_ms": 10**400}})
    assert response.status_code == 400, response.content
    assert "ttft_sla_ms" in response.json()["error"]["message"]


def test_versions_endpoint_reports_state_from_deployments(staff_client, chat) -> None:
    deployment_id = post(staff_client, "/v1/deployments", BODY).json()["deployment_id"]
    judge_tick.deployment_judge(
        deployment=Deployment.objects.get(pk=deployment_id), read_window=FakeMetrics()
    )
    rows = {r["version"]: r for r in staff_client.get("/v1/models/chat/versions").json()}
    assert (rows["v1"]["traffic_pct"], rows["v1"]["state"]) == (99, "incumbent")
    assert (rows["v2"]["traffic_pct"], rows["v2"]["state"]) == (1, "ramping")
    assert (rows["v3"]["traffic_pct"], rows["v3"]["state"]) == (0, "idle")
    assert rows["v2"]["aliases"] == ["canary"]
    post(staff_client, f"/v1/deployments/{deployment_id}/rollback")
    rows = {r["version"]: r for r in staff_client.get("/v1/models/chat/versions").json()}
    assert (rows["v1"]["traffic_pct"], rows["v1"]["state"]) == (100, "serving")
    assert (rows["v2"]["traffic_pct"], rows["v2"]["state"]) == (0, "rolled_back")
    assert staff_client.get("/v1/models/nope/versions").status_code == 404


def test_a_tenant_sees_neither_other_tenants_names_nor_staff_logins(client, chat, make_tenant) -> None:
    """Several tenants may be granted one platform model's rollouts: each reads its deployments' events."""
    acme = make_tenant("acme", may_deploy=True, allowed_models=[chat], deployable_models=[chat])
    globex = make_tenant("globex", may_deploy=True, allowed_models=[chat], deployable_models=[chat])
    deployment_id = post(client, "/v1/deployments", BODY, **acme.auth).json()["deployment_id"]
    deployment = Deployment.objects.get(pk=deployment_id)
    services.deployment_rollback(deployment=deployment, actor="staff:alice", reason="by hand")

    seen_by_acme = client.get(f"/v1/deployments/{deployment_id}", headers=acme.auth).json()
    seen_by_globex = client.get(f"/v1/deployments/{deployment_id}", headers=globex.auth).json()
    assert seen_by_acme["created_by"] == "tenant:acme"
    assert seen_by_globex["created_by"] == "another tenant"
    for body in (seen_by_acme, seen_by_globex):
        actors = {e["actor"] for e in body["events"]}
        assert "staff" in actors and not any("alice" in a for a in actors)
        assert "tenant:globex" not in actors
    staff = get_user_model().objects.create_user("bob", is_staff=True)
    client.force_login(staff)
    seen_by_staff = client.get(f"/v1/deployments/{deployment_id}").json()
    assert seen_by_staff["created_by"] == "tenant:acme"
    assert "staff:alice" in {e["actor"] for e in seen_by_staff["events"]}


def test_every_v1_answer_is_json_whatever_the_client_accepts_or_sends(staff_client, chat) -> None:
    """DRF's browsable API answered a browser's Accept with an HTML page, errors included; a body of the
    wrong media type got the error shape without a type of its own."""
    html = {"HTTP_ACCEPT": "text/html,application/xhtml+xml,*/*;q=0.8"}
    anonymous = Client().get("/v1/models", **html)
    assert anonymous.status_code == 401 and anonymous["Content-Type"] == "application/json"
    assert anonymous.json()["error"]["type"] == "authentication_error"
    assert staff_client.get("/v1/models", **html)["Content-Type"] == "application/json"
    only_html = staff_client.get("/v1/models", HTTP_ACCEPT="text/html")
    assert only_html.status_code == 406 and only_html.json()["error"]["type"] == "not_acceptable"
    text = staff_client.post("/v1/deployments", data="model=chat", content_type="text/plain")
    assert text.status_code == 415 and text.json()["error"]["type"] == "unsupported_media_type"
    assert Deployment.objects.count() == 0
