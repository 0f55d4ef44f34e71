"""`manage.py quantize`: the int8 sibling registered as a new version (parent, quantization, digests), its
quality measured and recorded (and recomputable), the refusals, the versions API, and a replica serving
it (greedy equal to transformers' generate on the same int8 module)."""

from __future__ import annotations

import math
from io import StringIO
from pathlib import Path

import pytest
import torch
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.test import Client

from registry import artifacts
from registry.models import Model, ModelVersion
from registry.selectors import version_ref
from registry.services import model_version_register
from serving.benchmarks.bench_model import ensure_bench_model
from serving.engine.loading import load_causal_lm
from serving.engine.quality import DEFAULT_TEXT, evaluate
from serving.engine.quantize import weight_bytes, write_int8_sibling
from serving.engine.sequence import SamplingParams
from serving.management.commands.run_replica import engine_config_from_options
from serving.replica.replica import Replica

pytestmark = pytest.mark.django_db

SHORT_TEXT = "Once upon a time, a little train carried letters between the hills and the sea.\n"


def _run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue()


@pytest.fixture(scope="session")
def bench_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_bench_model(tmp_path_factory.mktemp("bench-model"))


@pytest.fixture
def short_text(tmp_path: Path) -> Path:
    path = tmp_path / "short.txt"
    path.write_text(SHORT_TEXT)
    return path


def test_the_bench_models_int8_sibling_is_at_most_30_percent_of_its_weights(
    bench_model_dir: Path, short_text: Path
) -> None:
    _run("register_model", "bench", "v1", "--from", str(bench_model_dir))
    out = _run(
        "quantize", "bench", "v1", "--to", "v1-int8", "--method", "int8-weight", "--text", str(short_text)
    )

    parent = ModelVersion.objects.get(model__name="bench", version="v1")
    sibling = ModelVersion.objects.get(model__name="bench", version="v1-int8")
    assert sibling.parent == parent and sibling.quantization == "int8-weight"
    assert sibling.adapter_of is None and parent.quantization == ""
    ratio = weight_bytes(Path(sibling.artifact_uri)) / weight_bytes(Path(parent.artifact_uri))
    assert ratio <= 0.30, f"int8 weights are {ratio:.1%} of fp32"
    # The same digest machinery as any registration: the files as registered, one digest over them.
    assert sibling.sha256 == artifacts.manifest_digest(sibling.files)
    artifacts.verify(Path(sibling.artifact_uri), expected_files=sibling.files, expected_sha256=sibling.sha256)
    assert f"sha256:{sibling.sha256}" in out
    quality = sibling.quality
    assert quality["parent"] == "v1" and quality["method"] == "int8-weight" and quality["text"] == "short.txt"
    assert quality["num_tokens"] > 10 and 0 <= quality["greedy_agreement"] <= 1
    assert math.isclose(quality["perplexity_delta"], quality["perplexity"] - quality["parent_perplexity"])
    # A new version of the model starts without traffic.
    assert sibling.routing_entries.get().weight == 0


def test_quantize_refuses_an_unknown_method_a_quantized_version_and_an_adapter(
    demo_model_dir: Path, short_text: Path
) -> None:
    _run("register_model", "chat", "v1", "--from", str(demo_model_dir))
    with pytest.raises(CommandError, match=r"unknown quantization method 'int4'; known: int8-weight"):
        _run("quantize", "chat", "v1", "--to", "v2", "--method", "int4")
    with pytest.raises(CommandError, match=r"no version chat:v9"):
        _run("quantize", "chat", "v9", "--to", "v2")
    _run("quantize", "chat", "v1", "--to", "v1-int8", "--text", str(short_text))
    with pytest.raises(
        CommandError, match=r"chat:v1-int8 is already quantized \(int8-weight\); quantize its parent v1"
    ):
        _run("quantize", "chat", "v1-int8", "--to", "v1-int8-int8", "--text", str(short_text))
    with pytest.raises(CommandError, match=r"chat:v1-int8 is already registered"):
        _run("quantize", "chat", "v1", "--to", "v1-int8", "--text", str(short_text))
    base = ModelVersion.objects.get(model__name="chat", version="v1")
    adapter_model = Model.objects.create(name="chat-tuned")
    ModelVersion.objects.create(
        model=adapter_model, version="a1", artifact_uri="/nowhere", sha256="0" * 64, size_bytes=0, files={},
        adapter_of=base,
    )  # fmt: skip
    with pytest.raises(
        CommandError, match=r"chat-tuned:a1 is a LoRA adapter \(of chat:v1\); quantize its base"
    ):
        _run("quantize", "chat-tuned", "a1", "--to", "a1-int8", "--text", str(short_text))
    assert set(ModelVersion.objects.values_list("version", flat=True)) == {"v1", "v1-int8", "a1"}


