"""The registry's writes over REST: registering a version from the import root, and (staff only)
tenants, quotas and API keys. For each: what it does, what another tenant and a non-staff caller get,
bad input, and a conflict, each refusal in the one error shape with nothing changed. Each write lands in
the audit log once, as the caller. (Aliases and traffic: tests/rollouts/test_traffic_api.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from audit.models import AuditEntry
from registry.models import Alias, ApiKey, Model, ModelVersion, Quota, Tenant
from registry.services import hash_api_key
from tests.audit.conftest import last_id, logged

pytestmark = pytest.mark.django_db

ALICE = "staff:alice"


def send(client: Client, method: str, path: str, body: Any = None, **headers: str):  # type: ignore[no-untyped-def]
    data = body if isinstance(body, str) else json.dumps(body if body is not None else {})
    return getattr(client, method)(path, data=data, content_type="application/json", headers=headers)


def refused(response, status: int) -> str:  # type: ignore[no-untyped-def]
    """The error's message, once the response is the one error shape with this status."""
    assert response.status_code == status, response.content
    error = response.json()["error"]
    assert set(error) == {"type", "message"} and error["message"]
    return str(error["message"])


def everything(settings: Any) -> tuple[Any, ...]:
    """Every row and file a registry write could touch."""
    store = Path(settings.ARTIFACT_ROOT)
    return (
        sorted(Model.objects.values_list("name", "owner__name")),
        sorted(ModelVersion.objects.values_list("model__name", "version")),
        sorted(Alias.objects.values_list("model__name", "name", "version__version")),
        sorted(Tenant.objects.values_list("name", "is_active")),
        sorted(Quota.objects.values_list("tenant__name", "requests_per_second", "tokens_per_minute")),
        sorted(ApiKey.objects.values_list("prefix", "revoked_at")),
        AuditEntry.objects.count(),
        sorted(str(p.relative_to(store)) for p in store.rglob("*")) if store.exists() else [],
    )


@pytest.fixture
def staff(client: Client) -> Client:
    client.force_login(get_user_model().objects.create_user("alice", is_staff=True))
    return client


@pytest.fixture
def imports(settings: Any, tmp_path: Path, demo_model_dir: Path) -> Path:
    """The import root, holding the demo model as chat-v1 and chat-v2."""
    root = tmp_path / "imports"
    for name in ("chat-v1", "chat-v2"):
        shutil.copytree(demo_model_dir, root / name)
    settings.ARTIFACT_IMPORT_ROOT = root
    return root


# --- registering a version -----------------------------------------------------------------------------


def test_staff_register_a_version_from_the_import_root(staff: Client, imports: Path) -> None:
    start = last_id()
    response = send(staff, "post", "/v1/models/chat/versions", {"version": "v1", "artifact_dir": "chat-v1"})
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["model"], body["version"], body["owner"], body["traffic_pct"], body["aliases"]) == (
        "chat",
        "v1",
        None,
        100,
        ["stable"],
    )
    assert body["created_by"] == ALICE and len(body["sha256"]) == 64
    second = {"version": "v2", "artifact_dir": str(imports / "chat-v2"), "parent": "v1"}  # absolute, inside
    response = send(staff, "post", "/v1/models/chat/versions", second)
    assert response.status_code == 201, response.content
    assert response.json()["traffic_pct"] == 0
    assert ModelVersion.objects.get(version="v2").parent.version == "v1"
    listed = staff.get("/v1/models/chat/versions").json()
    assert [(v["version"], v["traffic_pct"]) for v in listed] == [("v1", 100), ("v2", 0)]
    assert logged(start) == [
        (ALICE, "create", "model", "chat"),
        (ALICE, "create", "model_version", "chat:v1"),
        (ALICE, "create", "alias", "chat@stable"),
        (ALICE, "create", "model_version", "chat:v2"),
    ]


