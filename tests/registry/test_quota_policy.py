"""A quota's service tier, latency objectives and caps inside each replica, on every path that manages a
quota: the services, the API, the commands and the admin. Each sets them, empties the nullable ones,
refuses a value out of range with nothing changed, and the tenant's context (what gateways and replicas
read) carries what was stored."""

from __future__ import annotations

import math
from io import StringIO
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.test import Client

from audit.models import AuditEntry
from registry.models import Quota, Tenant
from registry.quotas import SETTINGS, QuotaChange
from registry.selectors import tenant_context
from registry.services import RegistryError, quota_set, tenant_create
from tests.audit.conftest import tenant_form
from tests.registry.test_api_writes import refused, send

pytestmark = pytest.mark.django_db

POLICY = {
    "max_service_tier": "priority",
    "ttft_objective_ms": 400,
    "tpot_objective_ms": 40,
    "max_running_sequences": 4,
    "kv_share": 0.25,
}
NO_POLICY = {
    "max_service_tier": "default",
    "ttft_objective_ms": None,
    "tpot_objective_ms": None,
    "max_running_sequences": None,
    "kv_share": None,
}
# Values no path may store, each with the field it is for.
BAD_VALUES = [
    ("max_service_tier", "gold"),
    ("max_service_tier", "PRIORITY"),
    ("max_service_tier", ""),
    ("max_service_tier", None),  # the one that cannot be empty
    ("ttft_objective_ms", 0),  # no request could start in 0 ms
    ("ttft_objective_ms", -100),
    ("ttft_objective_ms", 2.5),
    ("ttft_objective_ms", "400"),
    ("ttft_objective_ms", True),
    ("ttft_objective_ms", 2**31),
    ("tpot_objective_ms", 0),
    ("max_running_sequences", 0),
    ("max_running_sequences", 2**31),
    ("kv_share", 0.0),
    ("kv_share", 0.009),
    ("kv_share", 1.01),
    ("kv_share", math.nan),
    ("kv_share", math.inf),
    ("kv_share", "0.5"),
    ("kv_share", True),
    ("tokens_per_minute", None),
    ("requests_per_second", -1.0),
]


def policy(name: str) -> dict[str, Any]:
    """The tenant's policy as its context carries it to the gateways and replicas."""
    context = tenant_context(tenant=Tenant.objects.get(name=name))
    return {field: getattr(context, field) for field in POLICY}


def stored() -> tuple[Any, ...]:
    """Every tenant and quota setting, and the audit log's length."""
    return (
        sorted(Tenant.objects.values_list("name", flat=True)),
        sorted(Quota.objects.values_list("tenant__name", *SETTINGS)),
        AuditEntry.objects.count(),
    )


def _run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue()


@pytest.fixture
def staff(client: Client) -> Client:
    client.force_login(get_user_model().objects.create_user("alice", is_staff=True))
    return client


# --- the services ----------------------------------------------------------------------------------------


def test_a_tenant_is_made_with_its_policy_or_without_one() -> None:
    tenant_create(name="acme", **POLICY)
    tenant_create(name="plain")
    assert policy("acme") == POLICY
    assert policy("plain") == NO_POLICY


