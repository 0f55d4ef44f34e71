"""Reading a PEFT LoRA directory (serving/engine/lora.py): what it reads, and each refusal by name (a
pickle-only directory, unknown target modules, rank over a limit, shapes of another base, DoRA and
friends); the grouped per-adapter update against one computed row by row (lora_batch.py); and a
property test that the prefix cache never shares a block across adapters (kv_cache.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from serving.engine.kv_cache import KVCacheManager
from serving.engine.lora import AdapterError, check_adapter_fits, read_adapter
from serving.engine.lora_batch import LoraStep, SiteWeights
from serving.engine.sequence import Sequence
from tests.serving.engine.lora_models import AdapterSpec, save_adapter


def _config(**overrides: Any) -> LlamaConfig:
    fields: dict[str, Any] = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        **overrides,
    }
    return LlamaConfig(**fields)


def _base(**overrides: Any) -> Any:
    torch.manual_seed(0)
    return LlamaForCausalLM(_config(**overrides)).eval()


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("adapter")
    save_adapter(_base(), AdapterSpec("a", rank=4, alpha=12, seed=1), path)
    return path


def _copy(adapter_dir: Path, tmp_path: Path, **config_changes: Any) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(adapter_dir, out)
    if config_changes:
        config = json.loads((out / "adapter_config.json").read_text())
        config.update(config_changes)
        (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def test_an_adapter_is_read_with_its_rank_scaling_and_every_layers_weights(adapter_dir: Path) -> None:
    config = _config()
    adapter = read_adapter(adapter_dir, "tenant/a:1", config)
    assert (adapter.adapter_id, adapter.rank, adapter.scaling) == ("tenant/a:1", 4, 3.0)
    assert len(adapter.target_modules) == 7 and len(adapter.layers) == 2
    pair = adapter.layers[1]["k_proj"]
    assert tuple(pair.a.shape) == (4, 32) and tuple(pair.b.shape) == (16, 4)
    assert pair.b.abs().sum() > 0
    # The base's config.json as a mapping reads the same.
    assert read_adapter(adapter_dir, "x", config.to_dict()).rank == 4


def test_rslora_scales_by_alpha_over_the_root_of_the_rank(adapter_dir: Path, tmp_path: Path) -> None:
    adapter = read_adapter(_copy(adapter_dir, tmp_path, use_rslora=True), "a", _config())
    assert adapter.scaling == pytest.approx(12 / 2)


def test_a_pickle_only_directory_is_refused(adapter_dir: Path, tmp_path: Path) -> None:
    copy = _copy(adapter_dir, tmp_path)
    (copy / "adapter_model.safetensors").rename(copy / "adapter_model.bin")
    with pytest.raises(AdapterError, match=r"no adapter_model.safetensors \(found adapter_model.bin"):
        read_adapter(copy, "a", _config())


def test_unknown_target_modules_are_refused_by_name(tmp_path: Path) -> None:
    save_adapter(_base(), AdapterSpec("a", rank=2, targets=("q_proj", "lm_head")), tmp_path)
    with pytest.raises(AdapterError, match="target modules lm_head are not served"):
        read_adapter(tmp_path, "a", _config())


def test_a_rank_over_the_limit_is_refused(adapter_dir: Path) -> None:
    with pytest.raises(AdapterError, match="rank 4 is over the limit of 2"):
        read_adapter(adapter_dir, "a", _config(), max_rank=2)
    adapter = read_adapter(adapter_dir, "a", _config())
    with pytest.raises(AdapterError, match="over this engine's limit of 3"):
        check_adapter_fits(adapter, _config(), max_rank=3)


def test_shapes_of_another_base_are_refused(adapter_dir: Path) -> None:
    with pytest.raises(AdapterError, match="do not fit the base"):
        read_adapter(adapter_dir, "a", _config(intermediate_size=64))
    with pytest.raises(AdapterError, match="the base has 1 layers"):
        read_adapter(adapter_dir, "a", _config(num_hidden_layers=1))
    adapter = read_adapter(adapter_dir, "a", _config())
    with pytest.raises(
        AdapterError, match="layer 0 down_proj is 48 -> 48 in the model, 48 -> 32 in the adapter"
    ):
        check_adapter_fits(adapter, _config(hidden_size=48, intermediate_size=48), max_rank=64)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "bias='all'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        ({"peft_type": "IA3"}, "only LoRA adapters"),
        ({"target_modules": ".*proj"}, "target modules .*proj are not served"),
    ],
)
def test_what_changes_the_arithmetic_is_refused_by_name(
    adapter_dir: Path, tmp_path: Path, change: dict[str, Any], named: str
) -> None:
    with pytest.raises(AdapterError, match=named.replace("(", r"\(").replace("*", r"\*")):
        read_adapter(_copy(adapter_dir, tmp_path, **change), "a", _config())


def test_a_missing_or_broken_config_is_refused(adapter_dir: Path, tmp_path: Path) -> None:
    copy = _copy(adapter_dir, tmp_path)
    (copy / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="not JSON"):
        read_adapter(copy, "a", _config())
    (copy / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match=r"no adapter_config\.json"):
        read_adapter(copy, "a", _config())


# --- the grouped update ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "order",
    [
        [None, 0, 1, 0, None, 2],  # interleaved: gathered by adapter, added back by index
        [None, 0, 0, 1, None, 2],  # each adapter's rows side by side (as the engine orders them): in place
    ],
)
def test_the_grouped_update_equals_each_rows_own_adapter_applied_alone(order: list[int | None]) -> None:
    torch.manual_seed(0)
    num_in, num_out, split = 12, 10, 6  # a site of two targets: columns 0:6 and 6:10

    def weights(rank: int, targets: int) -> tuple[tuple[SiteWeights | None, ...], ...]:
        """One layer, one site: `targets` 2 (both), 1 (the first only) or 0 (neither)."""
        if not targets:
            return ((None,),)
        parts = ((0, split), (split, num_out))[:targets]
        b = tuple((s, e, torch.randn(rank, e - s)) for s, e in parts)
        uncovered = ((split, num_out),) if targets == 1 else ()
        return ((SiteWeights(torch.randn(num_in, rank * targets), rank, b, uncovered),),)

    def dense(w: tuple[tuple[SiteWeights | None, ...], ...]) -> torch.Tensor:
        """The site's update as one [in, out] matrix."""
        site = w[0][0]
        full = torch.zeros(num_in, num_out)
        if site is not None:
            for index, (s, e, b) in enumerate(site.b):
                full[:, s:e] = site.a[:, index * site.rank : (index + 1) * site.rank] @ b
        return full

    adapters = [weights(2, 2), weights(3, 1), weights(4, 0)]
    # Adapter 2 has no weights at this site.
    seq_weights = [None if i is None else adapters[i] for i in order]
    query_lens = np.array([3, 1, 4, 2, 1, 2])
    x = torch.randn(int(query_lens.sum()), num_in)
    out = torch.randn(len(x), num_out)
    expected = out.clone()
    rows = np.repeat(np.arange(len(seq_weights)), query_lens)
    for row, seq in enumerate(rows.tolist()):
        w = seq_weights[seq]
        if w is not None:
            expected[row] += x[row] @ dense(w)
    step = LoraStep(seq_weights, query_lens, torch.device("cpu"))
    step.add(out, x, 0, 0)
    torch.testing.assert_close(out, expected)
    # Every row one adapter's: added in place without a gather.
    only = LoraStep([adapters[1]], np.array([5]), torch.device("cpu"))
    y, x5 = torch.zeros(5, num_out), torch.randn(5, num_in)
    only.add(y, x5, 0, 0)
    torch.testing.assert_close(y, x5 @ dense(adapters[1]))


