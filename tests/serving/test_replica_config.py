"""A replica's engine is configured from settings (the SWITCHYARD_* environment variables)."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.engine.engine import Engine
from serving.engine.packing import PackedLinear
from serving.replica import engine_config_from_settings


@pytest.mark.parametrize("pack", [True, False])
def test_onednn_packing_of_a_replicas_linear_layers_follows_the_setting(
    pack: bool, settings, demo_model_dir: Path
) -> None:
    settings.REPLICA_PACK_LINEAR = pack  # SWITCHYARD_PACK_LINEAR: slower than plain layers on some CPUs
    settings.REPLICA_KV_CACHE_BYTES = 8 << 20
    engine = Engine(demo_model_dir, config=engine_config_from_settings())
    packed = [m for m in engine.runner.model.modules() if isinstance(m, PackedLinear)]
    assert bool(packed) is pack