def test_quota_set_changes_the_fields_named_and_none_empties_an_objective_or_a_cap() -> None:
    acme = tenant_create(name="acme", **POLICY)
    quota_set(tenant=acme, change=QuotaChange(kv_share=0.5, max_service_tier="flex"), actor="test")
    assert policy("acme") == {**POLICY, "kv_share": 0.5, "max_service_tier": "flex"}
    change = QuotaChange(ttft_objective_ms=None, max_running_sequences=None, kv_share=1.0)
    quota_set(tenant=acme, change=change, actor="test")
    assert policy("acme") == {
        **POLICY,
        "max_service_tier": "flex",
        "ttft_objective_ms": None,
        "max_running_sequences": None,
        "kv_share": 1.0,
    }
    quota_set(tenant=acme, change=QuotaChange(kv_share=0.01, tpot_objective_ms=1), actor="test")  # the least
    assert (policy("acme")["kv_share"], policy("acme")["tpot_objective_ms"]) == (0.01, 1)


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_the_services_refuse_a_bad_value_and_change_nothing(field: str, value: Any) -> None:
    acme = tenant_create(name="acme", **POLICY)
    before = stored()
    change = QuotaChange(**{"tokens_per_minute": 5, field: value})  # a good change with it: not made
    with pytest.raises(RegistryError, match=field):
        quota_set(tenant=acme, change=change, actor="test")
    with pytest.raises(RegistryError, match=field):
        tenant_create(name="beta", **{field: value})
    assert stored() == before
    assert policy("acme") == POLICY


# --- the API ---------------------------------------------------------------------------------------------


def test_staff_set_and_empty_the_policy_over_the_api(staff: Client) -> None:
    created = send(staff, "post", "/v1/tenants", {"name": "acme", **POLICY})
    assert created.status_code == 201, created.content
    assert {k: created.json()["quota"][k] for k in POLICY} == POLICY
    assert policy("acme") == POLICY
    body = {"kv_share": None, "ttft_objective_ms": 250, "max_service_tier": "flex"}
    patched = send(staff, "patch", "/v1/tenants/acme/quota", body)
    assert patched.status_code == 200, patched.content
    expected = {**POLICY, **body}  # tpot_objective_ms and max_running_sequences, not named, stay
    assert {k: patched.json()[k] for k in POLICY} == expected == policy("acme")
    assert patched.json()["tokens_per_minute"] == 100_000
    plain = send(staff, "post", "/v1/tenants", {"name": "plain"})
    assert {k: plain.json()["quota"][k] for k in POLICY} == NO_POLICY == policy("plain")


@pytest.mark.parametrize(
    "body",
    [
        {"max_service_tier": "gold"},
        {"max_service_tier": None},
        {"ttft_objective_ms": 0},
        {"tpot_objective_ms": -1},
        {"tpot_objective_ms": 2.5},
        {"max_running_sequences": 0},
        {"max_running_sequences": 2**31},
        {"kv_share": 0},
        {"kv_share": 1.5},
        {"kv_share": "lots"},
    ],
)
def test_a_bad_policy_value_over_the_api_is_a_400_that_changes_nothing(staff: Client, body: Any) -> None:
    send(staff, "post", "/v1/tenants", {"name": "acme", **POLICY})
    before = stored()
    (field,) = body
    message = refused(send(staff, "patch", "/v1/tenants/acme/quota", {"tokens_per_minute": 5, **body}), 400)
    assert field in message, message
    assert field in refused(send(staff, "post", "/v1/tenants", {"name": "beta", **body}), 400)
    assert stored() == before
    assert policy("acme") == POLICY


# --- the commands ----------------------------------------------------------------------------------------


def test_create_tenant_and_set_quota_set_and_empty_the_policy() -> None:
    _run(
        "create_tenant",
        "acme",
        "--max-service-tier",
        "priority",
        "--ttft-objective-ms",
        "400",
        "--tpot-objective-ms",
        "40",
        "--max-running-sequences",
        "4",
        "--kv-share",
        "0.25",
    )
    assert policy("acme") == POLICY
    out = _run(
        "set_quota", "acme", "--kv-share", "0.5", "--ttft-objective-ms", "none", "--max-service-tier", "flex"
    )
    assert "max_service_tier=flex" in out and "kv_share=0.5" in out and "ttft_objective_ms=None" in out
    assert policy("acme") == {
        **POLICY,
        "max_service_tier": "flex",
        "ttft_objective_ms": None,
        "kv_share": 0.5,
    }
    _run("set_quota", "acme", "--tokens-per-minute", "500", "--may-pin")  # the older limits too
    quota = Quota.objects.get(tenant__name="acme")
    assert (quota.tokens_per_minute, quota.may_pin, quota.kv_share) == (500, True, 0.5)
    _run("set_quota", "acme", "--no-may-pin")
    assert not tenant_context(tenant=quota.tenant).may_pin
    _run("create_tenant", "plain")
    assert policy("plain") == NO_POLICY


