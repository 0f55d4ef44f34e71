"""The README's adapter example without a fine-tune at hand: `create_demo_model DIR --adapter-of
MODEL_DIR` writes a random LoRA adapter, as PEFT saves one, that `register_model --adapter-of` accepts
and the engine serves, giving other greedy tokens than the base."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from registry.models import ModelVersion
from serving.engine.engine import Engine, EngineConfig
from serving.engine.lora import read_adapter
from serving.engine.sequence import SamplingParams


def _greedy(engine: Engine, adapter: Any = None) -> list[int]:
    request_id = "lora" if adapter is not None else "base"
    params = SamplingParams(max_tokens=12, temperature=0.0)
    engine.add_request(request_id, engine.encode("Once upon a time"), params, adapter=adapter)
    tokens: list[int] = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    return tokens


@pytest.mark.django_db
def test_the_readmes_demo_adapter_registers_and_changes_the_answer(
    registered_model: Any, demo_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "demo-lora"
    call_command("create_demo_model", str(out), adapter_of=str(demo_model_dir), rank=4)
    call_command("register_model", "demo-lora", "v1", source=str(out), adapter_of="demo-chat:v1")
    version = ModelVersion.objects.get(model__name="demo-lora", version="v1")
    assert version.adapter_of == registered_model

    engine = Engine(demo_model_dir, config=EngineConfig(kv_cache_bytes=8 << 20))
    adapter = read_adapter(out, "demo-lora:v1", json.loads((demo_model_dir / "config.json").read_text()))
    assert adapter.rank == 4
    assert _greedy(engine, adapter) != _greedy(engine)


def test_an_adapter_of_a_directory_without_a_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CommandError, match=r"no config\.json"):
        call_command("create_demo_model", str(tmp_path / "a"), adapter_of=str(tmp_path))
