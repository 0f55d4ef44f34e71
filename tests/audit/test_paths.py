"""Each change is recorded once, whichever path made it, with who made it: the commands (as the command and
the operating-system user), the admin and the dashboard (as the staff user), the rollouts (as whoever
asked, and the judge). The API's writes: tests/registry/test_api_writes.py and
tests/rollouts/test_traffic_api.py."""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.test import Client

from audit import actors
from audit.models import AuditEntry
from registry.models import ApiKey, Model, Quota, RoutingTable, Tenant
from registry.services import api_key_create, tenant_create
from rollouts import judge_tick
from rollouts.models import Deployment, ScalingBounds
from tests.audit.conftest import last_id, logged, tenant_form
from tests.conftest import model_rows
from tests.rollouts.conftest import FakeMetrics

pytestmark = pytest.mark.django_db

ALICE = "staff:alice"


def _run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue()


def test_each_command_records_its_change_once_as_the_command_and_its_user(demo_model_dir: Path) -> None:
    def by(name: str) -> str:
        return actors.command(name)

    start = last_id()
    _run("register_model", "chat", "v1", "--from", str(demo_model_dir))
    _run("register_model", "chat", "v2", "--from", str(demo_model_dir))
    _run("set_traffic", "chat", "v1=90", "v2=10")
    _run("set_alias", "chat", "eval", "v2")
    _run("set_scaling", "chat", "--min", "0", "--max", "2")
    _run("set_scaling", "chat", "--clear")
    _run("create_tenant", "acme")
    _run("set_quota", "acme", "--ttft-objective-ms", "500")
    raw_key = _run("create_api_key", "--tenant", "acme").strip().splitlines()[-1]
    _run("revoke_api_key", raw_key[: ApiKey.PREFIX_LENGTH])
    prefix = raw_key[: ApiKey.PREFIX_LENGTH]
    assert logged(start) == [
        (by("register_model"), "create", "model", "chat"),
        (by("register_model"), "create", "model_version", "chat:v1"),
        (by("register_model"), "create", "alias", "chat@stable"),
        (by("register_model"), "create", "model_version", "chat:v2"),
        (by("set_traffic"), "update", "routing_table", "chat"),
        (by("set_alias"), "create", "alias", "chat@eval"),
        (by("set_scaling"), "create", "scaling_bounds", "chat"),
        (by("set_scaling"), "delete", "scaling_bounds", "chat"),
        (by("create_tenant"), "create", "tenant", "acme"),
        (by("create_tenant"), "create", "quota", "acme"),
        (by("set_quota"), "update", "quota", "acme"),
        (by("create_api_key"), "create", "api_key", prefix),
        (by("revoke_api_key"), "revoke", "api_key", prefix),
    ]


def test_a_change_of_owner_in_the_admin_is_recorded_once_and_other_edits_not(
    superuser_client: Client,
) -> None:
    chat = model_rows("chat", ("v1",))
    acme = tenant_create(name="acme")
    start = last_id()
    page = f"/admin/registry/model/{chat.pk}/change/"
    assert superuser_client.post(page, {"description": "", "owner": acme.pk}).status_code == 302
    assert superuser_client.post(page, {"description": "now described", "owner": acme.pk}).status_code == 302
    assert logged(start) == [(ALICE, "update", "model", "chat")]
    change = AuditEntry.objects.get(pk__gt=start)
    assert (change.before["owner"], change.after["owner"]) == (None, "acme")