@pytest.mark.parametrize(
    "args",
    [
        ("--max-service-tier", "gold"),
        ("--max-service-tier", "none"),
        ("--ttft-objective-ms", "0"),
        ("--tpot-objective-ms", "soon"),
        ("--max-running-sequences", "0"),
        ("--kv-share", "1.5"),
        ("--kv-share", "0"),
    ],
)
def test_the_commands_refuse_a_bad_value_and_change_nothing(args: tuple[str, str]) -> None:
    tenant_create(name="acme", **POLICY)
    before = stored()
    with pytest.raises(CommandError, match=args[0].removeprefix("--").replace("-", "[-_]")):
        _run("set_quota", "acme", "--tokens-per-minute", "5", *args)
    with pytest.raises(CommandError, match=args[0].removeprefix("--").replace("-", "[-_]")):
        _run("create_tenant", "beta", *args)
    assert stored() == before
    assert policy("acme") == POLICY


def test_set_quota_refuses_an_unknown_tenant_and_a_change_of_nothing() -> None:
    tenant_create(name="acme")
    before = stored()
    with pytest.raises(CommandError, match="unknown tenant 'nobody'"):
        _run("set_quota", "nobody", "--kv-share", "0.5")
    with pytest.raises(CommandError, match="nothing to change"):
        _run("set_quota", "acme")
    assert stored() == before


# --- the admin -------------------------------------------------------------------------------------------


def test_staff_set_and_empty_the_policy_on_the_admins_tenant_page(admin_client: Client) -> None:
    acme = tenant_create(name="acme")
    page = f"/admin/registry/tenant/{acme.pk}/change/"
    shown = admin_client.get(page).text
    assert all(f'name="quota-0-{field}"' in shown for field in POLICY)
    assert admin_client.post(page, tenant_form(acme, **POLICY)).status_code == 302
    assert policy("acme") == POLICY
    emptied = {"ttft_objective_ms": "", "kv_share": "", "max_service_tier": "flex"}
    assert admin_client.post(page, tenant_form(acme, **{**POLICY, **emptied})).status_code == 302
    assert policy("acme") == {
        **POLICY,
        "ttft_objective_ms": None,
        "kv_share": None,
        "max_service_tier": "flex",
    }


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("kv_share", "1.5", "kv_share must be a share from 0.01 to 1"),
        ("kv_share", "0.001", "kv_share must be a share from 0.01 to 1"),
        ("max_running_sequences", "0", "max_running_sequences must be a whole number from 1"),
        ("ttft_objective_ms", "0", "ttft_objective_ms must be a whole number of milliseconds from 1"),
        ("tpot_objective_ms", str(2**31), "tpot_objective_ms must be a whole number of milliseconds"),
        ("max_service_tier", "gold", "Select a valid choice"),
    ],
)
def test_the_admin_shows_a_bad_value_at_its_field_and_changes_nothing(
    admin_client: Client, field: str, value: str, shown: str
) -> None:
    acme = tenant_create(name="acme", **POLICY)
    before = stored()
    page = f"/admin/registry/tenant/{acme.pk}/change/"
    response = admin_client.post(page, tenant_form(acme, **{**POLICY, "tokens_per_minute": 5, field: value}))
    assert response.status_code == 200  # the form again, with the error
    html = response.text
    row = html[html.index(f"field-{field}") :]
    assert row.index("errorlist") < row.index("</div>") and shown in row[: row.index("</ul>")], row[:600]
    assert stored() == before
    assert policy("acme") == POLICY
