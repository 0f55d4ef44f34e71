"""Paged attention: one step's metadata, and `attend`, which every layer calls (the engine's own Llama
forward directly, any other transformers model through `transformers.AttentionInterface`).

The K/V cache of every layer is a pool of fixed-size blocks. Each step the model runs once over the
flattened batch `[1, T]`; `attend` writes the step's new keys/values into their slots, then attends
each sequence's queries over its own block table. Two ways, chosen by the runner:

- the native kernel (native_attention.py; fp32 on a CPU, where a C compiler is found): the write and
  the attention of every decode row and every prefill chunk over a cached prefix, in one call per
  layer, reading the pool in place (its key pool transposed per block: `key_pool_view`);
- gather + SDPA (gather_attention.py; any device, and the fallback), over pools laid out
  `[num_blocks, block_size, num_kv_heads, head_dim]`.

Either way a prompt with nothing cached runs one SDPA with `is_causal` over its own new keys: no pool
read is needed, and SDPA's blocked kernel is the fastest for a whole prompt. A prefill chunk over a
cached prefix needs a bottom-right causal mask (its queries sit at the end of the context); SDPA's
`is_causal` is top-left aligned and wrong there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from serving.engine.gather_attention import (
    AttentionScratch,
    DecodeKernel,
    GatherDecode,
    additive_mask,
    attend_decode,
    plan_gather_decode,
)
from serving.engine.native_attention import KernelStep, NativeAttention, plan_items

PAGED_ATTENTION_NAME = "switchyard_paged"


@dataclass(slots=True)
class PrefillSpan:
    """One sequence with more than one new token this step."""

    token_start: int  # first of its new tokens in the flattened batch
    num_query_tokens: int
    context_len: int  # cached + new
    block_ids: torch.Tensor | None  # [ceil(context_len / block_size)]; None when nothing was cached
    mask: torch.Tensor | None  # [num_query_tokens, context_len] additive bottom-right causal; None: causal


@dataclass(slots=True)
class AttentionClock:
    """Seconds spent in `attend` (writing K/V and attending), summed over layers and steps: what a step
    profile reports as the attention's share (two clock reads per layer, so always on)."""

    seconds: float = 0.0


@dataclass(slots=True)
class PagedAttentionMetadata:
    """What the attention function needs for one step; built once per step, read by every layer."""

    # per layer (k_pool, v_pool); with the native kernel, k_pool in its layout (key_pool_view)
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    slot_mapping: torch.Tensor  # [T] long: pool slot of each new token
    num_tokens: int
    prefills: list[PrefillSpan]  # native kernel: only the spans with nothing cached
    scratch: AttentionScratch
    decode: GatherDecode | None = None  # gather path: the step's decode rows, if any
    kernel: NativeAttention | None = None
    kernel_step: KernelStep | None = None
    clock: AttentionClock = field(default_factory=AttentionClock)


def build_attention_metadata(
    *,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    scratch: AttentionScratch,
    block_size: int,
    query_lens: np.ndarray,
    context_lens: np.ndarray,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    decode_kernel: DecodeKernel | None = None,
    kernel: NativeAttention | None = None,
    num_heads: int | None = None,
    clock: AttentionClock | None = None,
) -> PagedAttentionMetadata:
    """`query_lens`/`context_lens` are host arrays [B]; `block_tables` [B, W] and `slot_mapping` [T]
    live on the model's device. With a native `kernel` (and then `num_heads`), its metadata; otherwise
    the gather path's, with `decode_kernel` the compiled decode attention if any. `clock` adds up the
    time the step spends attending."""
    clock = clock or AttentionClock()
    num_tokens = int(slot_mapping.shape[0])
    token_starts = np.cumsum(query_lens) - query_lens
    if kernel is not None:
        if num_heads is None:
            raise ValueError("the native kernel's metadata needs num_heads")
        _, _, num_kv_heads, head_dim = kv_caches[0][1].shape  # the value pool keeps the plain layout
        is_fresh = (query_lens > 1) & (context_lens == query_lens)
        items = plan_items(query_lens, context_lens, np.flatnonzero(~is_fresh), num_heads)
        return PagedAttentionMetadata(
            kv_caches=kv_caches,
            slot_mapping=slot_mapping,
            num_tokens=num_tokens,
            prefills=[
                PrefillSpan(int(token_starts[row]), int(query_lens[row]), int(context_lens[row]), None, None)
                for row in np.flatnonzero(is_fresh).tolist()
            ],
            scratch=scratch,
            clock=clock,
            kernel=kernel,
            kernel_step=kernel.step(
                slot_mapping=slot_mapping,
                block_tables=block_tables,
                items=items,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                block_size=block_size,
            ),
        )
    device = block_tables.device
    dtype = kv_caches[0][0].dtype
    prefills = []
    for row in np.flatnonzero(query_lens > 1).tolist():
        token_start, q_len, ctx_len = int(token_starts[row]), int(query_lens[row]), int(context_lens[row])
        if ctx_len == q_len:
            prefills.append(PrefillSpan(token_start, q_len, ctx_len, None, None))
            continue
        num_blocks = (ctx_len + block_size - 1) // block_size
        # Query i sits at context position ctx_len - q_len + i and sees everything up to it.
        is_future = torch.ones(q_len, ctx_len, dtype=torch.bool, device=device).triu(ctx_len - q_len + 1)
        mask = additive_mask(is_future, dtype)
        prefills.append(PrefillSpan(token_start, q_len, ctx_len, block_tables[row, :num_blocks], mask))
    decode = plan_gather_decode(
        scratch=scratch,
        block_size=block_size,
        query_lens=query_lens,
        context_lens=context_lens,
        block_tables=block_tables,
        dtype=dtype,
        kernel=decode_kernel,
    )
    return PagedAttentionMetadata(
        kv_caches=kv_caches,
        slot_mapping=slot_mapping,
        num_tokens=num_tokens,
        prefills=prefills,
        scratch=scratch,
        decode=decode,
        clock=clock,
    )


