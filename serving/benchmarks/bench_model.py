"""The benchmark's model: a seeded random Llama of ~24M parameters, built locally, and the facts about a
model directory the benchmark needs (sizes, KV bytes per token, special ids) read without loading it."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from serving.engine.demo_model import DemoModelSpec

# hidden 512, 8 layers, 8 heads (head_dim 64), 4 KV heads, MLP 1376: 23.96M parameters with the demo
# tokenizer, whose tiny training text caps the vocabulary at ~735 tokens whatever vocab_size asks for.
BENCH_MODEL_SPEC = DemoModelSpec(
    hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1376, seed=0
)


def ensure_bench_model(model_dir: Path, *, log: Callable[[str], None] = lambda _: None) -> Path:
    if (model_dir / "config.json").exists() and any(model_dir.glob("*.safetensors")):
        return model_dir
    from serving.engine.demo_model import build_demo_model

    log(f"building the bench model in {model_dir}")
    return build_demo_model(model_dir, BENCH_MODEL_SPEC)


@dataclass(slots=True, frozen=True)
class ModelInfo:
    num_params: int
    num_matmul_params: int  # every weight a token's forward pass multiplies by: all but the input embedding
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    special_ids: tuple[int, ...]
    dtype_bytes: int = 4  # fp32 on CPU (serving.engine.loading)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def describe(self) -> str:
        shape = (
            f"hidden {self.hidden_size}, {self.num_layers} layers, {self.num_heads} heads, "
            f"{self.num_kv_heads} KV heads, vocab {self.vocab_size}"
        )
        kv_kib = self.kv_bytes_per_token / 1024
        return f"{self.num_params / 1e6:.2f}M params (Llama: {shape}), KV {kv_kib:g} KiB/token fp32"


def read_model_info(model_dir: Path) -> ModelInfo:
    from safetensors import safe_open

    from serving.engine.loading import load_tokenizer

    config = json.loads((model_dir / "config.json").read_text())
    num_params = 0
    num_embedding_params = 0
    has_lm_head = False
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            for name in weights.keys():  # noqa: SIM118 (safe_open is not a mapping)
                numel = 1
                for dim in weights.get_slice(name).get_shape():
                    numel *= dim
                num_params += numel
                if name.endswith("embed_tokens.weight"):
                    num_embedding_params += numel
                has_lm_head = has_lm_head or name.endswith("lm_head.weight")
    num_heads = int(config["num_attention_heads"])
    hidden_size = int(config["hidden_size"])
    tokenizer = load_tokenizer(model_dir)
    return ModelInfo(
        num_params=num_params,
        # Tied embeddings: the one table is also the LM head, which is a matmul.
        num_matmul_params=num_params - num_embedding_params if has_lm_head else num_params,
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden_size // num_heads),
        vocab_size=int(config["vocab_size"]),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        special_ids=tuple(sorted(tokenizer.all_special_ids)),
    )
