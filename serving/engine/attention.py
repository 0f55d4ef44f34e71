"""Paged attention for transformers models, plugged in through `transformers.AttentionInterface`.

The K/V cache of every layer is a pool of fixed-size blocks laid out `[num_blocks, block_size,
num_kv_heads, head_dim]` (the layout paged GPU kernels expect, so a CUDA kernel can replace the gather
later without moving data). Each step the model runs once over the flattened batch `[1, T]`; the
registered function writes the step's new keys/values into their slots, then attends each sequence's
queries over its own block table:

- decode rows (one new token) are batched: their blocks are gathered into a persistent scratch buffer
  and one SDPA call runs with a per-row length mask, query heads packed per KV head so K/V are never
  repeated for GQA. Rows are padded to the longest context in their batch, so when lengths spread
  widely the rows are sorted by length and cut into a few buckets, one gather + SDPA each
  (plan_decode_buckets);
- prefill chunks run one SDPA each with a bottom-right causal mask, since new tokens attend to the
  cached context plus the earlier new tokens. SDPA's `is_causal` is top-left aligned and wrong there.

One SDPA over a block-diagonal mask of the whole batch would cost O(B^2); we never build one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

PAGED_ATTENTION_NAME = "switchyard_paged"

# (q [B, H, D], k_pool, v_pool, block_tables [B, nb], context_lens [B], scale) -> [B, H, D]
DecodeKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]


class AttentionScratch:
    """Gather buffers reused by every layer and step. A fresh multi-MB buffer per call page-faults on
    each step (measured 5x slower); these grow by doubling and are then reused."""

    def __init__(
        self, *, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self._shape = (block_size, num_kv_heads, head_dim)
        self._dtype = dtype
        self._device = device
        self._k = torch.empty((0, *self._shape), dtype=dtype, device=device)
        self._v = torch.empty_like(self._k)

    @property
    def capacity_blocks(self) -> int:
        return self._k.shape[0]

    def reserve(self, num_blocks: int) -> None:
        if num_blocks <= self.capacity_blocks:
            return
        new_capacity = max(num_blocks, 2 * self.capacity_blocks)
        self._k = torch.empty((new_capacity, *self._shape), dtype=self._dtype, device=self._device)
        self._v = torch.empty_like(self._k)

    def gather(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, block_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the listed blocks of one layer's pool into the buffers: `[len(block_ids), block_size,
        num_kv_heads, head_dim]` views, valid until the next gather."""
        num_blocks = block_ids.shape[0]
        self.reserve(num_blocks)
        k = torch.index_select(k_pool, 0, block_ids, out=self._k[:num_blocks])
        v = torch.index_select(v_pool, 0, block_ids, out=self._v[:num_blocks])
        return k, v


@dataclass(slots=True)
class PrefillSpan:
    """One sequence with more than one new token this step."""

    token_start: int  # first of its new tokens in the flattened batch
    num_query_tokens: int
    context_len: int  # cached + new
    block_ids: torch.Tensor | None  # [ceil(context_len / block_size)]; None when nothing was cached
    mask: torch.Tensor | None  # [num_query_tokens, context_len] additive bottom-right causal; None: causal


@dataclass(slots=True)
class DecodeBucket:
    """Decode rows of similar context length, attended together (eager path)."""

    rows: torch.Tensor | None  # [b] positions among the decode rows; None: all of them, in order
    block_ids: torch.Tensor  # [b * nb] the rows' block tables, flattened
    num_blocks: int  # nb: blocks of the longest row in the bucket
    mask: torch.Tensor  # [b, 1, 1, nb * block_size] additive (0 / -inf)


# Each bucket costs a gather, an SDPA call and two small index ops per layer, about what attending
# BUCKET_COST_TOKENS more padded slots costs on a CPU; the plan picks the number of buckets (a power of
# two up to MAX_DECODE_BUCKETS, each of at least MIN_ROWS_PER_BUCKET rows) that minimises padded slots
# plus that overhead. (bench engine, 64 rows of 16..512 tokens: 8 buckets, ~12% more tokens/s than one.)
MAX_DECODE_BUCKETS = 8
MIN_ROWS_PER_BUCKET = 4
BUCKET_COST_TOKENS = 512


