"""Models for the runner tests: a tiny random Llama built here, and the pretrained stories260k when the
shared models directory (or SWITCHYARD_STORIES_DIR) has it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 layers, 4 query heads over 2 KV heads (GQA), vocab 256, saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        # Larger than the default 0.02 so that next-token logits are far from ties: argmax comparisons
        # against generate() then test the attention, not float rounding.
        initializer_range=0.3,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)  # safetensors
    return path


# The root conftest's autouse fixtures reset Django-side state (settings, gateway caches, the in-process
# runtime). The engine imports nothing from Django, so its tests override them by name with no-ops and
# run without Django settings (and with `-p no:django`).
@pytest.fixture(autouse=True)
def _isolated_state() -> None:
    pass


@pytest.fixture(autouse=True)
def _stop_runtime() -> None:
    pass


@pytest.fixture(scope="session", autouse=True)
def _drop_thread_connections() -> None:
    pass