def test_routing_rows_edited_in_the_admin_are_recorded_once(superuser_client: Client) -> None:
    chat = model_rows("chat", ("v1", "v2"))
    table = RoutingTable.objects.get(model=chat)
    start = last_id()
    v2 = chat.versions.get(version="v2")
    entries = {
        "entries-TOTAL_FORMS": table.entries.count(),
        "entries-INITIAL_FORMS": table.entries.count(),
        **{f"entries-{i}-id": entry.pk for i, entry in enumerate(table.entries.order_by("pk"))},
        **{f"entries-{i}-table": table.pk for i in range(table.entries.count())},
    }
    page = f"/admin/registry/routingtable/{table.pk}/change/"
    assert (
        superuser_client.post(page, {"mirror_version": v2.pk, "mirror_pct": 20, **entries}).status_code == 302
    )
    assert (
        superuser_client.post(
            "/admin/rollouts/scalingbounds/add/",
            {
                "model": chat.pk,
                "min_replicas": 0,
                "max_replicas": 2,
            },
        ).status_code
        == 302
    )
    bounds = ScalingBounds.objects.get(model=chat)
    bounds_page = f"/admin/rollouts/scalingbounds/{bounds.pk}/change/"
    assert (
        superuser_client.post(
            bounds_page, {"model": chat.pk, "min_replicas": 1, "max_replicas": 2}
        ).status_code
        == 302
    )
    assert (
        superuser_client.post(
            bounds_page, {"model": chat.pk, "min_replicas": 1, "max_replicas": 2}
        ).status_code
        == 302
    )
    deleted = superuser_client.post(f"/admin/rollouts/scalingbounds/{bounds.pk}/delete/", {"post": "yes"})
    assert deleted.status_code == 302
    alias = chat.aliases.get(name="stable")
    assert (
        superuser_client.post(
            "/admin/registry/alias/",
            {"action": "delete_selected", "_selected_action": [alias.pk], "post": "yes"},
        ).status_code
        == 302
    )
    assert logged(start) == [
        (ALICE, "update", "routing_table", "chat"),
        (ALICE, "create", "scaling_bounds", "chat"),
        (ALICE, "update", "scaling_bounds", "chat"),
        (ALICE, "delete", "scaling_bounds", "chat"),
        (ALICE, "delete", "alias", "chat@stable"),
    ]


def test_tenants_quotas_and_keys_edited_in_the_admin_are_recorded_once(superuser_client: Client) -> None:
    start = last_id()
    add = tenant_form(tokens_per_minute=50_000)  # a quota left at its defaults is not saved by the form
    assert superuser_client.post("/admin/registry/tenant/add/", add).status_code == 302
    acme = Tenant.objects.get(name="acme")
    page = f"/admin/registry/tenant/{acme.pk}/change/"
    assert superuser_client.post(page, tenant_form(acme, tokens_per_minute=5_000)).status_code == 302
    assert superuser_client.post(page, tenant_form(acme, tokens_per_minute=5_000)).status_code == 302
    inactive = {**tenant_form(acme, tokens_per_minute=5_000), "is_active": ""}
    assert superuser_client.post(page, inactive).status_code == 302
    assert Quota.objects.get(tenant=acme).tokens_per_minute == 5_000 and not Tenant.objects.get().is_active
    api_key, _ = api_key_create(tenant=acme, actor=ALICE)
    key_page = f"/admin/registry/apikey/{api_key.pk}/change/"
    assert superuser_client.post(key_page, {"name": "ci"}).status_code == 302
    for _ in range(2):  # the second finds it revoked already
        revoke = {"action": "revoke", "_selected_action": [api_key.pk]}
        assert superuser_client.post("/admin/registry/apikey/", revoke).status_code == 302
    assert (
        superuser_client.post(f"/admin/registry/apikey/{api_key.pk}/delete/", {"post": "yes"}).status_code
        == 302
    )
    prefix = api_key.prefix
    assert logged(start) == [
        (ALICE, "create", "tenant", "acme"),
        (ALICE, "create", "quota", "acme"),
        (ALICE, "update", "quota", "acme"),  # the same form again: no change
        (ALICE, "update", "tenant", "acme"),
        (ALICE, "create", "api_key", prefix),
        (ALICE, "update", "api_key", prefix),
        (ALICE, "revoke", "api_key", prefix),
        (ALICE, "delete", "api_key", prefix),
    ]


