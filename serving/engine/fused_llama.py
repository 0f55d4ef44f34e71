"""The engine's own forward pass for the Llama family (Llama, Mistral, Qwen2), as nano-vllm writes one:
the same arithmetic as transformers' modules in far fewer host operations per layer.

transformers' Llama layer issues ~37 operations per decode step on a CPU (three projections for Q, K
and V, RMSNorm as six, rotary as fourteen, two residual adds, SiLU and the gate product), each paying
Python and dispatch overhead in every layer of every step (docs/benchmarks.md, "Engine step cost").
Here a layer is:

    x = rms_norm(h)                   one op (one pass in C: native_ops.py)
    qkv = x @ W_qkv                   one product: Q, K and V weights concatenated at load
    rotary on Q and K, in place       one complex multiply (see below)
    attention                         one call: writes K/V into the pool and attends (attention.py)
    h = h + attn @ W_o                one product, the residual added as its post-op
    x = rms_norm(h)                   one op
    gu = x @ W_gate_up                one product: gate and up weights concatenated
    a = silu(gate) * up               one op in C (two of torch's without it)
    h = h + a @ W_down                one product with the residual

Rotary as one complex multiply: transformers rotates pairs (i, i + D/2) of each head ("rotate_half").
The rows of W_q and W_k (and their biases) are permuted at load so that those pairs sit side by side,
(2i, 2i + 1); viewed as complex numbers, rotation by angle t is a multiply by cos t + i sin t, which
computes x1 cos - x2 sin and x1 sin + x2 cos as transformers does. Attention only takes dot products
of Q with K, which the same permutation of both leaves unchanged; V is not permuted. The permuted keys
live in this engine's own pool, which nothing else reads.

A model this file cannot serve exactly is refused at load (`refusal`), never run wrong: the runner then
uses transformers' own modules over the same paged attention, or, when the fused path was required,
raises."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from serving.engine.attention import PagedAttentionMetadata, attend
from serving.engine.lora_batch import DOWN, GATE_UP, OUT, QKV, LoraStep
from serving.engine.native_ops import NativeOps
from serving.engine.packing import LinearWeight

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# Rotary kinds whose angles depend on the position alone, so one table of them serves every step.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class FusedForwardUnsupported(ValueError):
    """A model the fused forward cannot serve exactly; `reason` says why."""

    def __init__(self, reason: str, subject: str = "this model") -> None:
        super().__init__(f"the fused Llama forward cannot serve {subject}: {reason}")
        self.reason = reason


def refusal(model: Any) -> str | None:
    """Why `model` (a loaded transformers causal LM) cannot take the fused forward, or None if it can."""
    config = model.config
    quantization = getattr(config, "switchyard_quantization", None)  # int8_loading.QUANTIZATION_KEY
    if quantization:
        method = quantization.get("method") if isinstance(quantization, dict) else quantization
        return f"{method} quantized weights (the fused forward takes float weights; the generic one int8)"
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (the fused MLP computes SiLU)"
    if getattr(config, "mlp_bias", False):
        return "mlp_bias"
    if (getattr(config, "pretraining_tp", 1) or 1) != 1:
        return "pretraining_tp > 1"
    sliding = getattr(config, "sliding_window", None)
    uses_sliding = sliding is not None and getattr(config, "use_sliding_window", True)
    if uses_sliding and sliding < config.max_position_embeddings:
        return f"sliding_window {sliding}"
    layer_types = getattr(config, "layer_types", None) or ()
    if any(kind != "full_attention" for kind in layer_types):
        return "layers other than full attention"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope_type {rope_type!r} (its angles change with the sequence's length)"
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        return "partial rotary embeddings"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or not hasattr(inner, "rotary_emb"):
        return "not laid out as transformers' Llama (model.model.layers, model.model.rotary_emb)"
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        modules: list[Any] = [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj]
        modules += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if any(type(module) is not nn.Linear for module in modules):
            return "projections other than plain nn.Linear (quantized or adapted weights?)"
    if model.dtype != torch.float32:
        # Rotary as a complex multiply needs fp32 pairs: torch has no bf16 complex type.
        return f"dtype {model.dtype} (the fused forward runs fp32)"
    head_dim = _head_dim(config)
    if head_dim % 2:
        return f"odd head_dim {head_dim}"
    return None


def _head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _rotary_pairs_adjacent(weight: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Rows (or bias entries) of each head reordered from (x_0..x_{D/2-1}, y_0..) to (x_0, y_0, x_1, …)."""
    half = head_dim // 2
    order = torch.arange(head_dim).view(2, half).t().reshape(-1)  # 0, D/2, 1, D/2 + 1, …
    shaped = weight.reshape(num_heads, head_dim, *weight.shape[1:])
    return shaped[:, order].reshape(weight.shape)


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: LinearWeight
    o: LinearWeight
    post_norm: torch.Tensor
    gate_up: LinearWeight
    down: LinearWeight


