"""The engine's own Llama-family forward (serving/engine/fused_llama.py): greedy output equal to
transformers' `generate` on the architectures it takes (Llama with scaled rotary, Qwen2 with Q/K/V
biases), every other architecture (GPT-2 here) served by transformers' modules over the same paged
attention, and a model it cannot serve exactly refused at load, never run wrong."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from serving.engine import runner as runner_module
from serving.engine.fused_llama import FusedForwardUnsupported, fused_linear_shapes, refusal
from serving.engine.runner import ModelRunner
from tests.serving.engine.greedy import BLOCK_SIZE, check_against_reference, mixed_requests, run_greedy


def _save(model: Any, tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)  # safetensors
    return path


@pytest.fixture(scope="module")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2: biases on Q, K and V (none on the output projection), GQA 6/2, tied embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=256,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.3,  # logits far from ties: argmax compares the arithmetic, not rounding
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # random, not zero, biases, so that their permutation with the rows is tested
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.bias.normal_(0, 0.5)
    return _save(model, tmp_path_factory, "tiny_qwen2")


@pytest.fixture(scope="module")
def tiny_llama3_rope_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama with Llama 3's rotary scaling: the angles come from transformers' own rotary module."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        initializer_range=0.3,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(2)
    return _save(LlamaForCausalLM(config).eval(), tmp_path_factory, "tiny_llama3_rope")


@pytest.fixture(scope="module")
def tiny_gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=256,
        n_positions=256,
        n_embd=64,
        n_layer=2,
        n_head=4,
        initializer_range=0.3,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(3)
    return _save(GPT2LMHeadModel(config).eval(), tmp_path_factory, "tiny_gpt2")


def _runner(
    model_dir: Path, *, forward: str, attention: str = "native", native_ops: bool = True
) -> ModelRunner:
    return ModelRunner(
        model_dir,
        kv_cache_bytes=256 * 16384,
        block_size=BLOCK_SIZE,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        forward=forward,
        attention=attention,
        native_ops=native_ops,
    )


def _greedy_equals_generate(runner: ModelRunner, model_dir: Path) -> None:
    for chunk_size in (1, 7, 512):
        requests = mixed_requests(runner.vocab_size, seed=chunk_size)
        results = run_greedy(runner, requests, chunk_size=chunk_size, decodes_first=chunk_size != 7)
        check_against_reference(model_dir, requests, results)


@pytest.mark.parametrize(
    ("attention", "native_ops"), [("native", True), ("gather", False)], ids=["c-kernels", "torch-ops"]
)
def test_qwen2_takes_the_fused_forward_and_equals_generate(
    tiny_qwen2_dir: Path, attention: str, native_ops: bool
) -> None:
    runner = _runner(tiny_qwen2_dir, forward="fused", attention=attention, native_ops=native_ops)
    assert runner.fused is not None and runner.fused.layers[0].qkv.bias is not None
    assert (runner.fused.ops is not None) is native_ops
    _greedy_equals_generate(runner, tiny_qwen2_dir)


def test_scaled_rotary_takes_the_fused_forward_and_equals_generate(tiny_llama3_rope_dir: Path) -> None:
    runner = _runner(tiny_llama3_rope_dir, forward="fused")
    _greedy_equals_generate(runner, tiny_llama3_rope_dir)


@pytest.mark.parametrize("attention", ["native", "gather"])
def test_gpt2_keeps_transformers_modules_and_equals_generate(tiny_gpt2_dir: Path, attention: str) -> None:
    runner = _runner(tiny_gpt2_dir, forward="auto", attention=attention)
    assert runner.fused is None
    assert "model_type 'gpt2'" in runner.describe()
    _greedy_equals_generate(runner, tiny_gpt2_dir)


def test_the_fused_forward_asked_for_on_another_architecture_is_refused_at_load(tiny_gpt2_dir: Path) -> None:
    with pytest.raises(FusedForwardUnsupported, match="model_type 'gpt2'"):
        _runner(tiny_gpt2_dir, forward="fused")


def test_the_fused_forward_holds_the_weights_once(tiny_llama_dir: Path) -> None:
    runner = _runner(tiny_llama_dir, forward="fused")
    assert len(runner.model.model.layers) == 0  # transformers' layers emptied: the weights live once


def _llama(**overrides: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    options = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    } | overrides
    return LlamaForCausalLM(LlamaConfig(**options)).eval()


def _gelu(model: Any) -> None:
    model.config.hidden_act = "gelu"


def _bf16(model: Any) -> None:
    model.to(torch.bfloat16)


def _dynamic_rope(model: Any) -> None:
    model.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}


def _sliding(model: Any) -> None:
    model.config.sliding_window = 16


def _adapted(model: Any) -> None:
    class Adapted(torch.nn.Linear):
        pass

    projection = model.model.layers[0].self_attn.q_proj
    model.model.layers[0].self_attn.q_proj = Adapted(projection.in_features, projection.out_features)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (_gelu, "hidden_act 'gelu'"),
        (_bf16, "dtype torch.bfloat16"),
        (_dynamic_rope, "rope_type 'dynamic'"),
        (_sliding, "sliding_window 16"),
        (_adapted, "plain nn.Linear"),
    ],
    ids=["activation", "bf16", "dynamic-rope", "sliding-window", "subclassed-linear"],
)
def test_what_the_fused_forward_cannot_serve_exactly_is_named(
    change: Callable[[Any], None], reason: str
) -> None:
    model = _llama()
    assert refusal(model) is None
    change(model)
    assert reason in (refusal(model) or "")


def test_packing_is_timed_on_the_products_the_fused_forward_runs() -> None:
    """QKV and gate/up concatenated, as the fused forward multiplies them (packing.py times these: the
    wider products gain more from packing than the model's own layers suggest)."""
    model = _llama(num_hidden_layers=2)
    head_dim = 32 // 4
    per_layer = [(32, (4 + 2 + 2) * head_dim, False), (32, 32, False), (32, 2 * 64, False), (64, 32, False)]
    assert fused_linear_shapes(model) == per_layer * 2 + [(32, 64, False)]
    _gelu(model)
    assert fused_linear_shapes(model) is None, "a model it refuses keeps its own layers' timing"


@pytest.mark.parametrize("forward", ["auto", "generic"])
def test_the_runner_times_packing_on_the_forward_it_takes(
    tiny_llama_dir: Path, forward: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    timed: list[object] = []
    original = runner_module.packing_pays

    def recording(model: Any, *, shapes: Any = None) -> Any:
        timed.append(shapes)
        return original(model, shapes=shapes, rows=(1,), rounds=1)

    monkeypatch.setattr(runner_module, "packing_pays", recording)
    runner = _runner(tiny_llama_dir, forward=forward)
    if forward == "auto":
        assert runner.fused is not None
        assert timed and timed[0] is not None and len(timed[0]) == 4 * runner.num_layers + 1  # type: ignore[arg-type]
    else:
        assert timed == [None], "transformers' modules: the model's own layers"
