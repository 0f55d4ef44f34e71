"""The native paged attention kernel (serving/engine/native_attention.py, csrc/paged_attention.c): on random
block tables (a last block sometimes half of one), lengths, GQA ratios, head sizes and block sizes its
output equals dense attention over each sequence's contiguous keys (fp32, within 1e-5), and it writes the
step's new keys and values where the block tables say."""

from __future__ import annotations

import ast
import ctypes
import platform
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.engine.native_attention import NativeAttention, key_pool_view, load_native_attention, plan_items
from serving.engine.native_library import KernelUnavailable, build_library
from serving.engine.runner import ModelRunner


@pytest.fixture(scope="module")
def kernel() -> NativeAttention:
    return load_native_attention()


@st.composite
def steps(draw: st.DrawFn) -> dict:
    """One step over a few sequences: each decodes one token, prefills a chunk over a cached prefix, or
    prefills a fresh prompt; their blocks scattered over the pool in random order."""
    num_kv_heads = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))
    head_dim = draw(st.sampled_from([8, 16, 24, 64]))
    block_size = draw(st.sampled_from([16, 32]))
    num_seqs = draw(st.integers(1, 5))
    query_lens, context_lens, tail_halves = [], [], []
    for _ in range(num_seqs):
        context = draw(st.integers(1, 90))
        kind = draw(st.sampled_from(["decode", "chunk", "fresh"]))
        query = 1 if kind == "decode" else context if kind == "fresh" else draw(st.integers(1, context))
        query_lens.append(query)
        context_lens.append(context)
        # A last block holding at most half a block may be half of one (half_blocks.py): 0 or 1.
        fits_half = 0 < context % block_size <= block_size // 2
        tail_halves.append(draw(st.sampled_from([None, 0, 1])) if fits_half else None)
    return {
        "tail_halves": tail_halves,
        "num_kv_heads": num_kv_heads,
        "num_heads": num_kv_heads * group,
        "head_dim": head_dim,
        "block_size": block_size,
        "query_lens": np.array(query_lens, dtype=np.int64),
        "context_lens": np.array(context_lens, dtype=np.int64),
        "seed": draw(st.integers(0, 2**16)),
    }


