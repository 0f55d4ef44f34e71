"""The audit log itself: one entry per change, none for a write that changed nothing, nothing secret,
and an entry no one can edit."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from audit import actors
from audit.log import Action, ObjectType, Snapshot, record
from audit.models import AuditEntry
from audit.selectors import AuditQuery, audit_entries, audit_row
from registry.models import ApiKey
from registry.services import alias_set, api_key_create, api_key_revoke, routing_table_set
from tests.audit.conftest import last_id, logged
from tests.conftest import model_rows

pytestmark = pytest.mark.django_db


def test_a_write_that_changes_nothing_records_nothing() -> None:
    chat = model_rows("chat", ("v1", "v2"))
    start = last_id()
    v1 = chat.versions.get(version="v1")
    alias_set(model=chat, name="stable", version=v1, actor="staff:alice")  # already there
    routing_table_set(model=chat, weights={"v1": 100}, actor="staff:alice")  # already so
    assert logged(start) == []
    same = Snapshot(ObjectType.ALIAS, "chat@stable", {"version": "v1"})
    assert record(actor="x", action=Action.UPDATE, before=same, after=same) is None


def test_before_and_after_say_what_changed() -> None:
    chat = model_rows("chat", ("v1", "v2"))
    start = last_id()
    routing_table_set(model=chat, weights={"v1": 90, "v2": 10}, actor="staff:alice", reason="try v2")
    entry = AuditEntry.objects.get(pk__gt=start)
    assert (entry.actor, entry.action, entry.object_type, entry.object_id, entry.reason) == (
        "staff:alice",
        "update",
        "routing_table",
        "chat",
        "try v2",
    )
    assert entry.before == {"weights": {"v1": 100}, "mirror": None}
    assert entry.after == {"weights": {"v1": 90, "v2": 10}, "mirror": None}
    assert audit_row(entry).changed == ("weights",)


def test_a_key_is_logged_by_its_prefix_never_the_key_or_its_hash(make_tenant) -> None:  # type: ignore[no-untyped-def]
    acme = make_tenant("acme")
    api_key, raw_key = api_key_create(tenant=acme.tenant, name="ci", actor="staff:alice")
    api_key_revoke(key=raw_key, actor="staff:alice")
    dumped = json.dumps(list(AuditEntry.objects.values()), default=str)
    assert raw_key not in dumped and api_key.key_hash not in dumped
    assert raw_key[ApiKey.PREFIX_LENGTH :] not in dumped
    assert logged(object_type="api_key", object_id=api_key.prefix) == [
        ("staff:alice", "create", "api_key", api_key.prefix),
        ("staff:alice", "revoke", "api_key", api_key.prefix),
    ]


def test_a_failed_change_leaves_no_entry() -> None:
    chat = model_rows("chat", ("v1", "v2"))
    start = last_id()
    with pytest.raises(Exception, match="sum to 100"):
        routing_table_set(model=chat, weights={"v1": 90}, actor="staff:alice")
    assert logged(start) == []


def test_the_selector_filters_by_type_actor_and_time_newest_first() -> None:
    chat = model_rows("chat", ("v1", "v2"))
    routing_table_set(model=chat, weights={"v1": 50, "v2": 50}, actor="staff:alice")
    alias_set(model=chat, name="eval", version=chat.versions.get(version="v2"), actor="tenant:acme")
    newest = list(audit_entries(AuditQuery()))
    assert newest[0].object_type == "alias" and newest[1].object_type == "routing_table"
    assert [e.actor for e in audit_entries(AuditQuery(actor="ALICE"))] == ["staff:alice"]
    assert [e.object_id for e in audit_entries(AuditQuery(object_type="alias", actor="acme"))] == [
        "chat@eval"
    ]
    later = newest[0].at
    assert [e.object_id for e in audit_entries(AuditQuery(since=later))] == ["chat@eval"]
    assert "chat@eval" not in [e.object_id for e in audit_entries(AuditQuery(until=later))]


def test_the_admin_shows_entries_and_changes_none(client: Client) -> None:
    from django.contrib.auth import get_user_model

    model_rows("chat", ("v1",))
    entry = AuditEntry.objects.first()
    assert entry is not None
    client.force_login(get_user_model().objects.create_user("alice", is_staff=True, is_superuser=True))
    assert client.get("/admin/audit/auditentry/").status_code == 200
    assert client.get(f"/admin/audit/auditentry/{entry.pk}/change/").status_code == 200
    assert client.get("/admin/audit/auditentry/add/").status_code == 403
    assert client.post(f"/admin/audit/auditentry/{entry.pk}/delete/", {"post": "yes"}).status_code == 403
    client.post(f"/admin/audit/auditentry/{entry.pk}/change/", {"actor": "mallory"})
    assert AuditEntry.objects.get(pk=entry.pk).actor == entry.actor


def test_actors_name_commands_with_the_os_user() -> None:
    actor = actors.command("registry.management.commands.set_traffic")
    assert actor.startswith("command:set_traffic (") and actor.endswith(")")
