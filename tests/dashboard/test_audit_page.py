"""The audit log's page: every recorded change, newest first, filtered by object type, actor and time
range; staff only (tests/dashboard/test_views.py checks who may see it with the other pages)."""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from audit.models import AuditEntry
from registry.services import api_key_create, routing_table_set, tenant_create

pytestmark = pytest.mark.django_db


def _rows(response: Any) -> list[str]:
    """Each row's object, as the page names it, top to bottom."""
    assert response.status_code == 200, response.content
    return re.findall(r"<code>([^<]+)</code></td>", response.text)


@pytest.fixture
def history(chat: Any) -> dict[str, Any]:
    """chat's routing changed by alice, then tenant acme and a key of it made by a command; the first
    entries (chat's rows) moved an hour back."""
    AuditEntry.objects.update(at=timezone.now() - dt.timedelta(hours=1))
    routing_table_set(model=chat, weights={"v1": 60, "v2": 40}, actor="staff:alice")
    acme = tenant_create(name="acme", actor="command:create_tenant (ops)")
    api_key, raw_key = api_key_create(tenant=acme, actor="command:create_api_key (ops)")
    return {"prefix": api_key.prefix, "raw_key": raw_key, "hash": api_key.key_hash}


def test_the_page_lists_entries_newest_first_with_before_and_after(
    staff_client: Client, history: Any
) -> None:
    response = staff_client.get("/dashboard/audit/")
    rows = _rows(response)
    assert rows[:4] == [history["prefix"], "acme", "acme", "chat"]  # key, quota, tenant, routing
    assert rows[-1] == "chat@stable"  # chat's first alias, an hour back
    assert "&quot;v2&quot;: 40" in response.text  # the routing change's after, as JSON
    assert history["raw_key"] not in response.text and history["hash"] not in response.text


def test_the_page_filters_by_type_actor_and_time(staff_client: Client, history: Any) -> None:
    assert _rows(staff_client.get("/dashboard/audit/?object_type=routing_table")) == ["chat"]
    assert _rows(staff_client.get("/dashboard/audit/?actor=OPS")) == [history["prefix"], "acme", "acme"]
    since = (timezone.now() - dt.timedelta(minutes=10)).strftime("%Y-%m-%dT%H:%M")
    recent = _rows(staff_client.get(f"/dashboard/audit/?since={since}"))
    assert recent == [history["prefix"], "acme", "acme", "chat"]
    older = _rows(staff_client.get(f"/dashboard/audit/?until={since}"))
    assert older and "acme" not in older and history["prefix"] not in older
    both = _rows(staff_client.get(f"/dashboard/audit/?object_type=tenant&actor=ops&since={since}"))
    assert both == ["acme"]
    assert _rows(staff_client.get("/dashboard/audit/?actor=nobody")) == []


def test_a_bad_filter_is_a_400_that_says_why(staff_client: Client, history: Any) -> None:
    for query in ("object_type=secrets", "since=yesterday", "since=2026-02-01T00:00&until=2026-01-01T00:00"):
        response = staff_client.get(f"/dashboard/audit/?{query}")
        assert response.status_code == 400, query
        assert 'class="message error"' in response.text
        assert "<pre" not in response.text  # no entries shown under a filter that did not apply


def test_the_page_is_paged_and_keeps_its_filters(staff_client: Client, chat: Any) -> None:
    for i in range(1, 56):  # each a change: the split alternates
        routing_table_set(model=chat, weights={"v1": 100 - (i % 2), "v2": i % 2}, actor="staff:alice")
    first = staff_client.get("/dashboard/audit/?actor=alice")
    assert len(_rows(first)) == 50 and "page 1 of 2" in first.text
    assert "?actor=alice&amp;page=2" in first.text
    assert len(_rows(staff_client.get("/dashboard/audit/?actor=alice&page=2"))) == 5
