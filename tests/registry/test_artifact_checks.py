"""Registration refuses what a replica could not load safely, before anything is copied: a file named
.safetensors that is not one (a renamed pickle), a header that does not hold together, and a config that
asks for custom code (auto_map), which the loader would otherwise serve with some other class."""

from __future__ import annotations

import json
import pickle
import re
import shutil
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from registry.artifacts import ArtifactError, validate_source_dir
from registry.safetensors_header import SafetensorsHeaderError, check_safetensors


def _copy(demo_model_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(demo_model_dir, target)
    return target


def _weights(model_dir: Path) -> Path:
    (weights,) = model_dir.glob("*.safetensors")
    return weights


def _safetensors(header: dict[str, object], data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def test_the_demo_model_passes(demo_model_dir: Path) -> None:
    assert check_safetensors(_weights(demo_model_dir)) > 0
    validate_source_dir(demo_model_dir)


def test_a_pickle_renamed_safetensors_is_refused(demo_model_dir: Path, tmp_path: Path) -> None:
    model = _copy(demo_model_dir, tmp_path)
    _weights(model).write_bytes(pickle.dumps({"weight": [1.0, 2.0]}))
    with pytest.raises(ArtifactError, match="not a valid safetensors file"):
        validate_source_dir(model)


@pytest.mark.parametrize(
    ("header", "data", "why"),
    [
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "cover"),
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "shape and dtype"),
        ({"w": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "unknown dtype"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
            "does not start",
        ),
        ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, "shape"),
    ],
)
def test_a_header_that_does_not_hold_together_is_refused(
    tmp_path: Path, header: dict[str, object], data: bytes, why: str
) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(_safetensors(header, data))
    with pytest.raises(SafetensorsHeaderError, match=why):
        check_safetensors(path)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_never_pass_for_safetensors_nor_crash_the_check(tmp_path_factory, blob: bytes) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("blob") / "model.safetensors"
    path.write_bytes(blob)
    try:
        check_safetensors(path)
    except SafetensorsHeaderError:
        return
    # Only an empty-tensor file can be this short and valid: a header that is an object, nothing after.
    assert json.loads(blob[8:]) is not None


@pytest.mark.parametrize(
    ("file", "key"),
    [
        ("config.json", {"auto_map": {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}}),
        ("tokenizer_config.json", {"auto_map": {"AutoTokenizer": ["org/repo--tokenization.T", None]}}),
        ("config.json", {"trust_remote_code": True}),
    ],
)
def test_a_config_that_asks_for_custom_code_is_refused(
    demo_model_dir: Path, tmp_path: Path, file: str, key: dict[str, object]
) -> None:
    model = _copy(demo_model_dir, tmp_path)
    path = model / file
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, **key}))
    with pytest.raises(ArtifactError, match="custom code"):
        validate_source_dir(model)


def _with_template(demo_model_dir: Path, tmp_path: Path, template: str) -> Path:
    model = _copy(demo_model_dir, tmp_path)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": template}))
    return model


@pytest.mark.django_db
def test_a_chat_template_that_renders_is_registered(demo_model_dir: Path, tmp_path: Path) -> None:
    from registry.services import model_version_register

    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    model = _with_template(demo_model_dir, tmp_path, template)
    assert model_version_register(name="templated", version="v1", source_dir=model).version == "v1"


@pytest.mark.django_db
def test_a_chat_template_that_refuses_tools_is_registered_for_chats_without_them(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    from registry.services import model_version_register

    template = (
        "{% if tools %}{{ raise_exception('this model takes no tools') }}{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    )
    model = _with_template(demo_model_dir, tmp_path, template)
    assert model_version_register(name="toolless", version="v1", source_dir=model).version == "v1"


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("template", "why"),
    [
        ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "within"),
        # ~1.5 MB, far past the limit, and quick to write: under load a longer flood met the time
        # limit first (a refusal all the same, but not the one this case is about).
        ("{% for i in range(30000) %}{{ messages }}{% endfor %}", "writes"),
        ("{{ raise_exception('no') }}", "does not render"),
        # Only with tools: a chat with tools would hold a replica's thread as long, or write as much.
        (
            "{% if tools %}{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
            "{% endif %}<user>{{ messages[0].content }}",
            "with and without tools",
        ),
        ("{% if tools %}{% for i in range(30000) %}{{ tools }}{% endfor %}{% endif %}<user>", "writes"),
    ],
)
def test_a_chat_template_that_runs_long_writes_much_or_fails_is_refused(
    demo_model_dir: Path, tmp_path: Path, settings, template: str, why: str, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    from registry import chat_template
    from registry.services import model_version_register

    monkeypatch.setattr(chat_template, "CHAT_TEMPLATE_TIMEOUT_S", 8.0)  # the loading is ~2 s of it here
    settings.ARTIFACT_ROOT = tmp_path / "store"
    model = _with_template(demo_model_dir, tmp_path, template)
    with pytest.raises(ArtifactError, match=why):
        model_version_register(name="hostile", version="v1", source_dir=model)
    assert not any((tmp_path / "store").rglob("*.safetensors"))  # nothing of it stays in the store


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("source", "kind", "message"),
    [
        (
            "chat",
            "classifier",
            "a causal-lm model (LlamaForCausalLM), not a classifier model; register it with --kind causal-lm",
        ),
        ("chat", "embedding", "a causal-lm model (LlamaForCausalLM), not an embedding model"),
        ("classifier", "causal-lm", "not a causal-lm model; register it with --kind classifier"),
        ("embedding", "classifier", "no ...ForSequenceClassification head"),
        ("embedding", "causal-lm", "a base model without a language-model head"),
    ],
)
def test_a_checkpoint_of_another_kind_is_refused_naming_both_and_nothing_is_stored(
    demo_model_dir: Path,
    demo_embedding_model_dir: Path,
    demo_classifier_model_dir: Path,
    tmp_path: Path,
    settings,  # type: ignore[no-untyped-def]
    source: str,
    kind: str,
    message: str,
) -> None:
    from registry.models import Model
    from registry.services import model_version_register

    settings.ARTIFACT_ROOT = tmp_path / "store"
    source_dir = {"chat": demo_model_dir, "embedding": demo_embedding_model_dir}.get(
        source, demo_classifier_model_dir
    )
    with pytest.raises(ArtifactError, match=re.escape(message)):
        model_version_register(name="mistaken", version="v1", source_dir=source_dir, kind=kind)
    assert not Model.objects.filter(name="mistaken").exists()
    assert not any((tmp_path / "store").rglob("*.safetensors"))


@pytest.mark.django_db
def test_each_demo_checkpoint_registers_as_its_own_kind(
    demo_model_dir: Path, demo_embedding_model_dir: Path, demo_classifier_model_dir: Path, tmp_path, settings
) -> None:  # type: ignore[no-untyped-def]
    from registry.services import model_version_register

    settings.ARTIFACT_ROOT = tmp_path / "store"
    for name, source_dir, kind in [
        ("chat", demo_model_dir, "causal-lm"),
        ("embed", demo_embedding_model_dir, "embedding"),
        ("classify", demo_classifier_model_dir, "classifier"),
    ]:
        assert (
            model_version_register(name=name, version="v1", source_dir=source_dir, kind=kind).version == "v1"
        )
