"""The prompt encoder: the Rust tokenizer called directly gives exactly the ids that transformers' wrapper
gives, and the wrapper stays where the two could differ."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.engine.loading import load_tokenizer, prompt_encoder

# Any text at all: every Unicode category, the special tokens' own strings spliced in.
_TEXTS = st.text(max_size=300) | st.lists(
    st.sampled_from(["<s>", "</s>", "<unk>", "<pad>", " ", "\n", "a", "é", "🙂", "the", "  x"]), max_size=40
).map("".join)


def _wrapper_ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text)["input_ids"])


@pytest.fixture(scope="module", params=["demo_model_dir", "stories_dir"])
def tokenizer_and_encoder(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    tokenizer = load_tokenizer(request.getfixturevalue(request.param))
    return tokenizer, prompt_encoder(tokenizer)


@settings(max_examples=300, deadline=None)
@given(text=_TEXTS)
def test_the_direct_encoder_gives_the_wrappers_ids_for_any_text(
    tokenizer_and_encoder: tuple[Any, Any], text: str
) -> None:
    tokenizer, encode = tokenizer_and_encoder
    assert encode.__name__ == "direct"  # the fast path is the one under test
    assert encode(text) == _wrapper_ids(tokenizer, text)


def test_a_prompt_does_not_go_through_the_wrapper(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = load_tokenizer(demo_model_dir)
    encode = prompt_encoder(tokenizer)
    expected = _wrapper_ids(tokenizer, "the quick brown fox")

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the wrapper was called")

    monkeypatch.setattr(type(tokenizer), "__call__", refuse)
    assert encode("the quick brown fox") == expected


def test_a_truncating_call_elsewhere_does_not_cut_later_prompts_short(demo_model_dir: Path) -> None:
    """transformers' wrapper leaves the Rust tokenizer set as its last call asked (truncation, padding,
    split special tokens); the direct encoder must not inherit that."""
    tokenizer = load_tokenizer(demo_model_dir)
    encode = prompt_encoder(tokenizer)
    text = "one two three four five six seven eight </s> nine"
    whole = encode(text)
    tokenizer(text, truncation=True, max_length=3)
    assert encode(text) == whole
    tokenizer(text, split_special_tokens=True)
    assert encode(text) == whole
    assert len(whole) > 3


def test_the_engine_encodes_prompts_with_it(demo_model_dir: Path) -> None:
    from serving.engine.engine import Engine, EngineConfig

    engine = Engine(demo_model_dir, config=EngineConfig(kv_cache_bytes=1 << 20, device="cpu", max_num_seqs=2))
    assert engine.encode("the quick brown fox") == _wrapper_ids(engine.tokenizer, "the quick brown fox")
    assert engine._encode.__name__ == "direct"


def test_a_tokenizer_that_truncates_on_its_own_still_encodes_whole_prompts(demo_model_dir: Path) -> None:
    """A tokenizer.json may configure truncation; the wrapper switches it off for a call that does not
    ask for it, and a prompt must come out whole either way."""
    tokenizer = load_tokenizer(demo_model_dir)
    full = _wrapper_ids(load_tokenizer(demo_model_dir), "one two three four five six seven eight")
    tokenizer.backend_tokenizer.enable_truncation(max_length=3)
    assert prompt_encoder(tokenizer)("one two three four five six seven eight") == full
    assert len(full) > 3


def test_a_wrapper_that_adds_ids_of_its_own_is_kept(demo_model_dir: Path) -> None:
    real = load_tokenizer(demo_model_dir)

    class PrefixingTokenizer:
        """A wrapper doing in Python what the Rust tokenizer does not (a BOS added outside it, say)."""

        backend_tokenizer = real.backend_tokenizer
        all_special_tokens = real.all_special_tokens

        def __call__(self, text: str) -> dict[str, list[int]]:
            return {"input_ids": [7, *real(text)["input_ids"]]}

    assert prompt_encoder(PrefixingTokenizer())("hello") == [7, *_wrapper_ids(real, "hello")]