def test_a_tenant_registers_its_own_model_and_another_tenant_finds_nothing_there(
    client: Client, imports: Path, make_tenant, settings
) -> None:  # type: ignore[no-untyped-def]
    acme, globex = make_tenant("acme"), make_tenant("globex")
    start = last_id()
    response = send(
        client,
        "post",
        "/v1/models/acme-ft/versions",
        {"version": "v1", "artifact_dir": "chat-v1"},
        **acme.auth,
    )
    assert response.status_code == 201, response.content
    assert response.json()["owner"] == "acme" and Model.objects.get(name="acme-ft").owner == acme.tenant
    assert logged(start)[0] == ("tenant:acme", "create", "model", "acme-ft")
    before = everything(settings)
    for body in ({"version": "v2", "artifact_dir": "chat-v2"}, {"version": "v1", "artifact_dir": "chat-v2"}):
        hidden = send(client, "post", "/v1/models/acme-ft/versions", body, **globex.auth)
        assert refused(hidden, 404) == "model 'acme-ft' not found"
    assert everything(settings) == before


def test_a_tenant_may_not_register_versions_of_a_model_it_does_not_own(
    client: Client, staff: Client, imports: Path, make_tenant, settings
) -> None:  # type: ignore[no-untyped-def]
    send(staff, "post", "/v1/models/chat/versions", {"version": "v1", "artifact_dir": "chat-v1"})
    acme = make_tenant("acme")  # chat, the platform's, is open to it: it may use it, not add to it
    owner_named = make_tenant("named")
    before = everything(settings)
    body = {"version": "v2", "artifact_dir": "chat-v2"}
    assert "only its own models" in refused(
        send(client, "post", "/v1/models/chat/versions", body, **acme.auth), 403
    )
    another_owner = {"version": "v1", "artifact_dir": "chat-v1", "owner": "named"}
    response = send(client, "post", "/v1/models/new/versions", another_owner, **acme.auth)
    assert "only staff name another owner" in refused(response, 403)
    user = Client()
    user.force_login(get_user_model().objects.create_user("bob", is_staff=False))
    refused(send(user, "post", "/v1/models/chat/versions", body), 403)
    assert everything(settings) == before and owner_named.tenant.owned_models.count() == 0


def test_a_directory_outside_the_import_root_is_refused(
    staff: Client, imports: Path, tmp_path: Path, demo_model_dir: Path, settings
) -> None:
    outside = tmp_path / "outside"
    shutil.copytree(demo_model_dir, outside)
    (imports / "link").symlink_to(outside, target_is_directory=True)
    before = everything(settings)
    for path in ("../outside", str(outside), "link", "chat-v1/../../outside", ".", "/etc"):
        response = send(staff, "post", "/v1/models/chat/versions", {"version": "v1", "artifact_dir": path})
        message = refused(response, 403)
        assert "not a directory under the import root" in message and str(imports) not in message
    assert everything(settings) == before