def run_step(kernel: NativeAttention, case: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Runs the kernel on the case; returns its output, the dense reference and the pools."""
    g = torch.Generator().manual_seed(case["seed"])
    heads, kv_heads, dim, bs = case["num_heads"], case["num_kv_heads"], case["head_dim"], case["block_size"]
    query_lens, context_lens = case["query_lens"], case["context_lens"]
    num_seqs = len(query_lens)
    blocks_per_seq = [-(-int(c) // bs) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    width = max(blocks_per_seq)
    tables = torch.zeros(num_seqs, width, dtype=torch.long)
    keys = [torch.randn(int(c), kv_heads, dim, generator=g) for c in context_lens]
    values = [torch.randn(int(c), kv_heads, dim, generator=g) for c in context_lens]
    k_pool = torch.randn(num_blocks, bs, kv_heads, dim, generator=g)  # stale contents elsewhere
    v_pool = torch.randn(num_blocks, bs, kv_heads, dim, generator=g)
    slots, new_keys, new_values = [], [], []
    for row in range(num_seqs):
        tables[row, : blocks_per_seq[row]] = torch.tensor([order.pop() for _ in range(blocks_per_seq[row])])
        half = case["tail_halves"][row]
        if half is not None:
            last = blocks_per_seq[row] - 1
            tables[row, last] = ~(2 * int(tables[row, last]) + half)
        cached = int(context_lens[row] - query_lens[row])
        for position in range(int(context_lens[row])):
            slot = slot_of(int(tables[row, position // bs]), position, bs)
            if position < cached:
                k_pool.view(-1, kv_heads, dim)[slot] = keys[row][position]
                v_pool.view(-1, kv_heads, dim)[slot] = values[row][position]
            else:
                slots.append(slot)
        new_keys.append(keys[row][cached:])
        new_values.append(values[row][cached:])
    num_tokens = int(query_lens.sum())
    # The kernel's key layout: each block's keys transposed per KV head; the values right after the keys,
    # as the runner allocates them (a half's vector reads may run past the last block's keys).
    both = torch.empty(2, k_pool.numel())
    k_native = both[0].view(num_blocks, kv_heads, dim, bs)
    k_native.copy_(k_pool.permute(0, 2, 3, 1))
    v_pool = both[1].view(num_blocks, bs, kv_heads, dim).copy_(v_pool)
    q = torch.randn(num_tokens, heads, dim, generator=g)
    out = torch.full((num_tokens, heads, dim), float("nan"))
    step = kernel.step(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_tables=tables,
        items=plan_items(query_lens, context_lens, np.arange(num_seqs), heads),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=dim,
        block_size=bs,
    )
    scale = dim**-0.5
    kernel(
        step,
        q=q,
        k_new=torch.cat(new_keys),
        v_new=torch.cat(new_values),
        k_pool=k_native.view(num_blocks, kv_heads, dim, bs),
        v_pool=v_pool,
        out=out,
        scale=scale,
    )
    expected = torch.empty_like(out)
    token = 0
    for row in range(num_seqs):
        n_q, n_ctx = int(query_lens[row]), int(context_lens[row])
        visible = torch.ones(n_q, n_ctx, dtype=torch.bool).tril(n_ctx - n_q)  # bottom-right causal
        o = F.scaled_dot_product_attention(
            q[token : token + n_q].transpose(0, 1)[None].double(),
            keys[row].transpose(0, 1)[None].double(),
            values[row].transpose(0, 1)[None].double(),
            attn_mask=visible,
            scale=scale,
            enable_gqa=True,
        )
        expected[token : token + n_q] = o[0].transpose(0, 1).float()
        token += n_q
    pools = {"keys": keys, "values": values, "tables": tables, "k_native": k_native, "v_pool": v_pool}
    return out, expected, pools


def slot_of(entry: int, position: int, block_size: int) -> int:
    """The pool slot of `position` through its block-table entry (a negative entry: half a block)."""
    if entry >= 0:
        return entry * block_size + position % block_size
    block, half = divmod(~entry, 2)
    return block * block_size + half * block_size // 2 + position % block_size


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=steps())
def test_paged_result_equals_dense_attention(kernel: NativeAttention, case: dict) -> None:
    out, expected, _ = run_step(kernel, case)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def narrow_kernel(tmp_path_factory: pytest.TempPathFactory) -> NativeAttention:
    """The kernel built for 4-lane vectors, as on a CPU without AVX (csrc/vector_math.h picks the width
    from the CPU: 16 lanes with AVX-512, 8 with AVX, 4 otherwise). Each width folds keys in other groups,
    and each must give dense attention's answer."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("-mno-avx is an x86 flag")
    path = build_library(cache_dir=tmp_path_factory.mktemp("narrow"), extra_flags=("-mno-avx",))
    return NativeAttention(ctypes.CDLL(str(path)))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=steps())
def test_paged_result_equals_dense_attention_with_narrower_vectors(
    narrow_kernel: NativeAttention, case: dict
) -> None:
    out, expected, _ = run_step(narrow_kernel, case)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(case=steps())
