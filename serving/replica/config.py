"""A replica's engine configuration, from settings (SWITCHYARD_REPLICA_* and the CPU/GPU defaults)."""

from __future__ import annotations

from typing import Any

from django.conf import settings


def engine_config_from_settings() -> Any:
    # Deferred: the runtime, which every web process imports (a gateway-only one too), imports this
    # module; the engine brings torch, which only a process that hosts a replica may load.
    from serving.engine.engine import EngineConfig

    return EngineConfig(
        max_num_seqs=settings.REPLICA_MAX_NUM_SEQS,
        max_num_batched_tokens=settings.REPLICA_MAX_NUM_BATCHED_TOKENS,
        kv_cache_bytes=settings.REPLICA_KV_CACHE_BYTES,  # None: sized from the device (the engine)
        gpu_memory_fraction=settings.REPLICA_GPU_MEMORY_FRACTION,
        cpu_memory_fraction=settings.REPLICA_CPU_MEMORY_FRACTION,
        compile=settings.REPLICA_COMPILE,
        pack_linear=settings.REPLICA_PACK_LINEAR,
        forward=settings.REPLICA_FORWARD,
        attention=settings.REPLICA_ATTENTION,
        max_running_per_tenant=settings.REPLICA_MAX_RUNNING_PER_TENANT,
        max_kv_share_per_tenant=settings.REPLICA_MAX_KV_SHARE_PER_TENANT,
        tier_aging_s=settings.REPLICA_TIER_AGING_S,
        max_loras=settings.REPLICA_MAX_LORAS,
        max_lora_rank=settings.REPLICA_MAX_LORA_RANK,
    )


def encoder_config_from_settings(*, device: str | None = None) -> Any:
    # Deferred, as in engine_config_from_settings: the engine brings torch.
    from serving.engine.encoder import EncoderConfig

    return EncoderConfig(
        max_batch_size=settings.REPLICA_EMBED_MAX_BATCH_SIZE,
        max_wait_s=settings.REPLICA_EMBED_MAX_WAIT_S,
        device=device,
    )
