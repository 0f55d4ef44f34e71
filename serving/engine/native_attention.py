"""Paged attention in C (csrc/paged_attention.c), through ctypes: the Python side of the kernel.

Why a kernel of our own: torch has no CPU attention that reads K/V through a block table, so the eager
path copied every decode row's blocks into contiguous buffers each layer and step before SDPA; that copy
was 16% of a batch-64 decode step (docs/benchmarks.md, "Engine step cost"). This kernel reads each
cached byte once, where it lives, and also writes the step's new keys and values into their slots.
native_library.py builds and loads it; where it cannot, the engine keeps the gather + SDPA path."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch

from serving.engine.native_library import load_library

PROFILE_NAME = "switchyard::paged_attention"  # how a profile of a step names the kernel's calls
# The C file's limits (SY_MAX_*): a model past them keeps the SDPA path.
MAX_VECTORS_PER_ITEM = 128
MAX_HEAD_DIM = 256
MAX_BLOCK_SIZE = 64


class _LayerArgs(ctypes.Structure):
    _fields_ = [
        ("k_new", ctypes.c_void_p),
        ("v_new", ctypes.c_void_p),
        ("kv_token_stride", ctypes.c_int64),
        ("kv_head_stride", ctypes.c_int64),
        ("k_pool", ctypes.c_void_p),
        ("v_pool", ctypes.c_void_p),
        ("q", ctypes.c_void_p),
        ("q_token_stride", ctypes.c_int64),
        ("q_head_stride", ctypes.c_int64),
        ("out", ctypes.c_void_p),
        ("out_token_stride", ctypes.c_int64),
        ("out_head_stride", ctypes.c_int64),
        ("scale", ctypes.c_float),
    ]


class _StepArgs(ctypes.Structure):
    _fields_ = [
        ("slot_mapping", ctypes.c_void_p),
        ("num_new_tokens", ctypes.c_int64),
        ("block_tables", ctypes.c_void_p),
        ("table_stride", ctypes.c_int64),
        ("items", ctypes.c_void_p),
        ("num_items", ctypes.c_int64),
        ("num_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("num_threads", ctypes.c_int32),
    ]


@dataclass(slots=True)
class KernelStep:
    """One step's arguments, built once and shared by every layer's call, and the per-layer arguments
    those calls fill in (a step's own: engines in other threads step at the same time). Holds the
    tensors whose memory the arguments point at, so they live as long as the step."""

    args: _StepArgs
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    items: np.ndarray
    layer: _LayerArgs


def key_pool_view(pool: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of a layer's key pool, over the same memory as [num_blocks, block_size,
    num_kv_heads, head_dim]: [num_blocks, num_kv_heads, head_dim, block_size], each block's keys
    transposed per KV head (csrc/paged_attention.c says why)."""
    num_blocks, block_size, num_kv_heads, head_dim = pool.shape
    return pool.view(num_blocks, num_kv_heads, head_dim, block_size)


def plan_items(
    query_lens: np.ndarray, context_lens: np.ndarray, rows: np.ndarray, num_heads: int
) -> np.ndarray:
    """The kernel's work items for the listed rows of a step: [n, 4] int64 (row, first token, number of
    queries, position of the first query). A row's queries are cut into items of at most
    MAX_VECTORS_PER_ITEM // num_heads queries, so a long chunk spreads over the threads."""
    token_starts = np.cumsum(query_lens) - query_lens
    max_queries = max(1, MAX_VECTORS_PER_ITEM // num_heads)
    if len(rows) and bool((query_lens[rows] == 1).all()):  # decode rows only: one item each
        first = context_lens[rows] - 1
        return np.stack([rows, token_starts[rows], np.ones_like(rows), first], axis=1).astype(np.int64)
    items = []
    for row in rows.tolist():
        q_len, start = int(query_lens[row]), int(token_starts[row])
        first_position = int(context_lens[row]) - q_len
        for offset in range(0, q_len, max_queries):
            count = min(max_queries, q_len - offset)
            items.append((row, start + offset, count, first_position + offset))
    return np.array(items, dtype=np.int64).reshape(-1, 4)


class NativeAttention:
    """The attention kernel's entry point in the loaded library."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._call = library.sy_paged_attention
        self._call.argtypes = [ctypes.POINTER(_StepArgs), ctypes.POINTER(_LayerArgs)]
        self._call.restype = ctypes.c_int

    @staticmethod
    def supports(*, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> str | None:
        """Why these shapes are past the kernel's limits, or None when it serves them."""
        if head_dim > MAX_HEAD_DIM:
            return f"head_dim {head_dim} > {MAX_HEAD_DIM}"
        if block_size > MAX_BLOCK_SIZE or block_size % 16:
            return f"block_size {block_size} (the kernel takes multiples of 16 up to {MAX_BLOCK_SIZE})"
        if num_heads % num_kv_heads or num_heads > MAX_VECTORS_PER_ITEM:
            return f"{num_heads} query heads over {num_kv_heads} KV heads"
        return None

    def step(
        self,
        *,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        items: np.ndarray,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
    ) -> KernelStep:
        """`slot_mapping` [T] and `block_tables` [B, W] int64 on the CPU, each row contiguous."""
        for name, tensor in (("slot_mapping", slot_mapping), ("block_tables", block_tables)):
            if tensor.dtype != torch.int64 or tensor.device.type != "cpu" or tensor.stride(-1) != 1:
                raise ValueError(f"{name} must be int64 on the CPU with contiguous rows")
        items = np.ascontiguousarray(items, dtype=np.int64)
        args = _StepArgs(
            slot_mapping=slot_mapping.data_ptr(),
            num_new_tokens=slot_mapping.shape[0],
            block_tables=block_tables.data_ptr(),
            table_stride=block_tables.stride(0),
            items=items.ctypes.data,
            num_items=items.shape[0],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            num_threads=torch.get_num_threads(),
        )
        return KernelStep(args, slot_mapping, block_tables, items, _LayerArgs())

    def __call__(
        self,
        step: KernelStep,
        *,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        out: torch.Tensor,
        scale: float,
    ) -> None:
        """Writes `k_new`/`v_new` [T, KVH, D] into the pools' slots (`k_pool` in `key_pool_view`'s layout,
        `v_pool` [num_blocks, block_size, KVH, D]), then the attention of the step's items from `q`
        [T, H, D] into `out` [T, H, D]. Any strides on the first two dims; the last is
        contiguous, every tensor fp32 on the CPU (checked by the caller once, not per layer)."""
        layer = step.layer
        layer.k_new = k_new.data_ptr()
        layer.v_new = v_new.data_ptr()
        layer.kv_token_stride, layer.kv_head_stride = k_new.stride(0), k_new.stride(1)
        layer.k_pool = k_pool.data_ptr()
        layer.v_pool = v_pool.data_ptr()
        layer.q = q.data_ptr()
        layer.q_token_stride, layer.q_head_stride = q.stride(0), q.stride(1)
        layer.out = out.data_ptr()
        layer.out_token_stride, layer.out_head_stride = out.stride(0), out.stride(1)
        layer.scale = scale
        if getattr(torch.autograd.profiler, "_is_profiler_enabled", False):
            # A profile sees no C call: name it there (and only then, so a step pays nothing for it).
            with torch.profiler.record_function(PROFILE_NAME):
                status = self._call(ctypes.byref(step.args), ctypes.byref(layer))
        else:
            status = self._call(ctypes.byref(step.args), ctypes.byref(layer))
        if status != 0:
            raise ValueError("paged attention kernel: shapes past its limits")


def load_native_attention() -> NativeAttention:
    """The kernel (native_library.py builds it); raises KernelUnavailable saying why not."""
    return _attention(load_library())


@functools.cache
def _attention(library: ctypes.CDLL) -> NativeAttention:
    return NativeAttention(library)
