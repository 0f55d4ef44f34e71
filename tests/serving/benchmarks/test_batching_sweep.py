"""`manage.py bench batching` on a tiny grid: the table's shape, every request of every cell served, and
the heatmaps written as one HTML file that needs no network."""

from __future__ import annotations

import io
import random
import re
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from serving.benchmarks.batching_sweep import poisson_arrivals


def _row_pattern() -> re.Pattern[str]:
    # rate, batch, wait, p50, p99, inputs/s, mean batch, served/sent
    number = r"\s+([\d.]+)"
    return re.compile(rf"^\s*(\d+)\s+(\d+){number}{number}{number}{number}{number}\s+(\d+)/(\d+)$")


def test_the_sweep_on_a_tiny_grid_serves_every_cell_and_writes_the_heatmaps(
    demo_embedding_model_dir: Path, tmp_path: Path
) -> None:
    html = tmp_path / "sweep.html"
    out = io.StringIO()
    call_command(
        "bench",
        "batching",
        "--model-dir",
        str(demo_embedding_model_dir),
        "--batch-sizes",
        "1,4",
        "--waits",
        "0,2",
        "--duration",
        "0.5",
        "--capacity-inputs",
        "40",
        "--html",
        str(html),
        "--no-progress",
        stdout=out,
        stderr=io.StringIO(),
    )
    text = out.getvalue()
    rows = [match.groups() for line in text.splitlines() if (match := _row_pattern().match(line))]
    # 3 rates x 2 batch sizes x 2 waits, each once
    assert len(rows) == 12
    rates = sorted({row[0] for row in rows}, key=float)
    assert len(rates) == 3  # below, near and above the measured capacity
    assert {(row[1], row[2]) for row in rows} == {("1", "0"), ("1", "2"), ("4", "0"), ("4", "2")}
    for _rate, size, _wait, p50, p99, inputs_per_s, mean_batch, served, sent in rows:
        assert int(sent) > 0 and served == sent  # no request lost
        assert 0 < float(p50) <= float(p99)
        assert float(inputs_per_s) > 0
        assert 1 <= float(mean_batch) <= int(size)
    assert "every one served" in text
    assert re.search(r"time: capacity [\d.]+ s, grid [\d.]+ s, total [\d.]+ s", text)
    assert "one replica's capacity" in text
    assert text.count("p99 latency (ms) at") == 3  # a matrix per rate

    page = html.read_text()
    assert page.startswith("<html>") or page.lower().startswith("<!doctype html>")
    assert "<script src=" not in page  # plotly.js inlined, no CDN
    assert "plotly.js v" in page
    for label in ("p50 ms at", "p99 ms at", "inputs/s at"):  # a heatmap of each per rate
        assert page.count(label.replace("/", "\\u002f")) == 3  # plotly's JSON escapes "/"


def test_the_sweep_refuses_bad_grids(demo_embedding_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(CommandError):
        call_command("bench", "batching", "--model-dir", str(demo_embedding_model_dir), "--batch-sizes", "0")
    with pytest.raises(CommandError):
        call_command("bench", "batching", "--model-dir", str(demo_embedding_model_dir), "--waits", "-1")


def test_poisson_arrivals_fill_the_duration_at_the_rate() -> None:
    arrivals = poisson_arrivals(1000.0, 2.0, random.Random(1))
    assert arrivals == sorted(arrivals) and arrivals[0] > 0 and arrivals[-1] < 2.0
    assert 1800 < len(arrivals) < 2200
    assert len(poisson_arrivals(0.001, 0.1, random.Random(1))) == 1  # always at least one


def test_the_defaults_the_sweep_chose_apply_on_a_cpu(demo_embedding_model_dir: Path, settings: Any) -> None:
    from serving.engine.encoder import CPU_MAX_BATCH_SIZE, CPU_MAX_WAIT_S, EncoderEngine
    from serving.replica.config import encoder_config_from_settings

    settings.REPLICA_EMBED_MAX_BATCH_SIZE = None  # unset, as in config/settings.py by default
    settings.REPLICA_EMBED_MAX_WAIT_S = None
    engine = EncoderEngine(demo_embedding_model_dir, config=encoder_config_from_settings())
    assert (CPU_MAX_BATCH_SIZE, CPU_MAX_WAIT_S) == (8, 0.0)  # docs/benchmarks.md, "The batching sweep"
    assert engine.config.max_batch_size == engine.batcher.config.max_batch_size == CPU_MAX_BATCH_SIZE
    assert engine.batcher.config.max_wait_s == CPU_MAX_WAIT_S


@pytest.mark.django_db
def test_the_sweep_runs_on_a_registered_version_and_refuses_a_generative_one(
    demo_embedding_model_dir: Path, registered_model: Any, tmp_path: Path
) -> None:
    from registry.models import Model
    from registry.services import model_version_register

    model_version_register(
        name="embed", version="v1", source_dir=demo_embedding_model_dir, kind=Model.Kind.EMBEDDING
    )
    out = io.StringIO()
    grid = ["--batch-sizes", "4", "--waits", "0", "--duration", "0.2", "--capacity-inputs", "20"]
    call_command(
        "bench",
        "batching",
        "--model",
        "embed:v1",
        *grid,
        "--html",
        str(tmp_path / "h.html"),
        "--no-progress",
        stdout=out,
        stderr=io.StringIO(),
    )
    assert "Switchyard batching sweep: embed:v1" in out.getvalue() and "every one served" in out.getvalue()
    with pytest.raises(CommandError, match="generative"):
        call_command("bench", "batching", "--model", "demo-chat:v1", *grid, "--no-progress")
    with pytest.raises(CommandError, match="no registered version"):
        call_command("bench", "batching", "--model", "embed:v9", *grid, "--no-progress")