def test_a_tenants_kv_share_changed_by_a_command_the_api_and_the_admin_is_recorded_once_each(
    superuser_client: Client,
) -> None:
    acme = tenant_create(name="acme")
    start = last_id()
    _run("set_quota", "acme", "--kv-share", "0.5")
    _run("set_quota", "acme", "--kv-share", "0.5")  # no change
    for _ in range(2):  # the second changes nothing
        patched = superuser_client.patch(
            "/v1/tenants/acme/quota", json.dumps({"kv_share": 0.25}), content_type="application/json"
        )
        assert patched.status_code == 200, patched.content
    page = f"/admin/registry/tenant/{acme.pk}/change/"
    for _ in range(2):  # the second changes nothing
        assert superuser_client.post(page, tenant_form(acme, kv_share=0.1)).status_code == 302
    assert superuser_client.post(page, tenant_form(acme, kv_share="")).status_code == 302  # emptied
    assert logged(start) == [
        (actors.command("set_quota"), "update", "quota", "acme"),
        (ALICE, "update", "quota", "acme"),
        (ALICE, "update", "quota", "acme"),
        (ALICE, "update", "quota", "acme"),
    ]
    entries = AuditEntry.objects.filter(pk__gt=start).order_by("pk")
    assert [(e.before["kv_share"], e.after["kv_share"]) for e in entries] == [
        (None, 0.5),
        (0.5, 0.25),
        (0.25, 0.1),
        (0.1, None),
    ]
    assert {k for e in entries for k in e.after if e.before[k] != e.after[k]} == {"kv_share"}


def test_the_dashboards_writes_are_recorded_once_as_the_staff_user(superuser_client: Client) -> None:
    from rollouts.services import deployment_create

    chat = model_rows("chat", ("v1", "v2"))
    acme = tenant_create(name="acme")
    deployment = deployment_create(model=chat, version="v2", created_by=ALICE)
    start = last_id()
    created = superuser_client.post(f"/dashboard/tenants/{acme.pk}/api-keys", {"name": "ci"})
    assert created.status_code == 200
    rolled = superuser_client.post(f"/dashboard/deployments/{deployment.pk}/rollback", {"reason": "no"})
    assert rolled.status_code == 302
    prefix = ApiKey.objects.get(tenant=acme).prefix
    assert logged(start) == [
        (ALICE, "create", "api_key", prefix),
        (ALICE, "update", "deployment", str(deployment.pk)),  # rolling back
        (ALICE, "update", "alias", "chat@canary"),  # back to the incumbent
        (ALICE, "update", "deployment", str(deployment.pk)),  # rolled back
    ]


def test_a_rollout_records_each_of_its_changes_once_with_who_made_it(superuser_client: Client) -> None:
    staff_client = superuser_client
    model_rows("chat", ("v1", "v2"))
    start = last_id()
    body = {"model": "chat", "version": "v2", "steps": [{"pct": 10}, {"pct": 100}], "bake_seconds": 0}
    response = staff_client.post("/v1/deployments", json.dumps(body), content_type="application/json")
    assert response.status_code == 202, response.content
    deployment = Deployment.objects.get(pk=response.json()["deployment_id"])
    judge_tick.deployment_judge(deployment=deployment, read_window=FakeMetrics())  # ready: step 1
    promoted = staff_client.post(f"/v1/deployments/{deployment.pk}/promote")
    assert promoted.status_code == 202, promoted.content
    judge = judge_tick.JUDGE_ACTOR
    pk = str(deployment.pk)
    assert logged(start) == [
        (ALICE, "create", "deployment", pk),
        (ALICE, "create", "alias", "chat@canary"),
        (ALICE, "update", "deployment", pk),  # provisioning
        (judge, "update", "routing_table", "chat"),  # 10% to v2
        (judge, "update", "deployment", pk),  # ramping
        (ALICE, "update", "alias", "chat@stable"),
        (ALICE, "update", "routing_table", "chat"),  # 100% to v2
        (ALICE, "update", "deployment", pk),  # promoted
    ]
    assert Model.objects.get(name="chat").aliases.get(name="stable").version.version == "v2"
