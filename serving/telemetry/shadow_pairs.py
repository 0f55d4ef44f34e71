"""The differing outputs of shadow copies kept for staff (serving.models.ShadowDiffPair): written by the
gateway when a copy differs from its primary and prompt logging is on, read by the dashboard's deployment
page (through serving/selectors.py) and the admin. Everything stored is redacted before it gets here."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.conf import settings

from registry.models import ModelVersion
from serving.models import ShadowDiffPair

_full: set[tuple[str, str]] = set()  # (model, version) that hold their SHADOW_DIFF_PAIRS: no query more


def save_pair(
    *,
    model_name: str,
    version: str,
    primary_version: str,
    request_id: str,
    input: Any,
    primary_output: str,
    candidate_output: str,
    first_divergence: int | None,
    agreement: float,
) -> bool:
    """Keep one pair unless the candidate version already has its settings.SHADOW_DIFF_PAIRS (the first
    ones are kept, not the latest: a version's pairs stop costing anything once it has them). True when
    kept."""
    limit = int(settings.SHADOW_DIFF_PAIRS)
    if limit <= 0 or (model_name, version) in _full:
        return False
    found = ModelVersion.objects.filter(model__name=model_name, version=version).first()
    if found is None:
        return False
    if ShadowDiffPair.objects.filter(version=found).count() >= limit:
        _full.add((model_name, version))
        return False
    ShadowDiffPair.objects.create(
        version=found,
        primary_version=primary_version,
        request_id=request_id,
        input=input,
        primary_output=primary_output,
        candidate_output=candidate_output,
        first_divergence=first_divergence,
        agreement=agreement,
    )
    return True


def pairs_of(*, model_name: str, version: str, since: datetime | None = None) -> list[dict[str, Any]]:
    """A candidate version's kept pairs, newest first (those from `since` on, when given)."""
    rows = ShadowDiffPair.objects.filter(version__model__name=model_name, version__version=version)
    if since is not None:
        rows = rows.filter(created_at__gte=since)
    return [
        {
            "request_id": row.request_id,
            "primary_version": row.primary_version,
            "input": row.input,
            "primary_output": row.primary_output,
            "candidate_output": row.candidate_output,
            "first_divergence": row.first_divergence,
            "agreement": row.agreement,
            "created_at": row.created_at,
        }
        for row in rows[: max(1, int(settings.SHADOW_DIFF_PAIRS))]
    ]
