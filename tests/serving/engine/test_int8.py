"""Quantized siblings in the engine: the int8 Linear layer, the sibling's directory, its load, its forward
(the generic path; the fused one refuses it), and the evaluation against the parent."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from serving.engine.fused_llama import FusedForwardUnsupported
from serving.engine.int8_linear import Int8Linear, dequantize, quantize_per_channel
from serving.engine.int8_loading import QUANTIZATION_KEY, num_int8_linears
from serving.engine.loading import ModelLoadError, load_causal_lm
from serving.engine.quality import DEFAULT_TEXT, compare, evaluate
from serving.engine.quantize import QuantizationError, write_int8_sibling
from serving.engine.runner import ModelRunner
from tests.serving.engine.greedy import BLOCK_SIZE, Request, mixed_requests, run_greedy


@pytest.fixture(scope="module")
def int8_tiny_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_int8_sibling(tiny_llama_dir, tmp_path_factory.mktemp("tiny-int8")).directory


def test_per_channel_quantization_is_symmetric_and_within_half_a_step() -> None:
    torch.manual_seed(0)
    weight = torch.randn(24, 40)
    weight[3] = 0  # a row of zeros
    q, scale = quantize_per_channel(weight)
    assert q.dtype == torch.int8 and q.shape == weight.shape and scale.shape == (24,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    error = (dequantize(q, scale) - weight).abs()
    assert bool((error <= scale[:, None] / 2 + 1e-7).all())
    assert bool((dequantize(q, scale)[3] == 0).all())


def test_int8_linear_matches_its_dequantized_weight() -> None:
    torch.manual_seed(1)
    linear = nn.Linear(40, 24, bias=True)
    layer = Int8Linear.from_linear(linear)
    x = torch.randn(2, 5, 40)
    expected = x @ dequantize(layer.weight, layer.weight_scale).T + linear.bias
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    assert layer.weight.dtype == torch.int8 and not list(layer.parameters())


def test_the_sibling_directory_has_int8_weights_scales_and_its_mark(
    tiny_llama_dir: Path, int8_tiny_dir: Path
) -> None:
    config = json.loads((int8_tiny_dir / "config.json").read_text())
    entry = config[QUANTIZATION_KEY]
    assert entry["method"] == "int8-weight" and entry["kept"] == ["lm_head"]
    assert len(entry["modules"]) == 2 * 7  # q k v o gate up down per layer
    with safe_open(str(int8_tiny_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.int8
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale").dtype == torch.float32
        assert f.get_tensor("lm_head.weight").dtype == torch.float32
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert {f"{m}.weight_scale" for m in entry["modules"]} <= names
    assert not list(int8_tiny_dir.glob("*.bin")) and not list(int8_tiny_dir.glob("*.py"))


def test_quantizing_a_quantized_directory_is_refused(int8_tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(QuantizationError, match="already quantized"):
        write_int8_sibling(int8_tiny_dir, tmp_path / "again")
    with pytest.raises(QuantizationError, match="unknown quantization method 'int4'"):
        write_int8_sibling(int8_tiny_dir, tmp_path / "again", method="int4")


def test_the_load_refuses_a_checkpoint_missing_a_tensor(int8_tiny_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for file in int8_tiny_dir.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing: model\.layers\.1\.mlp\.down_proj\.weight_scale"):
        load_causal_lm(broken, device="cpu", dtype=torch.float32)


def test_the_loaded_sibling_computes_with_the_dequantized_weights(
    tiny_llama_dir: Path, int8_tiny_dir: Path
) -> None:
    model = load_causal_lm(int8_tiny_dir, device="cpu", dtype=torch.float32)
    assert num_int8_linears(model) == 14
    reference = load_causal_lm(tiny_llama_dir, device="cpu", dtype=torch.float32)
    with torch.no_grad():  # the reference: the parent with each weight replaced by what its int8 stands for
        for name, module in model.named_modules():
            if isinstance(module, Int8Linear):
                reference.get_submodule(name).weight.copy_(dequantize(module.weight, module.weight_scale))
    ids = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("attention", ["native", "gather"])
def test_the_runner_serves_the_sibling_on_the_generic_path_as_generate_does(
    int8_tiny_dir: Path, attention: str
) -> None:
    runner = ModelRunner(
        int8_tiny_dir,
        block_size=BLOCK_SIZE,
        attention=attention,
        kv_cache_bytes=256 * 8192,
        max_num_seqs=16,
        max_num_batched_tokens=512,
    )
    assert runner.fused is None and "int8-weight" in (runner.forward_refusal or "")
    requests = mixed_requests(runner.vocab_size, seed=3)
    results = run_greedy(runner, requests, chunk_size=5, decodes_first=False)
    _check_against_generate(int8_tiny_dir, requests, {k: r.tokens for k, r in results.items()})


def test_the_fused_forward_refuses_the_sibling_by_name(int8_tiny_dir: Path) -> None:
    with pytest.raises(FusedForwardUnsupported, match="int8-weight quantized weights"):
        ModelRunner(
            int8_tiny_dir, forward="fused", kv_cache_bytes=1 << 20, max_num_seqs=4, max_num_batched_tokens=64
        )


def _check_against_generate(model_dir: Path, requests: list[Request], tokens: dict[str, list[int]]) -> None:
    """transformers' generate on the same int8 module (loaded as the engine loads it, with SDPA)."""
    reference = load_causal_lm(model_dir, device="cpu", dtype=torch.float32, attn_implementation="sdpa")
    with torch.inference_mode():
        for request in requests:
            prompt = torch.tensor([request.prompt])
            generated = reference.generate(prompt, max_new_tokens=request.max_new_tokens, do_sample=False)
            expected = generated[0, len(request.prompt) :].tolist()
            assert tokens[request.request_id] == expected, request.request_id


def test_compare_scores_a_model_against_itself_as_equal(tiny_llama_dir: Path) -> None:
    model = load_causal_lm(tiny_llama_dir, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    report = compare(model, model, ids, window=128, text_sha256="x")
    assert report.greedy_agreement == 1.0 and report.perplexity == report.parent_perplexity
    assert report.num_predictions == 300 - 3  # three windows, the first token of each unscored
    with torch.inference_mode():  # the perplexity by hand, over the first window
        logits = model(torch.tensor([ids[:128]])).logits[0, :-1]
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:128]), reduction="sum")
    one_window = compare(model, model, ids[:128], window=128, text_sha256="x")
    assert math.isclose(one_window.perplexity, math.exp(float(nll) / 127), rel_tol=1e-5)


def test_stories260k_int8_keeps_its_perplexity_and_its_greedy_tokens(
    stories_dir: Path, tmp_path: Path
) -> None:
    written = write_int8_sibling(stories_dir, tmp_path / "int8")
    report = evaluate(stories_dir, written.directory, text=DEFAULT_TEXT.read_text())
    assert report.num_tokens > 1000 and report.parent_perplexity < 10  # a real model, on its kind of text
    assert abs(report.perplexity_increase) < 0.02 and report.greedy_agreement > 0.95
