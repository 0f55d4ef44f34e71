"""The page at / (a new user's browser lands there from the start banner): public, a page of links."""

from __future__ import annotations

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db


def test_the_root_is_a_public_page_of_links_to_the_dashboard_the_schema_and_the_probes() -> None:
    response = Client().get("/")
    assert response.status_code == 200 and response["Content-Type"].startswith("text/html")
    for link in ('href="/dashboard/"', 'href="/v1/schema"', 'href="/healthz"', 'href="/readyz"'):
        assert link in response.text
    assert "http://testserver/v1/models/demo-chat/infer" in response.text  # a first request, for this host


def test_the_root_answers_only_reads() -> None:
    assert Client().head("/").status_code == 200
    assert Client().post("/").status_code == 405
