"""The registry API's JSON parser: DRF's, with a body nested deeply enough to exhaust Python's recursion
limit (a few thousand bytes of brackets), and a string with an unpaired surrogate (which the renderer or
the database driver failed on), refused as a parse error, a 400, rather than a 500."""

from __future__ import annotations

import json
from typing import Any

from rest_framework import parsers
from rest_framework.exceptions import ParseError


class JSONParser(parsers.JSONParser):
    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - it is nested too deeply") from None
        try:
            refuse_lone_surrogates(data)
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
        return data


def refuse_lone_surrogates(value: Any) -> None:
    """ValueError if a string in `value` (parsed JSON) holds half a UTF-16 pair: no Unicode text, which
    JSON's escapes can carry (json.loads joins a whole pair into one character)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("a string holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff)") from None
    except RecursionError:  # dumps takes a frame more than loads did: a value nested just short of the limit
        raise ValueError("it is nested too deeply") from None