def test_bad_registrations_are_400_with_the_commands_checks_and_change_nothing(
    staff: Client, imports: Path, settings
) -> None:
    (imports / "pickled").mkdir()
    shutil.copy(imports / "chat-v1" / "config.json", imports / "pickled" / "config.json")
    (imports / "pickled" / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    before = everything(settings)
    cases = [
        ({"version": "v1"}, "artifact_dir"),
        ({"version": "v1", "artifact_dir": "chat-v1", "weights": "x"}, "unknown field"),
        ({"version": "v1", "artifact_dir": "missing"}, "missing is not a directory"),
        ({"version": "v1", "artifact_dir": "pickled"}, "pickle"),
        ({"version": "Bad Version", "artifact_dir": "chat-v1"}, "invalid version"),
        ({"version": "v1", "artifact_dir": "chat-v1", "kind": "speech"}, "kind"),
        ({"version": "v1", "artifact_dir": "chat-v1", "parent": "v0"}, "no version chat:v0"),
        ({"version": "v1", "artifact_dir": "chat-v1", "owner": "nobody"}, "no tenant 'nobody'"),
        ({"version": "v1", "artifact_dir": "x" * 300}, "cannot be read"),
        ([1, 2], "JSON object"),
    ]
    for body, why in cases:
        message = refused(send(staff, "post", "/v1/models/chat/versions", body), 400)
        assert why in message, (body, message)
        assert str(imports) not in message  # the server's own paths stay its own
    assert refused(
        send(staff, "post", "/v1/models/Bad!/versions", {"version": "v1", "artifact_dir": "chat-v1"}), 400
    )
    assert refused(send(staff, "post", "/v1/models/chat/versions", "{not json"), 400)
    assert everything(settings) == before


def test_registering_a_version_twice_is_a_409_that_changes_nothing(
    staff: Client, imports: Path, settings
) -> None:
    body = {"version": "v1", "artifact_dir": "chat-v1"}
    assert send(staff, "post", "/v1/models/chat/versions", body).status_code == 201
    before = everything(settings)
    again = send(staff, "post", "/v1/models/chat/versions", {**body, "artifact_dir": "chat-v2"})
    assert refused(again, 409) == "chat:v1 is already registered"
    assert again.json()["error"]["type"] == "conflict_error"
    assert everything(settings) == before


def test_another_tenants_model_is_not_found_for_reading_or_registering_versions(
    client: Client, imports: Path, make_tenant, settings
) -> None:  # type: ignore[no-untyped-def]
    acme, globex = make_tenant("acme"), make_tenant("globex")
    created = send(
        client,
        "post",
        "/v1/models/acme-ft/versions",
        {"version": "v1", "artifact_dir": "chat-v1"},
        **acme.auth,
    )
    assert created.status_code == 201
    before = everything(settings)
    refused(client.get("/v1/models/acme-ft/versions", headers=globex.auth), 404)
    body = {"version": "v2", "artifact_dir": "chat-v2"}
    refused(send(client, "post", "/v1/models/acme-ft/versions", body, **globex.auth), 404)
    assert everything(settings) == before


# --- tenants, quotas and keys (staff only) --------------------------------------------------------------


def test_staff_create_a_tenant_set_its_quota_and_create_and_revoke_a_key(
    staff: Client, client: Client, settings
) -> None:
    from tests.conftest import model_rows

    model_rows("chat", ("v1",))
    start = last_id()
    created = send(
        staff, "post", "/v1/tenants", {"name": "acme", "tokens_per_minute": 5000, "allowed_models": ["chat"]}
    )
    assert created.status_code == 201, created.content
    assert created.json()["quota"]["tokens_per_minute"] == 5000
    assert created.json()["quota"]["allowed_models"] == ["chat"]

    patched = send(staff, "patch", "/v1/tenants/acme/quota", {"may_pin": True, "requests_per_second": 2.5})
    assert patched.status_code == 200, patched.content
    assert patched.json() == {
        "requests_per_second": 2.5,
        "tokens_per_minute": 5000,  # not named: unchanged
        "max_concurrent_requests": 16,
        "may_pin": True,
        "may_deploy": False,
        "max_service_tier": "default",
        "ttft_objective_ms": None,
        "tpot_objective_ms": None,
        "max_running_sequences": None,
        "kv_share": None,
        "allowed_models": ["chat"],
        "deployable_models": [],
    }

    made = send(staff, "post", "/v1/tenants/acme/api-keys", {"name": "ci"})
    assert made.status_code == 201, made.content
    assert made["Cache-Control"] == "no-store"
    raw_key, prefix = made.json()["key"], made.json()["prefix"]
    stored = ApiKey.objects.get(prefix=prefix)
    assert stored.key_hash == hash_api_key(raw_key) and raw_key not in json.dumps(
        list(ApiKey.objects.values()), default=str
    )
    auth = {"Authorization": f"Bearer {raw_key}"}
    assert [m["id"] for m in client.get("/v1/models", headers=auth).json()["data"]] == ["chat"]

    revoked = send(staff, "post", f"/v1/tenants/acme/api-keys/{prefix}/revoke")
    assert revoked.status_code == 200, revoked.content
    assert [k["prefix"] for k in revoked.json()["revoked"]] == [prefix]
    assert revoked.json()["revoked"][0]["revoked_at"]
    assert client.get("/v1/models", headers=auth).status_code == 401
    assert logged(start) == [
        (ALICE, "create", "tenant", "acme"),
        (ALICE, "create", "quota", "acme"),
        (ALICE, "update", "quota", "acme"),
        (ALICE, "create", "api_key", prefix),
        (ALICE, "revoke", "api_key", prefix),
    ]
    dumped = json.dumps(list(AuditEntry.objects.values()), default=str)
    assert raw_key not in dumped and stored.key_hash not in dumped


def test_tenants_and_non_staff_users_get_403_on_the_staff_endpoints_and_change_nothing(
    client: Client, make_tenant, settings
) -> None:  # type: ignore[no-untyped-def]
    acme, globex = make_tenant("acme"), make_tenant("globex")
    prefix = ApiKey.objects.filter(tenant=globex.tenant).first().prefix
    user = Client()
    user.force_login(get_user_model().objects.create_user("bob", is_staff=False))
    before = everything(settings)
    calls = [
        ("post", "/v1/tenants", {"name": "mine"}),
        ("patch", "/v1/tenants/acme/quota", {"tokens_per_minute": 10**9}),  # its own quota
        ("patch", "/v1/tenants/globex/quota", {"tokens_per_minute": 0}),  # another's
        ("post", "/v1/tenants/acme/api-keys", {}),
        ("post", "/v1/tenants/globex/api-keys", {}),
        ("post", f"/v1/tenants/globex/api-keys/{prefix}/revoke", None),
    ]
    for method, path, body in calls:
        assert "for staff" in refused(send(client, method, path, body, **acme.auth), 403), path
        refused(send(user, method, path, body), 403)
    assert everything(settings) == before


def test_bad_tenant_quota_and_key_requests_are_400_or_404_and_change_nothing(
    staff: Client, make_tenant, settings
) -> None:  # type: ignore[no-untyped-def]
    make_tenant("acme")
    before = everything(settings)
    cases = [
        ("post", "/v1/tenants", {"name": "Not A Name"}, 400, "invalid tenant name"),
        ("post", "/v1/tenants", {"name": "beta", "requests_per_second": -1}, 400, "requests_per_second"),
        ("post", "/v1/tenants", {"name": "beta", "allowed_models": ["nope"]}, 400, "unknown model(s): nope"),
        ("post", "/v1/tenants", {"name": "beta", "quota": {}}, 400, "unknown field"),
        ("post", "/v1/tenants", {}, 400, "name"),
        ("patch", "/v1/tenants/acme/quota", {"tokens_per_minute": "lots"}, 400, "tokens_per_minute"),
        ("patch", "/v1/tenants/acme/quota", {"tokens_per_minute": 2**40}, 400, "tokens_per_minute"),
        ("patch", "/v1/tenants/acme/quota", {"max_concurrent": 4}, 400, "unknown field"),
        ("patch", "/v1/tenants/nobody/quota", {"may_pin": True}, 404, "tenant 'nobody' not found"),
        ("post", "/v1/tenants/acme/api-keys", {"name": "x" * 64}, 400, "name"),
        ("post", "/v1/tenants/nobody/api-keys", {}, 404, "not found"),
        ("post", "/v1/tenants/acme/api-keys/sy-abc/revoke", None, 400, "prefix"),
        ("post", "/v1/tenants/acme/api-keys/sy-abcde/revoke", None, 404, "no key sy-abcde"),
    ]
    for method, path, body, status, why in cases:
        message = refused(send(staff, method, path, body), status)
        assert why in message, (path, body, message)
    assert everything(settings) == before


def test_tenant_and_key_conflicts_are_409_and_change_nothing(staff: Client, make_tenant, settings) -> None:  # type: ignore[no-untyped-def]
    acme = make_tenant("acme")
    prefix = ApiKey.objects.get(tenant=acme.tenant).prefix
    assert send(staff, "post", f"/v1/tenants/acme/api-keys/{prefix}/revoke").status_code == 200
    Tenant.objects.filter(name="acme").update(is_active=False)
    before = everything(settings)
    assert refused(send(staff, "post", "/v1/tenants", {"name": "acme"}), 409) == "tenant acme already exists"
    assert "already revoked" in refused(
        send(staff, "post", f"/v1/tenants/acme/api-keys/{prefix}/revoke"), 409
    )
    assert "inactive" in refused(send(staff, "post", "/v1/tenants/acme/api-keys", {}), 409)
    assert everything(settings) == before
