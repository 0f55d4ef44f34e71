"""An adapter in the fused Llama forward's layout (fused_llama.py), made when a replica installs it.

Per layer, four sites, one per fused product (QKV, O, gate/up, down). A site's A holds the A of each of
its targets the adapter has, side by side ([in, n x rank], transposed for the product: one product for
all of them), and each target's B, scaled and transposed, goes to that target's columns of the fused
output (Q's and K's rows permuted as fused_llama.py permutes W_q and W_k for its rotary); lora_batch.py
applies them. A site none of whose targets the adapter has is None and costs nothing."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from serving.engine.fused_llama import FusedLlama, _rotary_pairs_adjacent
from serving.engine.lora import LoraAdapter, LoraPair
from serving.engine.lora_batch import FusedLoraWeights, SiteWeights

SITE_TARGETS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


def _out_slices(fused: FusedLlama, site: int) -> tuple[tuple[int, int], ...]:
    """Where each of the site's targets lies in its fused product's output."""
    q, kv, inter, hidden = fused.q_size, fused.kv_size, fused.intermediate_size, fused.hidden_size
    return (
        ((0, q), (q, q + kv), (q + kv, q + 2 * kv)),
        ((0, hidden),),
        ((0, inter), (inter, 2 * inter)),
        ((0, hidden),),
    )[site]


def _site_weights(
    layer: Mapping[str, LoraPair], site: int, adapter: LoraAdapter, fused: FusedLlama
) -> SiteWeights | None:
    slices = _out_slices(fused, site)
    present = [(t, s) for t, s in zip(SITE_TARGETS[site], slices, strict=True) if t in layer]
    if not present:
        return None
    device, dtype = fused.embed.device, fused.embed.dtype
    a = torch.cat([layer[target].a.t() for target, _ in present], dim=1)
    b = []
    for target, (start, end) in present:
        update = layer[target].b * adapter.scaling
        if target in ("q_proj", "k_proj"):
            num_heads = fused.num_heads if target == "q_proj" else fused.num_kv_heads
            update = _rotary_pairs_adjacent(update, num_heads, fused.head_dim)
        b.append((start, end, update.t().contiguous().to(device=device, dtype=dtype)))
    uncovered = tuple(s for t, s in zip(SITE_TARGETS[site], slices, strict=True) if t not in layer)
    a = a.contiguous().to(device=device, dtype=dtype)
    return SiteWeights(a, adapter.rank, tuple(b), uncovered)


def fused_lora_weights(adapter: LoraAdapter, fused: FusedLlama) -> FusedLoraWeights:
    """The adapter in `fused`'s layout, on its device and in its dtype."""
    if len(adapter.layers) != len(fused.layers):
        raise ValueError(f"the adapter has {len(adapter.layers)} layers, the model {len(fused.layers)}")
    with torch.no_grad():
        return tuple(
            tuple(_site_weights(layer, site, adapter, fused) for site in range(4)) for layer in adapter.layers
        )
