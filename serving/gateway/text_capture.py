"""A request's whole text, kept only when something will read it once the request ends (a shadow copy
compares against it; the sampled prompt log records it); otherwise no token is kept."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


class CapturedText(str):
    """The whole text, which it is, and the pieces it came in: one per token event (the text each
    generated token added, "" for a token that completed no character yet). A shadow copy compares its
    primary's token by token through these (serving/gateway/shadow_diff.py)."""

    tokens: tuple[str, ...]

    def __new__(cls, pieces: Iterable[str]) -> CapturedText:
        tokens = tuple(pieces)
        text = super().__new__(cls, "".join(tokens))
        text.tokens = tokens
        return text


class TextCapture:
    def __init__(self) -> None:
        self._pieces: list[str] | None = None
        self._done: asyncio.Future[str | None] | None = None

    def future(self) -> asyncio.Future[str | None]:
        """The whole text once the request ends normally (None if it fails or is aborted)."""
        if self._done is None:
            self._pieces = []
            self._done = asyncio.get_running_loop().create_future()
        return self._done

    def add(self, token: str) -> None:
        if self._pieces is not None:
            self._pieces.append(token)

    def settle(self, *, ok: bool) -> None:
        """The request ended: normally (`ok`), or not. Only the first call counts."""
        if self._done is not None and not self._done.done():
            self._done.set_result(CapturedText(self._pieces or ()) if ok else None)
