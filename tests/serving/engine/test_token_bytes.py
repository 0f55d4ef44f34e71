"""Each token's bytes, as logprobs report them: what the token adds to a text in the middle of a sequence,
checked against the tokenizer's own decoding in context, for a byte-level BPE tokenizer (the demo
model's) and a SentencePiece one with byte fallback (stories260k's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.engine.loading import load_tokenizer
from serving.engine.token_bytes import byte_level_alphabet, piece_reader, token_bytes_reader

_CONTEXT = "Once upon a time, there was"


@pytest.fixture(scope="module", params=["demo_model_dir", "stories_dir"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    return load_tokenizer(request.getfixturevalue(request.param))


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=True))


def test_every_tokens_bytes_are_what_it_adds_to_a_text(tokenizer: Any) -> None:
    """In context, not alone: alone, SentencePiece drops the space of "▁Once" and a piece of a
    character reads U+FFFD. A token whose addition is whole characters adds exactly its bytes; one that
    holds part of a character (the text shows U+FFFD) has bytes that are not UTF-8 on their own."""
    read = token_bytes_reader(tokenizer)
    context = tokenizer.encode(_CONTEXT, add_special_tokens=False)
    before = _decode(tokenizer, context)
    num_partial = 0
    for token_id in range(min(len(tokenizer), 4096)):
        added = _decode(tokenizer, [*context, token_id])[len(before) :]
        if "\ufffd" in added:
            num_partial += 1
            with pytest.raises(UnicodeDecodeError):
                read(token_id).decode()
        else:
            assert read(token_id) == added.encode(), (token_id, tokenizer.convert_ids_to_tokens(token_id))
    assert num_partial > 0  # both vocabularies hold pieces of characters: the case this is for


def test_a_leading_space_is_kept_where_decoding_alone_drops_it(stories_dir: Path) -> None:
    tokenizer = load_tokenizer(stories_dir)
    read = token_bytes_reader(tokenizer)
    (once,) = [t for t in tokenizer.encode("Once", add_special_tokens=False) if _decode(tokenizer, [t])]
    assert tokenizer.convert_ids_to_tokens(once).startswith("\u2581")
    assert _decode(tokenizer, [once]) == "Once" and read(once) == b" Once"


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=80))
def test_a_texts_tokens_bytes_join_to_the_text(tokenizer: Any, text: str) -> None:
    """Any text, accents, emoji and controls included: its tokens' bytes are its own UTF-8, as the
    tokenizer decodes it after a context (SentencePiece adds a space at the start, and keeps it there)."""
    read = token_bytes_reader(tokenizer)
    context = tokenizer.encode(_CONTEXT, add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = _decode(tokenizer, context + ids)[len(_decode(tokenizer, context)) :]
    assert b"".join(read(t) for t in ids).decode() == expected


def test_special_tokens_add_nothing(tokenizer: Any) -> None:
    read = token_bytes_reader(tokenizer)
    assert tokenizer.all_special_ids
    assert all(read(t) == b"" for t in tokenizer.all_special_ids)


def test_the_byte_level_alphabet_is_one_character_per_byte() -> None:
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["A"] == ord("A") and alphabet["\u0120"] == ord(" ")  # "Ġ", GPT-2's space


def test_an_added_token_marked_special_adds_nothing(demo_model_dir: Path) -> None:
    """Outside the special-tokens map (as Llama 3's <|eot_id|> is), skip_special_tokens still drops it."""
    tokenizer = load_tokenizer(demo_model_dir)
    tokenizer.add_tokens(["<|eot|>"], special_tokens=True)
    (eot,) = tokenizer.convert_tokens_to_ids(["<|eot|>"])
    assert eot not in tokenizer.all_special_ids and _decode(tokenizer, [eot]) == ""
    assert token_bytes_reader(tokenizer)(eot) == b""


def test_a_decoder_it_cannot_apply_piece_by_piece_falls_back_to_decoding_alone() -> None:
    from tokenizers import Regex, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"a_b": 0, "[UNK]": 1}, unk_token="[UNK]"))
    backend.decoder = decoders.Replace(Regex("_+"), " ")  # a pattern, not a string: it may span pieces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert piece_reader(tokenizer) is None
    assert token_bytes_reader(tokenizer)(0) == _decode(tokenizer, [0]).encode() == b"a b"