def _unsupported(kwargs: dict[str, Any]) -> str | None:
    # Features our kernel does not implement: refusing beats silently wrong output.
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            return name
    return None


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_metadata: PagedAttentionMetadata | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' side: query [1, H, T, D], key/value [1, KVH, T, D] (after RoPE) -> ([1, T, H, D],
    None)."""
    md = paged_metadata
    if md is None:
        raise ValueError(
            f"attention '{PAGED_ATTENTION_NAME}' needs paged_metadata; run the model through ModelRunner"
        )
    if (feature := _unsupported(kwargs)) is not None:
        raise ValueError(
            f"paged attention does not support {feature!r} (layer {getattr(module, 'layer_idx', None)})"
        )
    if query.shape[0] != 1:
        raise ValueError(f"paged attention expects one flattened batch [1, T, ...], got {tuple(query.shape)}")
    layer_idx: int = module.layer_idx  # type: ignore[assignment]  # set by transformers on attention modules
    out = attend(
        md,
        layer_idx,
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        scaling if scaling is not None else query.shape[-1] ** -0.5,
    )
    return out.unsqueeze(0), None


def attend(
    md: PagedAttentionMetadata,
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One layer's attention for the step: query [T, H, D], key/value [T, KVH, D] (views of any strides
    with a contiguous last dim; after RoPE) -> [T, H, D]. Writes the new keys/values into the pool."""
    started = time.perf_counter()
    out = _attend(md, layer_idx, query, key, value, scale)
    md.clock.seconds += time.perf_counter() - started
    return out


def _attend(
    md: PagedAttentionMetadata,
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    assert num_tokens == md.num_tokens, "metadata built for another batch"
    k_pool, v_pool = md.kv_caches[layer_idx]
    if md.kernel is not None:
        assert md.kernel_step is not None
        out = query.new_empty(num_tokens, num_heads, head_dim)
        md.kernel(
            md.kernel_step,
            q=query,
            k_new=key,
            v_new=value,
            k_pool=k_pool,
            v_pool=v_pool,
            out=out,
            scale=scale,
        )
        for span in md.prefills:
            _attend_fresh_prefill(span, query, key, value, scale, out)
        return out

    k_pool.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, key)
    v_pool.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, value)
    decode = md.decode
    if decode is not None and decode.num_rows == num_tokens:
        return attend_decode(decode, query, k_pool, v_pool, scale)
    out = query.new_empty(num_tokens, num_heads, head_dim)
    if decode is not None:
        if decode.token_indices is None:
            out[: decode.num_rows] = attend_decode(decode, query[: decode.num_rows], k_pool, v_pool, scale)
        else:
            q_dec = query.index_select(0, decode.token_indices)
            out.index_copy_(0, decode.token_indices, attend_decode(decode, q_dec, k_pool, v_pool, scale))
    for span in md.prefills:
        if span.block_ids is None:
            _attend_fresh_prefill(span, query, key, value, scale, out)
            continue
        end = span.token_start + span.num_query_tokens
        k_blocks, v_blocks = md.scratch.gather(k_pool, v_pool, span.block_ids)
        k_ctx = k_blocks.view(-1, num_kv_heads, head_dim)[: span.context_len].transpose(0, 1)
        v_ctx = v_blocks.view(-1, num_kv_heads, head_dim)[: span.context_len].transpose(0, 1)
        o = F.scaled_dot_product_attention(
            query[span.token_start : end].transpose(0, 1).unsqueeze(0),
            k_ctx.unsqueeze(0),
            v_ctx.unsqueeze(0),
            attn_mask=span.mask,
            scale=scale,
            enable_gqa=True,
        )
        out[span.token_start : end] = o[0].transpose(0, 1)
    return out


def _attend_fresh_prefill(
    span: PrefillSpan,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """A prompt with nothing cached: its new keys are its whole context and top-left causal is right."""
    start, end = span.token_start, span.token_start + span.num_query_tokens
    o = F.scaled_dot_product_attention(
        query[start:end].transpose(0, 1).unsqueeze(0),
        key[start:end].transpose(0, 1).unsqueeze(0),
        value[start:end].transpose(0, 1).unsqueeze(0),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    out[start:end] = o[0].transpose(0, 1)


def register_paged_attention() -> str:
    """Register the function under PAGED_ATTENTION_NAME (idempotent); returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(PAGED_ATTENTION_NAME, paged_attention_forward)
    return PAGED_ATTENTION_NAME
