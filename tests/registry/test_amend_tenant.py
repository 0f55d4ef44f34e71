"""Amending a tenant from a shell (issue 43: `create_tenant` could not): `create_tenant NAME --update`
and `set_quota` change the rights and limits named (pin, deploy, the models it may use and roll out, its
tier), keep the others, and go through the one service PATCH /v1/tenants/{tenant}/quota uses."""

from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from audit.models import AuditEntry
from registry.models import Model, Quota, Tenant
from registry.selectors import tenant_context

pytestmark = pytest.mark.django_db


def _run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue()


def _context(name: str):  # type: ignore[no-untyped-def]
    return tenant_context(tenant=Tenant.objects.get(name=name))


@pytest.fixture
def models() -> None:
    for name in ("chat", "embed", "judge"):
        Model.objects.create(name=name)


@pytest.mark.usefixtures("models")
@pytest.mark.parametrize("command", [("create_tenant", "--update"), ("set_quota",)])
def test_an_amendment_changes_the_rights_named_and_keeps_the_rest(command: tuple[str, ...]) -> None:
    _run("create_tenant", "acme", "--requests-per-second", "5", "--allow-model", "chat")
    out = _run(
        command[0], "acme", *command[1:],
        "--may-pin", "--may-deploy", "--deploy-model", "chat", "--deploy-model", "judge",
        "--allow-model", "embed", "--max-service-tier", "priority",
    )  # fmt: skip
    acme = _context("acme")
    assert acme.may_pin and acme.may_deploy and acme.max_service_tier == "priority"
    assert acme.deployable_model_names == {"chat", "judge"} and acme.allowed_model_names == {"embed"}
    assert acme.requests_per_second == 5  # not named: kept
    assert "deployable_models=[chat,judge]" in out and "may_pin=True" in out

    _run(
        command[0], "acme", *command[1:], "--no-may-deploy", "--deploy-model", "none", "--allow-model", "none"
    )
    acme = _context("acme")
    assert not acme.may_deploy and acme.may_pin  # --may-pin was not named again: kept
    assert acme.deployable_model_names == frozenset() and acme.allowed_model_names == frozenset()


@pytest.mark.usefixtures("models")
def test_an_amendment_is_one_audited_update_and_a_refused_one_changes_nothing() -> None:
    _run("create_tenant", "acme")
    _run("create_tenant", "acme", "--update", "--may-pin", "--deploy-model", "chat")
    updates = AuditEntry.objects.filter(action="update", object_type="quota")
    assert updates.count() == 1 and updates.get().actor.startswith("command:create_tenant")
    before = Quota.objects.values().get(tenant__name="acme")
    for args, message in (
        (("--may-deploy", "--deploy-model", "nope"), "unknown model"),
        (("--may-deploy", "--kv-share", "2"), "kv_share"),
        ((), "nothing to change"),
    ):
        with pytest.raises(CommandError, match=message):
            _run("create_tenant", "acme", "--update", *args)
    assert Quota.objects.values().get(tenant__name="acme") == before
    assert _context("acme").deployable_model_names == {"chat"}


def test_create_tenant_says_how_to_amend_an_existing_one_and_update_needs_one() -> None:
    _run("create_tenant", "acme")
    with pytest.raises(CommandError, match=r"already exists: amend it with `create_tenant acme --update"):
        _run("create_tenant", "acme", "--may-pin")
    with pytest.raises(CommandError, match="unknown tenant 'nobody'"):
        _run("create_tenant", "nobody", "--update", "--may-pin")
    assert not _context("acme").may_pin
