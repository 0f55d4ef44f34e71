"""The registry API's JSON parser: DRF's, with a body nested deeply enough to exhaust Python's recursion
limit (a few thousand bytes of brackets) refused as a parse error, a 400, rather than a 500."""

from __future__ import annotations

from typing import Any

from rest_framework import parsers
from rest_framework.exceptions import ParseError


class JSONParser(parsers.JSONParser):
    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - it is nested too deeply") from None
