"""The demo models are built on each machine, not downloaded: two builds of one must be the same model,
or a test's expectations (and a user's embeddings) change from one checkout to the next."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from serving.engine.demo_model import WORDPIECE_SPECIALS, build_wordpiece_tokenizer

REPO = Path(__file__).resolve().parents[3]

_PRINT_VOCAB = (
    "import json; from serving.engine.demo_model import build_wordpiece_tokenizer; "
    "print(json.dumps(build_wordpiece_tokenizer(1024).get_vocab(), sort_keys=True))"
)


def _vocab_in_a_process(hash_seed: str) -> dict[str, int]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run(
        [sys.executable, "-c", _PRINT_VOCAB], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    return dict(json.loads(done.stdout))


def test_the_demo_berts_tokenizer_numbers_its_tokens_alike_in_every_process() -> None:
    """The tokenizers library's WordPiece trainer numbered tokens of equal count in another order in each
    process, so the same text met other embedding rows in each build of the demo embedding model."""
    first, second = _vocab_in_a_process("1"), _vocab_in_a_process("2")
    assert first == second
    assert first == build_wordpiece_tokenizer(1024).get_vocab()  # type: ignore[attr-defined]


def test_the_demo_berts_tokenizer_spells_every_word_it_was_not_given_whole() -> None:
    tokenizer = build_wordpiece_tokenizer(64)
    vocab = tokenizer.get_vocab()  # type: ignore[attr-defined]
    # A budget this small holds the special tokens and the alphabet (both forms), no whole word.
    assert all(token in WORDPIECE_SPECIALS or len(token.removeprefix("##")) == 1 for token in vocab)
    ids = tokenizer("Zebras quietly explained", add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    assert vocab["[UNK]"] not in ids
    assert tokenizer.decode(ids) == "zebras quietly explained"  # type: ignore[attr-defined]
