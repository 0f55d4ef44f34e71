"""Chat messages to prompt ids: the tokenizer's template, or the plain default."""

from __future__ import annotations

from typing import Any

import pytest

from serving.engine.chat import encode_chat_prompt
from serving.engine.demo_model import BOS, build_tokenizer
from serving.engine.loading import prompt_encoder

MESSAGES = [{"role": "user", "content": "once upon a time"}]


@pytest.fixture(scope="module")
def adds_bos() -> Any:
    """A tokenizer that adds BOS to every plain call, as Llama's and Mistral's do."""
    from tokenizers import processors

    tokenizer: Any = build_tokenizer(256)
    bos_id = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, bos_id)]
    )
    assert tokenizer("hi")["input_ids"][0] == bos_id
    return tokenizer


def test_a_template_that_writes_its_own_bos_gets_one_not_two(adds_bos: Any) -> None:
    adds_bos.chat_template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    )
    ids = encode_chat_prompt(adds_bos, MESSAGES, prompt_encoder(adds_bos))
    bos_id = adds_bos.bos_token_id
    assert ids[0] == bos_id and ids[1] != bos_id
    templated = adds_bos.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    assert ids == list(getattr(templated, "input_ids", templated))  # transformers' own tokenizing


def test_a_template_without_bos_and_the_plain_default_keep_the_tokenizers(adds_bos: Any) -> None:
    bos_id = adds_bos.bos_token_id
    adds_bos.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    assert encode_chat_prompt(adds_bos, MESSAGES, prompt_encoder(adds_bos))[:2] != [bos_id, bos_id]
    assert encode_chat_prompt(adds_bos, MESSAGES, prompt_encoder(adds_bos))[0] == bos_id
    adds_bos.chat_template = None
    ids = encode_chat_prompt(adds_bos, MESSAGES, prompt_encoder(adds_bos))
    assert ids[0] == bos_id and ids[1] != bos_id
