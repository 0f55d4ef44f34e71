"""A replica's engine is configured from settings (the SWITCHYARD_* environment variables), and in a
replica process from run_replica's flags over them."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.engine.engine import Engine
from serving.management.commands.run_replica import engine_config_from_options
from serving.replica.config import engine_config_from_settings


@pytest.mark.parametrize("pack", [True, False, None])
def test_onednn_packing_of_a_replicas_linear_layers_follows_the_setting(
    pack: bool | None, settings, demo_model_dir: Path
) -> None:
    settings.REPLICA_PACK_LINEAR = pack  # SWITCHYARD_PACK_LINEAR: slower than plain layers on some CPUs
    settings.REPLICA_KV_CACHE_BYTES = 8 << 20
    engine = Engine(demo_model_dir, config=engine_config_from_settings())
    packed = engine.runner.num_packed_linears > 0  # the fused forward's weights, or PackedLinear modules
    if pack is None:  # "auto": timed at load, and packed only if that said it pays
        assert engine.runner.packing is not None
        assert bool(packed) is engine.runner.packing.pack
    else:
        assert engine.runner.packing is None
        assert bool(packed) is pack


@pytest.mark.parametrize(("forward", "attention"), [("generic", "gather"), ("auto", "auto")])
def test_a_replicas_forward_and_attention_follow_the_settings(
    forward: str, attention: str, settings, demo_model_dir: Path
) -> None:
    settings.REPLICA_FORWARD = forward  # SWITCHYARD_FORWARD
    settings.REPLICA_ATTENTION = attention  # SWITCHYARD_ATTENTION
    settings.REPLICA_KV_CACHE_BYTES = 8 << 20
    runner = Engine(demo_model_dir, config=engine_config_from_settings()).runner
    assert (runner.fused is not None) is (forward == "auto")  # the demo model is a Llama
    assert (runner.kernel is not None) is (attention == "auto")
    if forward == "generic":
        assert "generic forward asked for" in runner.describe()


@pytest.mark.parametrize("pack", [False, None])
def test_run_replica_takes_its_flags_over_the_settings_and_the_rest_from_them(
    pack: bool | None, settings
) -> None:
    settings.REPLICA_PACK_LINEAR = pack
    settings.REPLICA_MAX_NUM_SEQS = 64
    options = {
        "max_num_seqs": 3,
        "max_num_batched_tokens": 96,
        "kv_cache_mb": 2,
        "compile": False,
        "device": "cpu",
    }
    config = engine_config_from_options(options)
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.kv_cache_bytes) == (3, 96, 2 << 20)
    assert config.device == "cpu"
    assert config.pack_linear is pack  # before, run_replica always packed, whatever the setting said


@pytest.mark.django_db(transaction=True)
def test_an_embedding_replica_process_takes_run_replicas_device(
    demo_embedding_model_dir: Path, settings
) -> None:
    from registry.models import Model
    from registry.selectors import version_ref
    from registry.services import model_version_register
    from serving.replica.replica import Replica

    model_version_register(
        name="embed", version="v1", source_dir=demo_embedding_model_dir, kind=Model.Kind.EMBEDDING
    )
    settings.REPLICA_EMBED_MAX_BATCH_SIZE = 3
    options = {"max_num_seqs": 3, "max_num_batched_tokens": 96, "kv_cache_mb": 2, "compile": False}
    ref = version_ref(model_name="embed", version="v1")
    replica = Replica(ref, layer=None, engine_config=engine_config_from_options({**options, "device": "cpu"}))
    engine = replica._load()
    # --device reaches the encoder engine; its batching comes from the settings, not the KV sizing flags
    assert (engine.config.device, engine.config.max_batch_size) == ("cpu", 3)


def test_per_tenant_caps_reach_the_scheduler_and_a_tenant_stays_within_its_share(
    settings, demo_model_dir: Path
) -> None:
    from serving.engine.sequence import SamplingParams

    settings.REPLICA_KV_CACHE_BYTES = 8 << 20
    settings.REPLICA_MAX_RUNNING_PER_TENANT = 2
    settings.REPLICA_MAX_KV_SHARE_PER_TENANT = 0.25
    engine = Engine(demo_model_dir, config=engine_config_from_settings())
    cap = engine.scheduler.config.max_blocks_per_tenant
    assert engine.scheduler.config.max_running_per_tenant == 2
    assert cap == int(0.25 * engine.runner.num_blocks)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    for i in range(4):
        engine.add_request(f"greedy-{i}", engine.encode("hello there " * 8), params, tenant_id="greedy")
    engine.add_request("other", engine.encode("hello"), params, tenant_id="other")
    engine.step()
    running = engine.scheduler.running_seqs()
    by_tenant = [s.tenant_id for s in running]
    assert by_tenant.count("greedy") == 2 and "other" in by_tenant  # the other tenant is not starved
    assert sum(len(s.block_table) for s in running if s.tenant_id == "greedy") <= cap
    settings.REPLICA_MAX_KV_SHARE_PER_TENANT = 1.5
    with pytest.raises(ValueError, match="max_kv_share_per_tenant"):
        Engine(demo_model_dir, config=engine_config_from_settings())


def test_unset_the_kv_cache_takes_a_share_of_free_gpu_memory_or_of_available_host_memory(
    settings, monkeypatch
) -> None:
    """As vLLM's gpu_memory_utilization: a fixed 128 MiB would hold a few hundred tokens of a 7B model.
    The GPU is a boundary this machine has none of: its free-memory query is stood in for."""
    import torch

    from serving.engine import kv_budget
    from serving.engine.engine import _kv_cache_bytes

    settings.REPLICA_KV_CACHE_BYTES = None  # SWITCHYARD_KV_CACHE_MB unset
    settings.REPLICA_GPU_MEMORY_FRACTION = 0.9
    settings.REPLICA_CPU_MEMORY_FRACTION = 0.25
    config = engine_config_from_settings()
    assert (config.kv_cache_bytes, config.gpu_memory_fraction, config.cpu_memory_fraction) == (
        None,
        0.9,
        0.25,
    )
    monkeypatch.setattr(kv_budget, "available_host_memory_bytes", lambda: 16 << 30)
    assert _kv_cache_bytes(config, torch.device("cpu"), 64 << 30) == 4 << 30
    assert _kv_cache_bytes(config, torch.device("cpu"), 1 << 30) == 1 << 30  # all the engine could fill
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 << 30, 141 << 30))  # free, total
    assert _kv_cache_bytes(config, torch.device("cuda", 0), 64 << 30) == int(0.9 * (60 << 30))
    # run_replica without --kv-cache-mb keeps that; with it, the flag's size
    flags = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "compile": False, "device": "cuda:0"}
    assert engine_config_from_options({**flags, "kv_cache_mb": None}).kv_cache_bytes is None
    assert engine_config_from_options({**flags, "kv_cache_mb": 64}).kv_cache_bytes == 64 << 20


def test_the_kv_cache_is_sized_once_the_weights_hold_their_memory(demo_model_dir: Path, monkeypatch) -> None:
    """Free GPU memory read before the weights load would give the cache what the weights then need."""
    from serving.engine import runner as runner_module

    order: list[str] = []
    load = runner_module.load_causal_lm

    def loading(*args, **kwargs):  # type: ignore[no-untyped-def]
        model = load(*args, **kwargs)
        order.append("weights loaded")
        return model

    def size(device, max_useful_bytes) -> int:  # type: ignore[no-untyped-def]
        order.append(f"cache sized on {device.type}")
        return 4 << 20

    monkeypatch.setattr(runner_module, "load_causal_lm", loading)
    runner = runner_module.ModelRunner(
        demo_model_dir, device="cpu", kv_cache_bytes=size, max_num_seqs=4, max_num_batched_tokens=64
    )
    assert order == ["weights loaded", "cache sized on cpu"]
    assert runner.num_blocks == (4 << 20) // runner.bytes_per_block
