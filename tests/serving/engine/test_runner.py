"""ModelRunner + paged attention, driven by a tiny hand-written block allocator (no scheduler): greedy
output must equal model.generate token for token, and the logits must match a plain forward pass."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from serving.engine.attention import PAGED_ATTENTION_NAME, build_attention_metadata, paged_attention_forward
from serving.engine.gather_attention import AttentionScratch, compile_decode_kernel, fused_decode_attention
from serving.engine.runner import ModelRunner
from serving.engine.sequence import Sequence
from tests.serving.engine.greedy import (
    BLOCK_SIZE,
    Request,
    check_against_reference,
    mixed_requests,
    run_greedy,
)

# (forward, attention): the engine's own Llama forward and transformers' modules, each over the native
# kernel and over gather + SDPA. A path that silently fell back to another would not be tested, so each
# is required (a machine without a C compiler fails the native ones, as it should: CI has one).
PATHS = [("fused", "native"), ("fused", "gather"), ("generic", "native"), ("generic", "gather")]
PATH_IDS = ["-".join(path) for path in PATHS]


def make_runner(model_dir: Path, path: tuple[str, str], **kwargs: int) -> ModelRunner:
    forward, attention = path
    options = {"kv_cache_bytes": 256 * 8192, "max_num_seqs": 16, "max_num_batched_tokens": 512} | kwargs
    return ModelRunner(model_dir, block_size=BLOCK_SIZE, forward=forward, attention=attention, **options)


@pytest.fixture(scope="module", params=PATHS, ids=PATH_IDS)
def path_runner(request: pytest.FixtureRequest, tiny_llama_dir: Path) -> ModelRunner:
    runner = make_runner(tiny_llama_dir, request.param)
    assert (runner.fused is not None) == (request.param[0] == "fused")
    assert (runner.kernel is not None) == (request.param[1] == "native")
    return runner


@pytest.fixture(scope="module")
def tiny_runner(tiny_llama_dir: Path) -> ModelRunner:
    return ModelRunner(
        tiny_llama_dir,
        kv_cache_bytes=256 * 8192,
        block_size=BLOCK_SIZE,
        max_num_seqs=16,
        max_num_batched_tokens=512,
    )


def test_the_default_runner_takes_the_fused_forward_and_the_native_kernel(tiny_runner: ModelRunner) -> None:
    assert tiny_runner.fused is not None
    assert tiny_runner.kernel is not None
    assert tiny_runner.describe().startswith("fused Llama forward (C row ops); native paged kernel")


@pytest.mark.parametrize("decodes_first", [True, False], ids=["decodes-first", "arrival-order"])
@pytest.mark.parametrize("chunk_size", [1, 5, 512])
def test_greedy_equals_generate_on_tiny_gqa_llama(
    path_runner: ModelRunner, tiny_llama_dir: Path, chunk_size: int, decodes_first: bool
) -> None:
    requests = mixed_requests(path_runner.vocab_size, seed=chunk_size)
    results = run_greedy(path_runner, requests, chunk_size=chunk_size, decodes_first=decodes_first)
    check_against_reference(tiny_llama_dir, requests, results)


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_greedy_equals_generate_on_stories260k(stories_dir: Path, path: tuple[str, str]) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(stories_dir / "tokenizer.json"))
    runner = make_runner(
        stories_dir, path, kv_cache_bytes=1 << 20, max_num_seqs=8, max_num_batched_tokens=256
    )
    texts = [
        "Once upon a time, there was a little girl named Lily.",
        "The cat sat",
        "Tom and his dog went to the park to play with a big red ball",
    ]
    prompts = [[1, *tokenizer.encode(t, add_special_tokens=False).ids] for t in texts]
    shared = prompts[0] * 3  # long enough to fill two blocks
    requests = [
        Request("lily", prompts[0], arrival_step=0, max_new_tokens=20),
        Request("cat", prompts[1], arrival_step=1, max_new_tokens=24),
        Request("tom", prompts[2], arrival_step=3, max_new_tokens=16),
        Request("owner", shared, arrival_step=0, max_new_tokens=6),
        Request(
            "prefix-tail",
            [*shared[:32], *prompts[1][1:]],
            arrival_step=14,
            max_new_tokens=10,
            prefix_from="owner",
        ),
    ]
    results = run_greedy(runner, requests, chunk_size=5, decodes_first=False, eos_token_id=2)
    check_against_reference(stories_dir, requests, results)
    assert any(len(r.tokens) > 5 for r in results.values())


def test_refuses_model_dir_without_safetensors(tmp_path: Path, tiny_llama_dir: Path) -> None:
    (tmp_path / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="safetensors"):
        ModelRunner(tmp_path, kv_cache_bytes=1 << 20, max_num_seqs=4, max_num_batched_tokens=64)


def test_kv_pool_matches_budget_within_one_block(tiny_runner: ModelRunner, tiny_llama_dir: Path) -> None:
    # 2 layers x (K, V) x 16 tokens x 2 KV heads x 16 dims x 4 bytes
    assert tiny_runner.bytes_per_block == 2 * 2 * 16 * 2 * 16 * 4
    budget = 1_000_003
    runner = ModelRunner(tiny_llama_dir, kv_cache_bytes=budget, max_num_seqs=4, max_num_batched_tokens=64)
    assert 0 <= budget - runner.kv_cache_bytes_allocated < runner.bytes_per_block
    pool_bytes = sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)
    assert pool_bytes == runner.kv_cache_bytes_allocated == runner.num_blocks * runner.bytes_per_block
    with pytest.raises(ValueError, match="below one block"):
        ModelRunner(
            tiny_llama_dir,
            kv_cache_bytes=runner.bytes_per_block - 1,
            max_num_seqs=4,
            max_num_batched_tokens=64,
        )


def _seq(num_tokens: int, num_computed: int, blocks: list[int]) -> Sequence:
    seq = Sequence(request_id=f"s{num_tokens}", prompt_token_ids=list(range(3, 3 + num_tokens)))
    seq.num_computed_tokens = num_computed
    seq.block_table = blocks
    return seq


def test_build_batch_flattens_positions_slots_and_sample_rows(tiny_runner: ModelRunner) -> None:
    decode = _seq(20, 19, [7, 3])  # one new token at position 19 -> block 3, offset 3
    chunk = _seq(30, 5, [9, 4])  # positions 5..9, more prompt remains: not sampled
    tail = _seq(18, 16, [2, 8])  # positions 16..17 reach the end: sampled
    batch = tiny_runner.build_batch([decode, chunk, tail], [1, 5, 2])
    assert batch.input_ids.tolist() == [22, 8, 9, 10, 11, 12, 19, 20]
    assert batch.positions.tolist() == [19, 5, 6, 7, 8, 9, 16, 17]
    assert batch.slot_mapping.tolist() == [
        3 * 16 + 3,
        *(9 * 16 + p for p in range(5, 10)),
        8 * 16,
        8 * 16 + 1,
    ]
    assert batch.block_tables.tolist() == [[7, 3], [9, 0], [2, 8]]  # padded with block 0
    assert batch.context_lens.tolist() == [20, 10, 18]
    assert batch.sampled_seq_indices.tolist() == [0, 2]
    assert batch.sample_indices.tolist() == [0, 7]
    assert tiny_runner.execute(batch).shape == (2, tiny_runner.vocab_size)


def test_mid_prompt_chunks_return_no_logits(tiny_runner: ModelRunner) -> None:
    batch = tiny_runner.build_batch([_seq(40, 0, [1, 2, 5])], [16])
    assert tiny_runner.execute(batch).shape == (0, tiny_runner.vocab_size)


@pytest.mark.parametrize(
    ("seqs", "num_new", "message"),
    [
        ([_seq(10, 9, [1])], [2], "holds 10"),
        ([_seq(20, 0, [1])], [20], "need 2 blocks"),
        ([_seq(10, 0, [1])], [0], ">= 1 new token"),
        ([_seq(10, 0, [1])], [5, 5], "token counts"),
        ([], [], "1..16 sequences"),
        ([_seq(600, 0, list(range(38)))], [600], "max_num_batched_tokens|context"),
        ([_seq(10, 0, [10_000])], [10], "block ids"),
    ],
)
def test_build_batch_rejects_inconsistent_input(
    tiny_runner: ModelRunner, seqs: list[Sequence], num_new: list[int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_runner.build_batch(seqs, num_new)


def test_attention_refuses_to_run_without_metadata() -> None:
    module = torch.nn.Module()
    module.layer_idx = 0  # type: ignore[assignment]
    q = torch.zeros(1, 4, 3, 8)
    kv = torch.zeros(1, 2, 3, 8)
    with pytest.raises(ValueError, match=PAGED_ATTENTION_NAME):
        paged_attention_forward(module, q, kv, kv, None, scaling=1.0)


def _random_decode_case(num_rows: int, context_lens: list[int]) -> tuple:
    torch.manual_seed(1)
    kv_heads, heads, dim = 2, 6, 8
    width = max(-(-c // BLOCK_SIZE) for c in context_lens)
    num_blocks = max(64, num_rows * width)
    k_pool = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, dim)
    v_pool = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, dim)
    tables = torch.randperm(num_blocks)[: num_rows * width].view(num_rows, width)
    q = torch.randn(num_rows, heads, dim)
    return q, k_pool, v_pool, tables, torch.tensor(context_lens)


def _reference_decode(q, k_pool, v_pool, tables, context_lens) -> torch.Tensor:
    outs = []
    for row in range(q.shape[0]):
        n = int(context_lens[row])
        k = k_pool[tables[row]].reshape(-1, *k_pool.shape[2:])[:n].transpose(0, 1)  # [KVH, n, D]
        v = v_pool[tables[row]].reshape(-1, *v_pool.shape[2:])[:n].transpose(0, 1)
        group = q.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        weights = torch.softmax(q[row, :, None, :] @ k.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)
        outs.append((weights @ v)[:, 0])
    return torch.stack(outs)


def _eager_decode(q, k_pool, v_pool, tables, context_lens) -> torch.Tensor:
    """The registered function over decode rows whose new keys are already in the pool."""
    import numpy as np

    num_rows, num_kv_heads, dim = q.shape[0], k_pool.shape[2], q.shape[2]
    positions = (context_lens - 1).tolist()
    slots = torch.tensor(
        [int(tables[r, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for r, p in enumerate(positions)]
    )
    kv_caches = [(k_pool, v_pool)]
    metadata = build_attention_metadata(
        kv_caches=kv_caches,
        scratch=AttentionScratch(
            block_size=BLOCK_SIZE,
            num_kv_heads=num_kv_heads,
            head_dim=dim,
            dtype=torch.float32,
            device=torch.device("cpu"),
        ),
        block_size=BLOCK_SIZE,
        query_lens=np.ones(num_rows, dtype=np.int64),
        context_lens=context_lens.numpy(),
        block_tables=tables,
        slot_mapping=slots,
    )
    module = torch.nn.Module()
    module.layer_idx = 0  # type: ignore[assignment]
    flat = k_pool.view(-1, num_kv_heads, dim)
    new_k = flat[slots].transpose(0, 1)[None]  # rewrite what is there: the pool stays as it was
    new_v = v_pool.view(-1, num_kv_heads, dim)[slots].transpose(0, 1)[None]
    out, _ = paged_attention_forward(
        module, q.transpose(0, 1)[None], new_k, new_v, None, scaling=dim**-0.5, paged_metadata=metadata
    )
    return out[0], metadata


def test_decode_rows_of_spread_lengths_are_bucketed_and_agree_with_the_reference() -> None:
    lengths = [1 + (i * 37) % 150 for i in range(40)]  # 1..150 tokens, shuffled
    q, k_pool, v_pool, tables, context_lens = _random_decode_case(40, lengths)
    out, metadata = _eager_decode(q, k_pool, v_pool, tables, context_lens)
    assert len(metadata.decode.buckets) > 1
    assert sum(len(b.rows) for b in metadata.decode.buckets) == 40
    padded = sum(len(b.rows) * b.num_blocks for b in metadata.decode.buckets)
    assert padded < 0.8 * 40 * max(b.num_blocks for b in metadata.decode.buckets)
    expected = _reference_decode(q, k_pool, v_pool, tables, context_lens)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_decode_rows_of_similar_lengths_stay_in_one_batch() -> None:
    q, k_pool, v_pool, tables, context_lens = _random_decode_case(40, [100 + i % 5 for i in range(40)])
    out, metadata = _eager_decode(q, k_pool, v_pool, tables, context_lens)
    assert len(metadata.decode.buckets) == 1 and metadata.decode.buckets[0].rows is None
    torch.testing.assert_close(
        out, _reference_decode(q, k_pool, v_pool, tables, context_lens), atol=1e-5, rtol=1e-5
    )


def test_decode_paths_agree_with_a_naive_reference() -> None:
    q, k_pool, v_pool, tables, context_lens = _random_decode_case(3, [1, 17, 40])
    expected = _reference_decode(q, k_pool, v_pool, tables, context_lens)
    fused = fused_decode_attention(q, k_pool, v_pool, tables, context_lens, q.shape[-1] ** -0.5)
    torch.testing.assert_close(fused, expected, atol=1e-5, rtol=1e-5)

    # The eager path through the registered function: all rows are decodes, new keys written first.
    import numpy as np

    kv_caches = [(k_pool.clone(), v_pool.clone())]
    new_k = torch.randn(1, 2, 3, 8)
    new_v = torch.randn(1, 2, 3, 8)
    positions = (context_lens - 1).tolist()
    slots = torch.tensor(
        [int(tables[r, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for r, p in enumerate(positions)]
    )
    metadata = build_attention_metadata(
        kv_caches=kv_caches,
        scratch=AttentionScratch(
            block_size=BLOCK_SIZE, num_kv_heads=2, head_dim=8, dtype=torch.float32, device=torch.device("cpu")
        ),
        block_size=BLOCK_SIZE,
        query_lens=np.ones(3, dtype=np.int64),
        context_lens=context_lens.numpy(),
        block_tables=tables,
        slot_mapping=slots,
    )
    module = torch.nn.Module()
    module.layer_idx = 0  # type: ignore[assignment]
    out, _ = paged_attention_forward(
        module,
        q.transpose(0, 1)[None],
        new_k,
        new_v,
        None,
        scaling=q.shape[-1] ** -0.5,
        paged_metadata=metadata,
    )
    k_written, v_written = kv_caches[0]
    expected = _reference_decode(q, k_written, v_written, tables, context_lens)
    torch.testing.assert_close(out[0], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(
    not os.environ.get("SWITCHYARD_TEST_COMPILE"),
    reason="torch.compile takes 6-30 s here; set SWITCHYARD_TEST_COMPILE=1",
)
def test_compiled_runner_equals_generate(tiny_llama_dir: Path) -> None:
    assert compile_decode_kernel() is not None
    runner = ModelRunner(
        tiny_llama_dir,
        kv_cache_bytes=256 * 8192,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        compile_attention=True,
    )
    runner.warmup()
    requests = mixed_requests(runner.vocab_size, seed=5)
    results = run_greedy(runner, requests, chunk_size=5, decodes_first=False)
    check_against_reference(tiny_llama_dir, requests, results)


@pytest.mark.parametrize("attention", ["native", "gather"])
def test_warmup_runs_and_leaves_the_pool_empty(tiny_llama_dir: Path, attention: str) -> None:
    runner = ModelRunner(
        tiny_llama_dir,
        kv_cache_bytes=64 * 8192,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        attention=attention,
    )
    runner.warmup()
    assert all(not k.any() and not v.any() for k, v in runner.kv_caches)
    # The gather path's buffers exist before the first request; the native kernel needs none.
    assert runner.scratch.capacity_blocks >= (8 * 3 if attention == "gather" else 0)


def _packing_runner(tiny_llama_dir: Path, pack: bool | None, forward: str = "generic") -> ModelRunner:
    return ModelRunner(
        tiny_llama_dir,
        kv_cache_bytes=256 * 8192,
        block_size=BLOCK_SIZE,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        pack_linear=pack,
        forward=forward,
    )


def _prompt_logits(runner: ModelRunner) -> torch.Tensor:
    prompt = list(range(3, 40))
    seq = Sequence(request_id="a", prompt_token_ids=prompt)
    seq.block_table = list(range(-(-len(prompt) // BLOCK_SIZE)))
    return runner.execute(runner.build_batch([seq], [len(prompt)]))


def test_cpu_fp32_runners_pack_every_linear_and_compute_the_same_logits(tiny_llama_dir: Path) -> None:
    from serving.engine.packing import PackedLinear

    packed, plain = _packing_runner(tiny_llama_dir, True), _packing_runner(tiny_llama_dir, False)
    # 2 layers x (q, k, v, o, gate, up, down) + the LM head.
    assert packed.num_packed_linears == 15
    assert isinstance(packed.model.model.layers[0].self_attn.q_proj, PackedLinear)
    assert plain.num_packed_linears == 0
    torch.testing.assert_close(_prompt_logits(packed), _prompt_logits(plain), atol=1e-4, rtol=1e-4)


def test_the_fused_forward_packs_its_fused_weights_and_computes_the_same_logits(tiny_llama_dir: Path) -> None:
    packed = _packing_runner(tiny_llama_dir, True, forward="fused")
    plain = _packing_runner(tiny_llama_dir, False, forward="fused")
    generic = _packing_runner(tiny_llama_dir, False)
    # 2 layers x (qkv, o, gate_up, down) + the LM head.
    assert packed.num_packed_linears == 9
    assert plain.num_packed_linears == 0
    assert packed.fused is not None and packed.fused.layers[0].qkv.is_packed
    reference = _prompt_logits(generic)
    torch.testing.assert_close(_prompt_logits(packed), reference, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(_prompt_logits(plain), reference, atol=1e-4, rtol=1e-4)


def test_a_runner_left_to_choose_times_both_and_follows_its_verdict(tiny_llama_dir: Path) -> None:
    chosen, plain = _packing_runner(tiny_llama_dir, None), _packing_runner(tiny_llama_dir, False)
    assert chosen.packing is not None
    # 2 layers x (q, k, v, o, gate, up, down) + the LM head, all or none.
    assert chosen.num_packed_linears == (15 if chosen.packing.pack else 0)
    assert chosen.packing.describe().startswith("packed" if chosen.packing.pack else "plain")
    assert plain.packing is None  # told, not timed
    torch.testing.assert_close(_prompt_logits(chosen), _prompt_logits(plain), atol=1e-4, rtol=1e-4)