def plan_decode_buckets(context_lens: np.ndarray, block_size: int) -> list[np.ndarray] | None:
    """Row groups (positions into `context_lens`) to attend separately, or None for one padded batch."""
    num_rows = len(context_lens)
    blocks = (context_lens + block_size - 1) // block_size
    best_groups: list[np.ndarray] | None = None
    best_cost = num_rows * int(blocks.max()) * block_size + BUCKET_COST_TOKENS
    order = np.argsort(blocks, kind="stable")
    num_buckets = 2
    while num_buckets <= min(MAX_DECODE_BUCKETS, num_rows // MIN_ROWS_PER_BUCKET):
        groups = np.array_split(order, num_buckets)
        padded = sum(len(g) * int(blocks[g].max()) for g in groups) * block_size
        cost = padded + num_buckets * BUCKET_COST_TOKENS
        if cost < best_cost:
            best_groups, best_cost = groups, cost
        num_buckets *= 2
    return best_groups


@dataclass(slots=True)
class PagedAttentionMetadata:
    """What the attention function needs for one step; built once per step, read by every layer."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_pool, v_pool)
    slot_mapping: torch.Tensor  # [T] long: pool slot of each new token
    num_tokens: int
    num_decodes: int
    decode_token_indices: torch.Tensor | None  # [Bd]; None when the decode rows are tokens [0, Bd)
    decode_block_tables: torch.Tensor | None  # kernel path: [Bd', nb] long, Bd' >= Bd (padded)
    decode_context_lens: torch.Tensor | None  # [Bd'] long
    decode_buckets: list[DecodeBucket]  # eager path only
    prefills: list[PrefillSpan]
    scratch: AttentionScratch
    decode_kernel: DecodeKernel | None  # a compiled fused kernel; None: gather + SDPA


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
) -> PagedAttentionMetadata:
    """`query_lens`/`context_lens` are host arrays [B]; `block_tables` [B, W] and `slot_mapping` [T]
    live on the model's device."""
    device = block_tables.device
    dtype = kv_caches[0][0].dtype
    num_tokens = int(slot_mapping.shape[0])
    is_decode = query_lens == 1
    decode_rows = np.flatnonzero(is_decode)
    num_decodes = len(decode_rows)
    decode_token_indices = decode_block_tables = decode_context_lens = None
    decode_buckets: list[DecodeBucket] = []
    if num_decodes:
        # The scheduler puts running (decoding) sequences first, so the decode rows are usually the
        # leading rows and plain slices replace index gathers.
        is_leading = bool(is_decode[:num_decodes].all())
        dec_ctx = context_lens[decode_rows]
        num_dec_blocks = int((dec_ctx.max() + block_size - 1) // block_size)
        if is_leading:
            dec_tables = block_tables[:num_decodes, :num_dec_blocks]
        else:
            rows = torch.from_numpy(decode_rows).to(device)
            dec_tables = block_tables.index_select(0, rows)[:, :num_dec_blocks]
            decode_token_indices = torch.from_numpy((np.cumsum(query_lens) - 1)[decode_rows]).to(device)
        dec_ctx_t = torch.from_numpy(dec_ctx).to(device)
        if decode_kernel is None:
            groups = plan_decode_buckets(dec_ctx, block_size)
            if groups is None:
                decode_buckets = [_bucket(None, dec_tables, dec_ctx_t, num_dec_blocks, block_size, dtype)]
            else:
                for group in groups:
                    rows = torch.from_numpy(group).to(device)
                    nb = int((dec_ctx[group].max() + block_size - 1) // block_size)
                    tables = dec_tables.index_select(0, rows)[:, :nb]
                    bucket_ctx = dec_ctx_t.index_select(0, rows)
                    decode_buckets.append(_bucket(rows, tables, bucket_ctx, nb, block_size, dtype))
        else:
            # Compiled kernels specialise on sizes 0 and 1; padding to >= 2 rows and >= 2 blocks keeps
            # one compiled graph for every step. A padded row attends to slot 0 and is dropped.
            pad_rows = max(0, 2 - num_decodes)
            pad_cols = max(0, 2 - num_dec_blocks)
            decode_block_tables = F.pad(dec_tables, (0, pad_cols, 0, pad_rows))
            decode_context_lens = F.pad(dec_ctx_t, (0, pad_rows), value=1)
    prefills = []
    token_starts = np.cumsum(query_lens) - query_lens
    for row in np.flatnonzero(query_lens > 1).tolist():
        token_start, q_len, ctx_len = int(token_starts[row]), int(query_lens[row]), int(context_lens[row])
        if ctx_len == q_len:
            prefills.append(PrefillSpan(token_start, q_len, ctx_len, None, None))
            continue
        num_blocks = (ctx_len + block_size - 1) // block_size
        # Query i sits at context position ctx_len - q_len + i and sees everything up to it.
        is_future = torch.ones(q_len, ctx_len, dtype=torch.bool, device=device).triu(ctx_len - q_len + 1)
        mask = _additive(is_future, dtype)
        prefills.append(PrefillSpan(token_start, q_len, ctx_len, block_tables[row, :num_blocks], mask))
    return PagedAttentionMetadata(
        kv_caches=kv_caches,
        slot_mapping=slot_mapping,
        num_tokens=num_tokens,
        num_decodes=num_decodes,
        decode_token_indices=decode_token_indices,
        decode_block_tables=decode_block_tables,
        decode_context_lens=decode_context_lens,
        decode_buckets=decode_buckets,
        prefills=prefills,
        scratch=scratch,
        decode_kernel=decode_kernel,
    )


def _bucket(
    rows: torch.Tensor | None,
    tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
) -> DecodeBucket:
    positions = torch.arange(num_blocks * block_size, device=tables.device)
    is_padding = positions[None, :] >= context_lens[:, None]
    return DecodeBucket(
        rows=rows,
        block_ids=tables.reshape(-1),
        num_blocks=num_blocks,
        mask=_additive(is_padding, dtype)[:, None, None, :],
    )


def _additive(is_masked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # SDPA turns a boolean mask into an additive one on every call; built once here, every layer reuses it.
    return torch.zeros(is_masked.shape, dtype=dtype, device=is_masked.device).masked_fill_(
        is_masked, float("-inf")
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
    """query [1, H, T, D], key/value [1, KVH, T, D] (after RoPE) -> ([1, T, H, D], None)."""
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
    _, num_heads, num_tokens, head_dim = query.shape
    num_kv_heads = key.shape[1]
    assert num_tokens == md.num_tokens, "metadata built for another batch"
    layer_idx: int = module.layer_idx  # type: ignore[assignment]  # set by transformers on attention modules
    k_pool, v_pool = md.kv_caches[layer_idx]
    k_pool.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, key[0].transpose(0, 1))
    v_pool.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, value[0].transpose(0, 1))

    q = query[0].transpose(0, 1)  # [T, H, D], a view
    if md.num_decodes == num_tokens:
        return _decode(md, q, k_pool, v_pool, scaling).unsqueeze(0), None

    out = query.new_empty(num_tokens, num_heads, head_dim)
    if md.num_decodes:
        if md.decode_token_indices is None:
            out[: md.num_decodes] = _decode(md, q[: md.num_decodes], k_pool, v_pool, scaling)
        else:
            q_dec = q.index_select(0, md.decode_token_indices)
            out.index_copy_(0, md.decode_token_indices, _decode(md, q_dec, k_pool, v_pool, scaling))
    for span in md.prefills:
        end = span.token_start + span.num_query_tokens
        q_span = query[:, :, span.token_start : end]
        if span.block_ids is None:
            # Nothing cached: the new keys are the whole context and top-left causal is correct.
            o = F.scaled_dot_product_attention(
                q_span,
                key[:, :, span.token_start : end],
                value[:, :, span.token_start : end],
                is_causal=True,
                scale=scaling,
                enable_gqa=True,
            )
        else:
            k_blocks, v_blocks = md.scratch.gather(k_pool, v_pool, span.block_ids)
            k_ctx = k_blocks.view(-1, num_kv_heads, head_dim)[: span.context_len].transpose(0, 1)
            v_ctx = v_blocks.view(-1, num_kv_heads, head_dim)[: span.context_len].transpose(0, 1)
            o = F.scaled_dot_product_attention(
                q_span,
                k_ctx.unsqueeze(0),
                v_ctx.unsqueeze(0),
                attn_mask=span.mask,
                scale=scaling,
                enable_gqa=True,
            )
        out[span.token_start : end] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _decode(
    md: PagedAttentionMetadata,
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """q [Bd, H, D] -> [Bd, H, D]: one new token per row over its whole cached context."""
    num_rows, _, head_dim = q.shape
    scale = scaling if scaling is not None else head_dim**-0.5
    if md.decode_kernel is not None:
        assert md.decode_block_tables is not None
        assert md.decode_context_lens is not None
        pad_rows = md.decode_block_tables.shape[0] - num_rows
        if pad_rows:
            q = F.pad(q, (0, 0, 0, 0, 0, pad_rows))
        out = md.decode_kernel(q, k_pool, v_pool, md.decode_block_tables, md.decode_context_lens, scale)
        return out[:num_rows]
    if len(md.decode_buckets) == 1:
        return _decode_bucket(md, md.decode_buckets[0], q, k_pool, v_pool, scale)
    out = torch.empty_like(q)
    for bucket in md.decode_buckets:
        assert bucket.rows is not None
        rows_out = _decode_bucket(md, bucket, q.index_select(0, bucket.rows), k_pool, v_pool, scale)
        out.index_copy_(0, bucket.rows, rows_out)
    return out


def _decode_bucket(
    md: PagedAttentionMetadata,
    bucket: DecodeBucket,
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[2]
    k_blocks, v_blocks = md.scratch.gather(k_pool, v_pool, bucket.block_ids)
    context = bucket.num_blocks * k_pool.shape[1]
    k = k_blocks.view(num_rows, context, num_kv_heads, head_dim).transpose(1, 2)
    v = v_blocks.view(num_rows, context, num_kv_heads, head_dim).transpose(1, 2)
    # Pack the query heads that share a KV head as that head's "query positions": [Bd, KVH, G, D].
    # Head h uses KV head h // G, as in transformers' repeat_kv, and K/V are never copied per group.
    q_packed = q.reshape(num_rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q_packed, k, v, attn_mask=bucket.mask, scale=scale)
    return out.reshape(num_rows, num_heads, head_dim)


def fused_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Masked softmax over `pool[block_tables]` written as elementwise products and reductions, so
    that inductor fuses the gather into the reductions and reads each cached byte once. Meant to be
    compiled; eager it materialises a [B, nb, block_size, KVH, G, D] product."""
    num_rows, num_blocks = block_tables.shape
    block_size, num_kv_heads, head_dim = k_pool.shape[1], k_pool.shape[2], k_pool.shape[3]
    k = k_pool[block_tables].float()  # [B, nb, bs, KVH, D]
    v = v_pool[block_tables].float()
    qg = q.float().reshape(num_rows, 1, 1, num_kv_heads, -1, head_dim)  # [B, 1, 1, KVH, G, D]
    scores = (qg * k.unsqueeze(4)).sum(-1) * scale  # [B, nb, bs, KVH, G]
    positions = torch.arange(num_blocks * block_size, device=q.device).view(num_blocks, block_size, 1, 1)
    scores = scores.masked_fill(positions[None] >= context_lens.view(-1, 1, 1, 1, 1), float("-inf"))
    peak = scores.amax(dim=(1, 2), keepdim=True)
    weights = torch.exp(scores - peak)
    denom = weights.sum(dim=(1, 2))  # [B, KVH, G]
    out = (weights.unsqueeze(-1) * v.unsqueeze(4)).sum(dim=(1, 2)) / denom.unsqueeze(-1)
    return out.reshape(num_rows, -1, head_dim).to(q.dtype)


def compile_decode_kernel() -> DecodeKernel:
    """torch.compile(dynamic=True) of the fused kernel. Compilation happens on first call (seconds on
    a CPU: do it in warm-up); on 2 cores a single compile thread avoids starving the process."""
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1
    return torch.compile(fused_decode_attention, dynamic=True)


def register_paged_attention() -> str:
    """Register the function under PAGED_ATTENTION_NAME (idempotent); returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(PAGED_ATTENTION_NAME, paged_attention_forward)
    return PAGED_ATTENTION_NAME
