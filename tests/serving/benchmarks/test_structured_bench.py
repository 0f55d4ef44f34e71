"""Smoke test of `manage.py bench structured` on the tiny demo model: both systems run, the ratio and the
compile times are reported, and the engine's mask function is itself again afterwards."""

from __future__ import annotations

from io import StringIO
from pathlib import Path

from django.core.management import call_command

import serving.engine.engine as engine_module
from serving.engine.grammar_mask import mask_logits


def test_bench_structured_reports_the_ratio_and_the_compile_time(demo_model_dir: Path) -> None:
    out, err = StringIO(), StringIO()
    call_command(
        "bench",
        "structured",
        "--model-dir",
        str(demo_model_dir),
        "--batch",
        "4",
        "--max-tokens",
        "6",
        "--repeat",
        "1",
        "--torch-threads",
        "1",
        stdout=out,
        stderr=err,
    )
    text = out.getvalue()
    assert "constrained: 2 of them" in text
    assert "constrained / none: throughput x" in text and "the grammars' own share" in text
    assert "compile, typical nested schema" in text and "from the cache" in text
    assert "round 1 none" in err.getvalue() and "round 1 constrained" in err.getvalue()
    assert engine_module.mask_logits is mask_logits
