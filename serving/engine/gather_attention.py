"""Paged attention's portable path: each step's blocks gathered from the pool into contiguous buffers,
then SDPA. Any device; on a CPU in fp32 the native kernel (native_attention.py) replaces it where it
builds (attention.py chooses).

- decode rows (one new token) are batched: their blocks are gathered into a persistent scratch buffer
  and one SDPA call runs with a per-row length mask, query heads packed per KV head so K/V are never
  repeated for GQA. Rows are padded to the longest context in their batch, so when lengths spread
  widely the rows are sorted by length and cut into a few buckets, one gather + SDPA each
  (plan_decode_buckets);
- or, compiled (`compile_decode_kernel`), one fused masked softmax over `pool[block_tables]`;
- prefill chunks over a cached prefix gather their blocks and run one SDPA each with a bottom-right
  causal mask (attention.py), since new tokens attend to the cached context plus the earlier new tokens.

One SDPA over a block-diagonal mask of the whole batch would cost O(B^2); we never build one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

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
        self.num_bytes_copied = 0  # by every gather so far: the cost the native kernel does without

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
        self.num_bytes_copied += k.nbytes + v.nbytes
        return k, v


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
class GatherDecode:
    """The decode rows of one step, as the gather path attends them."""

    num_rows: int
    token_indices: torch.Tensor | None  # [Bd]; None when the decode rows are tokens [0, Bd)
    buckets: list[DecodeBucket]  # eager path
    block_tables: torch.Tensor | None  # compiled kernel: [Bd', nb] long, Bd' >= Bd (padded)
    context_lens: torch.Tensor | None  # compiled kernel: [Bd'] long
    kernel: DecodeKernel | None  # the compiled kernel; None: gather + SDPA
    scratch: AttentionScratch


def plan_gather_decode(
    *,
    scratch: AttentionScratch,
    block_size: int,
    query_lens: np.ndarray,
    context_lens: np.ndarray,
    block_tables: torch.Tensor,
    dtype: torch.dtype,
    kernel: DecodeKernel | None,
) -> GatherDecode | None:
    """The step's decode rows (query length 1), or None when it has none."""
    device = block_tables.device
    is_decode = query_lens == 1
    decode_rows = np.flatnonzero(is_decode)
    num_decodes = len(decode_rows)
    if not num_decodes:
        return None
    token_indices = None
    buckets: list[DecodeBucket] = []
    padded_tables = padded_context_lens = None
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
        token_indices = torch.from_numpy((np.cumsum(query_lens) - 1)[decode_rows]).to(device)
    dec_ctx_t = torch.from_numpy(dec_ctx).to(device)
    if kernel is None:
        groups = plan_decode_buckets(dec_ctx, block_size)
        if groups is None:
            buckets = [_bucket(None, dec_tables, dec_ctx_t, num_dec_blocks, block_size, dtype)]
        else:
            for group in groups:
                rows = torch.from_numpy(group).to(device)
                nb = int((dec_ctx[group].max() + block_size - 1) // block_size)
                tables = dec_tables.index_select(0, rows)[:, :nb]
                bucket_ctx = dec_ctx_t.index_select(0, rows)
                buckets.append(_bucket(rows, tables, bucket_ctx, nb, block_size, dtype))
    else:
        # Compiled kernels specialise on sizes 0 and 1; padding to >= 2 rows and >= 2 blocks keeps
        # one compiled graph for every step. A padded row attends to slot 0 and is dropped.
        pad_rows = max(0, 2 - num_decodes)
        pad_cols = max(0, 2 - num_dec_blocks)
        padded_tables = F.pad(dec_tables, (0, pad_cols, 0, pad_rows))
        padded_context_lens = F.pad(dec_ctx_t, (0, pad_rows), value=1)
    return GatherDecode(
        num_rows=num_decodes,
        token_indices=token_indices,
        buckets=buckets,
        block_tables=padded_tables,
        context_lens=padded_context_lens,
        kernel=kernel,
        scratch=scratch,
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
        mask=additive_mask(is_padding, dtype)[:, None, None, :],
    )


def additive_mask(is_masked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # SDPA turns a boolean mask into an additive one on every call; built once here, every layer reuses it.
    return torch.zeros(is_masked.shape, dtype=dtype, device=is_masked.device).masked_fill_(
        is_masked, float("-inf")
    )


def attend_decode(
    md: GatherDecode,
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [Bd, H, D] -> [Bd, H, D]: one new token per row over its whole cached context."""
    num_rows = q.shape[0]
    if md.kernel is not None:
        assert md.block_tables is not None
        assert md.context_lens is not None
        pad_rows = md.block_tables.shape[0] - num_rows
        if pad_rows:
            q = F.pad(q, (0, 0, 0, 0, 0, pad_rows))
        out = md.kernel(q, k_pool, v_pool, md.block_tables, md.context_lens, scale)
        return out[:num_rows]
    if len(md.buckets) == 1:
        return _decode_bucket(md, md.buckets[0], q, k_pool, v_pool, scale)
    out = torch.empty_like(q)
    for bucket in md.buckets:
        assert bucket.rows is not None
        rows_out = _decode_bucket(md, bucket, q.index_select(0, bucket.rows), k_pool, v_pool, scale)
        out.index_copy_(0, bucket.rows, rows_out)
    return out


def _decode_bucket(
    md: GatherDecode,
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