def test_every_new_key_and_value_lands_in_its_slot(kernel: NativeAttention, case: dict) -> None:
    _, _, pools = run_step(kernel, case)
    bs, tables = case["block_size"], pools["tables"]
    k_standard = pools["k_native"].permute(0, 3, 1, 2)  # back to [blocks, block_size, KVH, D]
    for row, context in enumerate(case["context_lens"].tolist()):
        for position in range(context):
            block, offset = divmod(slot_of(int(tables[row, position // bs]), position, bs), bs)
            assert torch.equal(k_standard[block, offset], pools["keys"][row][position])
            assert torch.equal(pools["v_pool"][block, offset], pools["values"][row][position])


def test_decode_rows_make_one_item_each_and_long_chunks_are_cut() -> None:
    decode = plan_items(np.array([1, 1]), np.array([5, 40]), np.array([0, 1]), num_heads=8)
    assert decode.tolist() == [[0, 0, 1, 4], [1, 1, 1, 39]]
    # 128 query vectors per item: 16 queries of 8 heads; a 40-token chunk after 10 cached tokens.
    chunk = plan_items(np.array([1, 40]), np.array([7, 50]), np.array([1]), num_heads=8)
    assert chunk.tolist() == [[1, 1, 16, 10], [1, 17, 16, 26], [1, 33, 8, 42]]


def test_key_pool_view_shares_the_pools_memory() -> None:
    pool = torch.zeros(3, 16, 2, 8)
    view = key_pool_view(pool)
    assert view.shape == (3, 2, 8, 16)
    view[1, 0, 0, 5] = 1.0
    assert pool.view(-1)[1 * 16 * 2 * 8 + 5] == 1.0


@pytest.mark.parametrize(
    ("shape", "reason"),
    [
        ({"num_heads": 8, "num_kv_heads": 4, "head_dim": 512, "block_size": 16}, "head_dim"),
        ({"num_heads": 8, "num_kv_heads": 4, "head_dim": 64, "block_size": 8}, "block_size"),
        ({"num_heads": 6, "num_kv_heads": 4, "head_dim": 64, "block_size": 16}, "query heads"),
    ],
)
def test_shapes_past_the_kernels_limits_are_named(shape: dict, reason: str) -> None:
    assert reason in (NativeAttention.supports(**shape) or "")


def test_a_runner_keeps_the_gather_path_where_the_kernel_cannot_serve_and_says_why(
    tiny_llama_dir: Path,
) -> None:
    options = {"kv_cache_bytes": 1 << 20, "max_num_seqs": 4, "max_num_batched_tokens": 64, "block_size": 8}
    runner = ModelRunner(tiny_llama_dir, **options)
    assert runner.kernel is None
    assert "gather + SDPA (block_size 8" in runner.describe()
    with pytest.raises(KernelUnavailable, match="block_size 8"):
        ModelRunner(tiny_llama_dir, attention="native", **options)


def test_a_source_that_does_not_compile_is_unavailable_with_the_compilers_words(tmp_path: Path) -> None:
    broken = tmp_path / "broken.c"
    broken.write_text("int sy_paged_attention(void) { return this is not C; }\n")
    with pytest.raises(KernelUnavailable, match="error"):
        build_library(source_files=[broken], cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.so"))  # nothing half-built is left to be loaded later


def test_the_build_is_cached_by_source_and_reused(tmp_path: Path) -> None:
    first = build_library(cache_dir=tmp_path)
    modified = first.stat().st_mtime_ns
    assert build_library(cache_dir=tmp_path) == first
    assert first.stat().st_mtime_ns == modified


def test_the_kernel_runs_on_torchs_openmp_runtime() -> None:
    # One libgomp in a process that holds torch and the kernel: the kernel's threads are torch's, not a
    # second pool on the same cores. (In a fresh process: other packages bring copies of their own.)
    script = (
        "from pathlib import Path\n"
        "import torch\n"
        "from serving.engine.native_attention import load_native_attention\n"
        "load_native_attention()\n"
        "maps = Path('/proc/self/maps').read_text().splitlines()\n"
        "print(sorted({line.split()[-1] for line in maps if 'libgomp' in line}))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    files = ast.literal_eval(result.stdout.strip().splitlines()[-1])
    assert len(files) == 1 and "torch" in files[0], files


def test_engines_in_two_threads_call_the_kernel_at_once_and_each_gets_its_own_answer(
    kernel: NativeAttention,
) -> None:
    # An embedded server steps one engine per model version, each on its own thread: a call's arguments
    # must be the call's own (a shared argument record once sent one thread's pointers to the other).
    cases = [
        {
            "num_kv_heads": 2,
            "num_heads": 4,
            "head_dim": 64,
            "block_size": 16,
            "query_lens": np.array([1, 1, 9], dtype=np.int64),
            "context_lens": np.array([70, 33, 40], dtype=np.int64),
            "seed": seed,
        }
        for seed in range(2)
    ]
    failures: list[str] = []

    def repeat(case: dict) -> None:
        for _ in range(60):
            out, expected, _ = run_step(kernel, case)
            if not torch.allclose(out, expected, atol=1e-5, rtol=1e-5):
                failures.append(f"seed {case['seed']}: max error {(out - expected).abs().max().item()}")
                return

    threads = [threading.Thread(target=repeat, args=(case,)) for case in cases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
