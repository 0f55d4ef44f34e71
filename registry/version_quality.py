"""A version's measured quality (ModelVersion.quality): what `manage.py quantize` measured of a quantized
sibling against its parent on held-out text (docs/architecture.md, "Quantized siblings"), and what the
rollout judge's quality floor reads. A measurement, not the artifact: recorded, or measured again, after
registration, each time in the audit log."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from django.db import transaction

from audit.log import Action, ObjectType, Snapshot, record
from registry.models import ModelVersion
from registry.services import RegistryError

# The figures a recorded evaluation must carry (serving/engine/quality.py, QualityReport.as_record).
REQUIRED_FIGURES = ("parent_perplexity", "perplexity", "greedy_agreement", "num_tokens", "text_sha256")


def _snapshot(row: ModelVersion) -> Snapshot:
    return Snapshot(ObjectType.MODEL_VERSION, f"{row.model.name}:{row.version}", {"quality": row.quality})


def quality_problem(quality: Mapping[str, Any]) -> str | None:
    """Why these figures cannot be recorded, or None."""
    missing = [name for name in REQUIRED_FIGURES if name not in quality]
    if missing:
        return f"a quality record needs {', '.join(missing)}"
    for name in ("parent_perplexity", "perplexity", "greedy_agreement"):
        value = quality[name]
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return f"{name} must be a finite number, got {value!r}"
    if not 0 <= quality["greedy_agreement"] <= 1:
        return f"greedy_agreement must be in [0, 1], got {quality['greedy_agreement']!r}"
    return None


@transaction.atomic
def model_version_quality_set(
    *, model_version: ModelVersion, quality: Mapping[str, Any], actor: str
) -> ModelVersion:
    """Record the version's measured quality, replacing what was recorded before."""
    if (problem := quality_problem(quality)) is not None:
        raise RegistryError(problem)
    row = ModelVersion.objects.select_for_update().select_related("model").get(pk=model_version.pk)
    before = _snapshot(row)
    row.quality = dict(quality)
    row.save(update_fields=["quality"])
    record(actor=actor, action=Action.UPDATE, before=before, after=_snapshot(row))
    return row
