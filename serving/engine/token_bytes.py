"""A vocabulary entry's own bytes, as it adds them to a text in the middle of a sequence: what OpenAI's
logprobs call a token's `bytes` and `token`.

Decoding a token alone does not give them. A SentencePiece tokenizer (Llama's, stories260k's) strips
the space its "▁" stands for at the start of a text, so " Once" reads "Once" alone; a byte-level or
byte-fallback token holding part of a UTF-8 character reads U+FFFD, and its bytes are lost. Those are
exactly the tokens a client needs `bytes` for. So the bytes are read from the token's piece in the
vocabulary, by the rules of the tokenizer's own decoder, where that decoder is one of the kinds
described here; for any other kind the token decoded alone is the best there is (as before)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# Decoders that map pieces to text one piece at a time, whose rules piece_reader() applies.
_PIECEWISE = {"ByteLevel", "ByteFallback", "Replace", "Metaspace", "Fuse", "Strip"}


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character to byte: bytes that print stand for themselves, and
    the rest (controls, space, a few Latin-1 ones) take the characters from U+0100 on, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    alphabet = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            alphabet[chr(256 + shifted)] = b
            shifted += 1
    return alphabet


def _decoder_steps(tokenizer: Any) -> list[dict[str, Any]] | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast (Rust) tokenizer's
    if backend is None:
        return None
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    steps: list[dict[str, Any]] = (
        decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    )
    if not steps or any(step.get("type") not in _PIECEWISE for step in steps):
        return None
    if any(step["type"] == "Replace" and "String" not in (step.get("pattern") or {}) for step in steps):
        return None  # a regular expression: it may match across pieces
    return steps


def piece_reader(tokenizer: Any) -> Callable[[str], bytes | None] | None:
    """A function from a vocabulary piece to its bytes (None for a piece it cannot read), or None when
    the tokenizer's decoder is not of a kind it knows."""
    steps = _decoder_steps(tokenizer)
    if steps is None:
        return None
    kinds = {step["type"] for step in steps}
    if "ByteLevel" in kinds:
        alphabet = byte_level_alphabet()

        def read_byte_level(piece: str) -> bytes | None:
            try:
                return bytes(alphabet[c] for c in piece)
            except KeyError:  # an added token outside the alphabet: decode it alone
                return None

        return read_byte_level
    replacements: list[tuple[str, str]] = []
    for step in steps:
        if step["type"] == "Replace":
            replacements.append((step["pattern"]["String"], step.get("content", "")))
        elif step["type"] == "Metaspace":
            replacements.append((step.get("replacement", "▁"), " "))
    byte_fallback = "ByteFallback" in kinds

    def read(piece: str) -> bytes:
        if byte_fallback and (match := _BYTE_PIECE.fullmatch(piece)):
            return bytes([int(match[1], 16)])
        for old, new in replacements:
            piece = piece.replace(old, new)
        return piece.encode()

    return read


def token_bytes_reader(tokenizer: Any) -> Callable[[int], bytes]:
    """A function from a token id to its bytes. A special token (end of sequence, …) adds nothing to
    the text, so it has none, as skip_special_tokens decodes it."""
    read_piece = piece_reader(tokenizer)
    # The special-tokens map, and added tokens marked special outside it (Llama 3's <|eot_id|>): both
    # are what skip_special_tokens leaves out.
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special = frozenset(getattr(tokenizer, "all_special_ids", ())) | {
        token_id for token_id, token in added.items() if getattr(token, "special", False)
    }

    def read(token_id: int) -> bytes:
        if token_id in special:
            return b""
        if read_piece is not None:
            piece = tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and (raw := read_piece(piece)) is not None:
                return raw
        return str(tokenizer.decode([token_id], skip_special_tokens=True)).encode()

    return read
