"""Building a replica's engine: the artifact's digests checked, the model loaded under the process's model
lock, and the engine warmed up before the replica reports ready."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from django.conf import settings

from registry import artifacts
from registry.models import Model
from registry.selectors import VersionRef
from serving.replica.config import encoder_config_from_settings, engine_config_from_settings

logger = logging.getLogger(__name__)


def load_engine(ref: VersionRef, *, engine_config: Any, torch_threads: int | None) -> Any:
    """The version's engine, warm: an Engine for a causal LM, an EncoderEngine for the others.
    `engine_config` None: from settings; `torch_threads` None: torch's default (every core)."""
    # Deferred: the runtime, which every web process imports (a gateway-only one too), imports the
    # replica; the engine brings torch, which only a process that hosts a replica may load.
    from serving.engine.loading import MODEL_LOAD_LOCK

    if torch_threads is not None:
        import torch

        torch.set_num_threads(torch_threads)  # process-wide: every replica here shares it
    if settings.REPLICA_GIL_SWITCH_INTERVAL_S:
        # The engine thread runs Python between torch calls (scheduling, sampling, detokenizing) while
        # the event loop thread waits to accept requests and send tokens; by default it may wait up to
        # 5 ms for the GIL each time. Process-wide.
        sys.setswitchinterval(settings.REPLICA_GIL_SWITCH_INTERVAL_S)
    path = Path(ref.artifact_uri)
    artifacts.verify(path, expected_files=ref.files, expected_sha256=ref.sha256)
    # transformers' lazy module imports are not thread-safe, and an embedded server loads its replicas
    # in threads: a generative engine registering its attention while an embedding model was being built
    # failed to find transformers' own AttentionInterface. Engines are built one at a time; their
    # warm-ups, below, overlap.
    with MODEL_LOAD_LOCK:
        # Deferred, as MODEL_LOAD_LOCK above: the engine brings torch.
        from serving.engine.encoder import EncoderConfig, EncoderEngine
        from serving.engine.engine import Engine

        engine: Any
        if ref.kind != Model.Kind.CAUSAL_LM:
            config = engine_config
            if not isinstance(config, EncoderConfig):
                # run_replica's flags come as a generative EngineConfig: its sizing says nothing of
                # batching, but the device it names is where this model must go too.
                config = encoder_config_from_settings(device=getattr(config, "device", None))
            engine = EncoderEngine(path, kind=ref.kind, config=config)
        else:
            engine = Engine(path, config=engine_config or engine_config_from_settings())
    if isinstance(engine, Engine):  # its forward, attention and Linear layers, and why not the others
        logger.info("replica %s:%s: %s", ref.model_name, ref.version, engine.runner.describe())
    elif isinstance(engine, EncoderEngine):
        logger.info("replica %s:%s: %s", ref.model_name, ref.version, engine.head.describe())
    engine.warmup()  # allocate scratch and (if enabled) compile before reporting ready
    if isinstance(engine, Engine):
        # response_format's view of the tokenizer (0.2-1 s for a large vocabulary), built now: the first
        # structured request would otherwise build it on the preparing thread, every arrival behind it.
        try:
            engine.grammars.tokenizer()
        except ValueError as exc:  # GrammarError: structured outputs will be refused, the rest is served
            logger.warning("replica %s:%s: %s", ref.model_name, ref.version, exc)
    return engine


def engine_capacity(engine: Any) -> int:
    """What the autoscaler reads as full: a generative engine's running batch, an encoder's batch."""
    config = engine.config
    return int(config.max_num_seqs if hasattr(config, "max_num_seqs") else config.max_batch_size)