# --- the prefix cache ------------------------------------------------------------------------------

BLOCK = 2
PROMPTS = ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9], [1, 2, 7, 7])


@settings(max_examples=60, deadline=None)
@given(
    admissions=st.lists(
        st.tuples(
            st.sampled_from(PROMPTS),
            st.sampled_from([None, "a", "b"]),
            st.sampled_from(["t1", "t2"]),
            st.booleans(),  # freed after it computed its prompt
        ),
        max_size=12,
    )
)
def test_the_prefix_cache_never_shares_a_block_across_adapters(
    admissions: list[tuple[list[int], str | None, str, bool]],
) -> None:
    kv = KVCacheManager(24, BLOCK, salt_secret=b"test")
    live: list[Sequence] = []
    contents: dict[int, tuple[str, str | None, tuple[int, ...]]] = {}  # block -> what computed it
    for index, (prompt, adapter_id, tenant, freed) in enumerate(admissions):
        seq = Sequence(f"r{index}", list(prompt), tenant_id=tenant, adapter_id=adapter_id)
        prefix = kv.match_prefix(seq)
        for position, block_id in enumerate(prefix.block_ids):
            # A hit is what this sequence would have computed itself: same tenant, adapter and tokens.
            assert contents[block_id] == (tenant, adapter_id, tuple(prompt[: (position + 1) * BLOCK]))
        num_new = len(prompt) - prefix.num_tokens
        if not kv.can_allocate(seq, num_new, prefix):
            continue
        kv.allocate(seq, num_new, prefix)
        seq.num_computed_tokens = len(prompt)
        kv.commit_computed(seq)
        for position in range(prefix.num_tokens // BLOCK, len(prompt) // BLOCK):
            contents[seq.block_table[position]] = (
                tenant,
                adapter_id,
                tuple(prompt[: (position + 1) * BLOCK]),
            )
        if freed:
            kv.free(seq)
        else:
            live.append(seq)
        kv.check_invariants(live)