def test_the_versions_api_shows_the_siblings_parent_quantization_and_quality(
    demo_model_dir: Path, short_text: Path, client: Client
) -> None:
    _run("register_model", "chat", "v1", "--from", str(demo_model_dir))
    _run("quantize", "chat", "v1", "--to", "v1-int8", "--text", str(short_text))
    client.force_login(get_user_model().objects.create_user("alice", is_staff=True))
    rows = {row["version"]: row for row in client.get("/v1/models/chat/versions").json()}
    assert (rows["v1"]["parent"], rows["v1"]["quantization"], rows["v1"]["quality"]) == (None, None, None)
    sibling = rows["v1-int8"]
    assert (sibling["parent"], sibling["quantization"]) == ("v1", "int8-weight")
    assert sibling["quality"] == ModelVersion.objects.get(version="v1-int8").quality
    page = client.get("/dashboard/models/chat/").content.decode()
    agreement = round(sibling["quality"]["greedy_agreement"] * 100)
    assert f"int8-weight of v1: greedy agreement {agreement}%" in page


def test_quantized_stories260k_records_what_a_recomputation_finds(stories_dir: Path) -> None:
    _run("register_model", "stories", "v1", "--from", str(stories_dir))
    _run("quantize", "stories", "v1", "--to", "v1-int8", "--method", "int8-weight")
    parent = ModelVersion.objects.get(model__name="stories", version="v1")
    sibling = ModelVersion.objects.get(model__name="stories", version="v1-int8")
    recorded = sibling.quality
    again = evaluate(parent.artifact_uri, sibling.artifact_uri, text=DEFAULT_TEXT.read_text())
    assert recorded["text_sha256"] == again.text_sha256 and recorded["num_tokens"] == again.num_tokens
    assert math.isclose(recorded["perplexity_delta"], again.perplexity_delta, rel_tol=1e-6, abs_tol=1e-9)
    assert math.isclose(recorded["perplexity"], again.perplexity, rel_tol=1e-9)
    assert recorded["greedy_agreement"] == again.greedy_agreement
    # A real model keeps its quality at int8 (the figures recorded in docs/benchmarks.md).
    assert abs(recorded["perplexity_increase"]) < 0.02 and recorded["greedy_agreement"] > 0.95


@pytest.mark.django_db(transaction=True)
def test_a_replica_serves_the_int8_sibling_as_transformers_generates_on_it(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    model_version_register(name="chat", version="v1", source_dir=demo_model_dir)
    written = write_int8_sibling(demo_model_dir, tmp_path / "int8")
    parent = ModelVersion.objects.get(version="v1")
    model_version_register(
        name="chat",
        version="v1-int8",
        source_dir=written.directory,
        parent=parent,
        quantization="int8-weight",
    )
    ref = version_ref(model_name="chat", version="v1-int8")
    assert ref is not None
    options = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "kv_cache_mb": 2, "compile": False}
    replica = Replica(ref, layer=None, engine_config=engine_config_from_options({**options, "device": "cpu"}))
    engine = replica._load()
    assert engine.runner.fused is None and "int8-weight" in engine.runner.describe()
    prompts = {"a": [1, 5, 9, 13, 17, 21], "b": [1, 40, 41, 42]}
    for request_id, prompt in prompts.items():
        engine.add_request(
            request_id, prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        )
    tokens: dict[str, list[int]] = {k: [] for k in prompts}
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    reference = load_causal_lm(
        ref.artifact_uri, device="cpu", dtype=torch.float32, attn_implementation="sdpa"
    )
    with torch.inference_mode():
        for request_id, prompt in prompts.items():
            generated = reference.generate(
                torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0
            )
            assert tokens[request_id] == generated[0, len(prompt) :].tolist(), request_id
