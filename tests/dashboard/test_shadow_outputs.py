"""A shadow deployment's page: the copies' match rate with, beside it, their mean agreement and first
divergence and the histograms of both, and the differing outputs kept for staff (redacted upstream)."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db


@pytest.fixture
def shadow(chat: Any) -> Any:
    from rollouts.services import deployment_create

    return deployment_create(
        model=chat, version="v2", created_by="test", strategy="shadow", steps=None, mirror_pct=50
    )


def test_the_deployment_page_shows_agreement_and_divergence_beside_the_match_rate(
    staff_client: Client, shadow: Any
) -> None:
    from registry.models import ModelVersion
    from serving.models import ShadowDiffPair

    shadow.last_verdict = {
        "verdict": "hold",
        "reason": "healthy so far",
        "figures": {
            "output_match": {"compared": 10, "matched": 7, "rate": 0.7},
            "output_diff": {
                "compared": 10,
                "mean_agreement": 0.8125,
                "agreement_histogram": {"0-0.25": 1, "0.5-0.75": 1, "0.75-0.9": 1, "0.99-1": 7},
                "diverged": 3,
                "mean_first_divergence": 4.33,
                "first_divergence_histogram": {"0": 1, "1": 0, "2-3": 0, "4-7": 1, "8-15": 1},
            },
        },
    }
    shadow.save()
    ShadowDiffPair.objects.create(
        version=ModelVersion.objects.get(model__name="chat", version="v2"),
        primary_version="v1",
        request_id="req-1",
        input="mail [EMAIL] please",
        primary_output="the answer is yes",
        candidate_output="the answer is no",
        first_divergence=3,
        agreement=0.75,
    )
    html = staff_client.get(f"/dashboard/deployments/{shadow.pk}/").text
    assert 'id="shadow-outputs"' in html
    assert "0.7000 (7 of 10)" in html  # the match rate
    assert "0.8125 (of 10 copies)" in html  # beside it, the mean agreement
    assert "token 4.3 (3 copies differed)" in html
    assert 'id="shadow-agreement-histogram"' in html and 'id="shadow-divergence-histogram"' in html
    assert "the answer is no" in html and "mail [EMAIL] please" in html  # the kept pair, for staff
    # The dashboard is staff only: an anonymous visitor is sent to the login page.
    assert Client().get(f"/dashboard/deployments/{shadow.pk}/").status_code == 302


def test_a_canary_deployment_has_no_shadow_panel(staff_client: Client, deployment: Any) -> None:
    assert 'id="shadow-outputs"' not in staff_client.get(f"/dashboard/deployments/{deployment.pk}/").text