def fused_linear_shapes(model: Any) -> list[tuple[int, int, bool]] | None:
    """The (in, out, bias) of every product the fused forward would run on `model` (QKV and gate/up
    concatenated), one entry a product, or None when it would refuse the model: what timing packed
    against plain Linear layers must time (packing.py), not the unfused layers the model holds."""
    if refusal(model) is not None:
        return None
    shapes = []
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        q, k, v, o = attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj
        has_qkv_bias = any(proj.bias is not None for proj in (q, k, v))
        shapes.append((q.in_features, q.out_features + k.out_features + v.out_features, has_qkv_bias))
        shapes.append((o.in_features, o.out_features, o.bias is not None))
        gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        shapes.append((gate.in_features, gate.out_features + up.out_features, False))
        shapes.append((down.in_features, down.out_features, down.bias is not None))
    head = model.lm_head
    shapes.append((head.in_features, head.out_features, head.bias is not None))
    return shapes


class FusedLlama:
    """The forward pass over the weights of a loaded transformers model (which it takes over: the
    model's decoder layers are emptied, so the weights are held once)."""

    def __init__(self, model: Any, *, packed: bool, ops: NativeOps | None = None) -> None:
        """`ops`: the C row operators (on a CPU in fp32 where the library builds); None: torch's."""
        reason = refusal(model)
        if reason is not None:
            raise FusedForwardUnsupported(reason)
        config = model.config
        inner = model.model
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = _head_dim(config)
        self.hidden_size: int = config.hidden_size
        self.eps: float = config.rms_norm_eps
        self.scale = self.head_dim**-0.5  # transformers' Llama attention scaling
        self.ops = ops
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        self.intermediate_size: int = config.intermediate_size
        with torch.no_grad():
            self.layers = [self._fuse_layer(layer, packed=packed) for layer in inner.layers]
            self.embed: torch.Tensor = inner.embed_tokens.weight.detach()
            self.norm: torch.Tensor = inner.norm.weight.detach()
            self.lm_head = LinearWeight(model.lm_head.weight, model.lm_head.bias, packed=packed)
            self.rotary = self._rotary_table(inner.rotary_emb, config.max_position_embeddings)
        self.num_packed_linears = 4 * len(self.layers) + 1 if packed else 0
        inner.layers = nn.ModuleList()  # the weights now live in self.layers

    def _fuse_layer(self, layer: Any, *, packed: bool) -> _Layer:
        attention, mlp = layer.self_attn, layer.mlp
        q, k, v = attention.q_proj, attention.k_proj, attention.v_proj

        def rotary_rows(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
            return _rotary_pairs_adjacent(tensor, num_heads, self.head_dim)

        qkv_weight = torch.cat(
            [rotary_rows(q.weight, self.num_heads), rotary_rows(k.weight, self.num_kv_heads), v.weight]
        )
        biases = (q.bias, k.bias, v.bias)
        qkv_bias = None
        if any(b is not None for b in biases):
            sizes = (q.out_features, k.out_features, v.out_features)
            filled = [
                b if b is not None else qkv_weight.new_zeros(n) for b, n in zip(biases, sizes, strict=True)
            ]
            qkv_bias = torch.cat(
                [rotary_rows(filled[0], self.num_heads), rotary_rows(filled[1], self.num_kv_heads), filled[2]]
            )
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        o, down = attention.o_proj, mlp.down_proj
        return _Layer(
            input_norm=layer.input_layernorm.weight.detach(),
            qkv=LinearWeight(qkv_weight, qkv_bias, packed=packed),
            o=LinearWeight(o.weight, o.bias, packed=packed),
            post_norm=layer.post_attention_layernorm.weight.detach(),
            gate_up=LinearWeight(gate_up, None, packed=packed),
            down=LinearWeight(down.weight, down.bias, packed=packed),
        )

    def _rotary_table(self, rotary_emb: nn.Module, max_positions: int) -> torch.Tensor:
        """[max_positions, D/2] complex: cos t + i sin t for each position and pair, as transformers'
        rotary module computes them (its scaling, for llama3 or yarn, included)."""
        positions = torch.arange(max_positions, device=self.embed.device)[None]
        probe = torch.zeros(1, dtype=self.embed.dtype, device=self.embed.device)
        cos, sin = rotary_emb(probe, positions)  # [1, P, D], each half repeated
        half = self.head_dim // 2
        if cos.shape[-1] != self.head_dim:
            raise FusedForwardUnsupported(f"rotary dim {cos.shape[-1]} != head_dim {self.head_dim}")
        return torch.complex(cos[0, :, :half].float(), sin[0, :, :half].float())

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        sample_indices: torch.Tensor,
        metadata: PagedAttentionMetadata,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> logits [S, vocab] of the rows `sample_indices` [S]. `lora`: the
        step's adapter rows (lora_batch.py), whose updates are added to each fused product's output."""
        num_tokens = input_ids.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_size, kv_size, inter = self.q_size, self.kv_size, self.intermediate_size
        norm = self._rms_norm
        rotation = self.rotary.index_select(0, positions).unsqueeze(1)  # [T, 1, D/2], shared by every layer
        hidden = F.embedding(input_ids, self.embed)
        for index, layer in enumerate(self.layers):
            x = norm(hidden, layer.input_norm)
            qkv = layer.qkv(x)
            if lora is not None:
                lora.add(qkv, x, index, QKV)
            rotated = qkv[:, : q_size + kv_size].view(num_tokens, heads + kv_heads, head_dim // 2, 2)
            torch.view_as_complex(rotated).mul_(rotation)
            attn = attend(
                metadata,
                index,
                qkv[:, :q_size].view(num_tokens, heads, head_dim),
                qkv[:, q_size : q_size + kv_size].view(num_tokens, kv_heads, head_dim),
                qkv[:, q_size + kv_size :].view(num_tokens, kv_heads, head_dim),
                self.scale,
            )
            attn_rows = attn.view(num_tokens, q_size)
            hidden = layer.o.add_to(attn_rows, hidden)
            if lora is not None:
                lora.add(hidden, attn_rows, index, OUT)
            x = norm(hidden, layer.post_norm)
            gate_up = layer.gate_up(x)
            if lora is not None:
                lora.add(gate_up, x, index, GATE_UP)
            if self.ops is not None:
                activated = self.ops.silu_and_mul(gate_up)
            else:
                activated = F.silu(gate_up[:, :inter], inplace=True).mul_(gate_up[:, inter:])
            hidden = layer.down.add_to(activated, hidden)
            if lora is not None:
                lora.add(hidden, activated, index, DOWN)
        return self.lm_head(norm(hidden.index_select(0, sample_indices), self.norm))

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.rms_norm(x, weight, self.eps)
        return F.rms_norm(x, (self.hidden_size,), weight, self.eps)
