"""GET /v1/deployments: the deployments a caller may act on, newest first, a page at a time (OpenAI's
list shape, `after` a cursor); a tenant sees those of its own models and of the platform's granted it,
never another tenant's, nor who else made them."""

from __future__ import annotations

from typing import Any

import pytest

from rollouts import services
from rollouts.models import Deployment

pytestmark = pytest.mark.django_db


def _deploy(model: Any, actor: str, *, version: str = "v2") -> Deployment:
    deployment = services.deployment_create(model=model, version=version, created_by=actor)
    services.deployment_rollback(deployment=deployment, actor="staff:alice", reason="by hand")
    return deployment


def test_a_tenant_lists_only_the_deployments_of_models_it_may_deploy(client, make_model, make_tenant) -> None:  # type: ignore[no-untyped-def]
    chat, other, theirs = make_model("chat"), make_model("other"), make_model("theirs")
    acme = make_tenant("acme", may_deploy=True, allowed_models=[chat], deployable_models=[chat])
    globex = make_tenant("globex", may_deploy=True)
    theirs.owner = globex.tenant
    theirs.save()
    on_chat = _deploy(chat, "tenant:globex")  # granted to acme: listed, its creator not named
    _deploy(other, "staff:bob")  # the platform's, not granted to acme
    _deploy(theirs, "tenant:globex")  # another tenant's own
    page = client.get("/v1/deployments", headers=acme.auth).json()
    assert [d["deployment_id"] for d in page["data"]] == [on_chat.pk]
    (listed,) = page["data"]
    assert (listed["model"], listed["version"], listed["incumbent"]) == ("chat", "v2", "v1")
    assert (listed["state"], listed["created_by"]) == ("rolled_back", "another tenant")
    assert "globex" not in str(page) and "alice" not in str(page)
    mine = client.get("/v1/deployments", headers=globex.auth).json()["data"]
    assert [(d["model"], d["created_by"]) for d in mine] == [("theirs", "tenant:globex")]
    nobody = make_tenant("nobody")  # may not deploy at all
    assert client.get("/v1/deployments", headers=nobody.auth).status_code == 403


def test_staff_page_through_every_deployment_newest_first(staff_client, make_model) -> None:  # type: ignore[no-untyped-def]
    chat = make_model("chat", versions=("v1", "v2", "v3", "v4", "v5"))
    made = [_deploy(chat, "staff:bob", version=v).pk for v in ("v2", "v3", "v4", "v5")]
    first = staff_client.get("/v1/deployments?limit=3").json()
    assert first["object"] == "list" and first["has_more"] is True
    assert [d["deployment_id"] for d in first["data"]] == made[::-1][:3]
    assert (first["first_id"], first["last_id"]) == (made[3], made[1])
    rest = staff_client.get(f"/v1/deployments?limit=3&after={first['last_id']}").json()
    assert [d["deployment_id"] for d in rest["data"]] == [made[0]] and rest["has_more"] is False
    assert rest["data"][0]["created_by"] == "staff:bob"  # staff see who


@pytest.mark.parametrize("query", ["limit=0", "limit=101", "limit=ten", "after=-3", "after=x"])
def test_a_bad_page_is_a_400_naming_the_parameter(staff_client, make_model, query: str) -> None:  # type: ignore[no-untyped-def]
    response = staff_client.get(f"/v1/deployments?{query}")
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(query.split("=")[0])
