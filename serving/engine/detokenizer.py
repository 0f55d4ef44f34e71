"""Incremental detokenisation: turn a growing list of token ids into text deltas.

Byte-level and byte-fallback tokenizers can split one UTF-8 character over several tokens; decoding
each token alone would emit U+FFFD. We decode a small window of recent tokens and emit only the text
that is complete, holding back a trailing replacement character until the next token finishes it.
"""

from __future__ import annotations

from typing import Any, Protocol


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> Any: ...


_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int] | None = None) -> None:
        self._tokenizer = tokenizer
        # Start from the prompt's tail so that tokenizers that decode a leading space differently
        # at the start of a sequence (SentencePiece "▁") give the right first delta.
        self._token_ids: list[int] = list((prompt_token_ids or [])[-4:])
        self._prefix_offset = 0  # start of the window we decode
        self._read_offset = len(self._token_ids)  # tokens already turned into emitted text

    def _decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=True))

    def add(self, token_id: int) -> str:
        """Append one token and return the new, complete text (possibly empty)."""
        self._token_ids.append(token_id)
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset :])
        if full_text.endswith(_REPLACEMENT) or len(full_text) <= len(prefix_text):
            return ""  # an unfinished multi-byte character: wait for the next token
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return delta

    def flush(self) -> str:
        """Text still held back at the end of the sequence (a dangling partial character)."""
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._token_ids)
        return full_text[len(prefix_text) :].rstrip(_REPLACEMENT)
