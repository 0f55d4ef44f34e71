"""Structured outputs: a request's `response_format` compiled into a grammar this engine's tokenizer can
follow (docs/architecture.md, "Structured outputs").

llguidance compiles a JSON schema (or, for `json_object`, "any object") into a grammar and builds its
lexer and parser against the tokenizer's vocabulary: a fraction of a millisecond for a typical schema on
the demo tokenizer, more for a large schema or vocabulary, and it holds no GIL meanwhile. So it is done
once per distinct schema, on the replica's preparing thread (serving/replica/preparer.py), and kept in a
small LRU cache keyed by the hash of the schema's canonical JSON; each sequence then takes a copy of the
compiled matcher (microseconds), which it advances token by token (constraint.py).

Imports no torch: the scheduler's policy modules import this through sequence.py.
"""

from __future__ import annotations

import collections
import copy
import hashlib
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llguidance import LLMatcher, LLTokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# What the edge and the engine both compile with (the edge checks a schema compiles before anything is
# sent: serving/edge/response_format.py keeps its own copy, and a test holds the two equal). No free
# whitespace: it is what a random or a rambling model would fill max_tokens with, and JSON needs none.
JSON_COMPILE_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
DEFAULT_CACHE_SIZE = 64  # distinct schemas kept compiled


class GrammarError(ValueError):
    """A response_format this engine cannot follow: the request's fault (a 400 at the gateway)."""


@dataclass(frozen=True, slots=True)
class Grammar:
    """A compiled response_format: `key` (the hash of its canonical JSON) names it; each sequence
    following it takes a fresh matcher from `_template`, which nothing ever advances."""

    key: str
    kind: str  # "json_object" or "json_schema"
    # What ends a sequence once the grammar accepts: the engine's, else what llguidance read from the
    # tokenizer (a model that never ends its text still gets one to close a grammar that allows no more).
    eos_token_ids: tuple[int, ...]
    _template: LLMatcher = field(repr=False, compare=False)

    def new_matcher(self) -> LLMatcher:
        return self._template.deep_copy()


def schema_of(response_format: Mapping[str, Any]) -> dict[str, Any] | None:
    """The JSON schema a response_format asks for; None for text (nothing to constrain). Raises
    GrammarError for a shape that is none of OpenAI's three."""
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise GrammarError(f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, Mapping) else None
    if not isinstance(schema, dict):
        raise GrammarError("response_format.json_schema.schema must be a JSON schema object")
    return schema


def cache_key(kind: str, schema: Mapping[str, Any]) -> str:
    canonical = json.dumps([kind, schema], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def ll_tokenizer(tokenizer: Any, *, vocab_size: int, eos_token_ids: list[int]) -> LLTokenizer:
    """llguidance's view of a fast (Rust-backed) Hugging Face tokenizer, sized to the model's logits
    (which may have more rows than the tokenizer has tokens: those are never allowed). As
    llguidance.hf.from_tokenizer, without importing transformers here. ~1 s for a 128k vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GrammarError("response_format needs a fast (Rust) tokenizer, which this model does not have")
    backend = copy.copy(backend)  # padding and truncation off on a copy: the engine's stays as it is
    backend.no_padding()
    backend.no_truncation()
    try:
        return LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos_token_ids or None)
    except Exception as exc:  # a tokenizer llguidance cannot read: the request's 400, not the replica's 500
        raise GrammarError(f"response_format is not available for this model's tokenizer: {exc}") from None


class GrammarCompiler:
    """Compiles response formats for one engine's tokenizer, caching the last `cache_size` distinct ones.
    Thread-safe (the preparing thread compiles; tests and benchmarks may call it from others); the
    llguidance tokenizer is built on first use, off the model thread."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int,
        eos_ids: list[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self.eos_token_ids = list(eos_ids)
        self._cache_size = cache_size
        self._cache: collections.OrderedDict[str, Grammar] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer: LLTokenizer | None = None
        self._tokenizer_error: GrammarError | None = None
        self.num_compiled = 0  # cache misses, for tests and the benchmark

    def tokenizer(self) -> LLTokenizer:
        """llguidance's view of the tokenizer, built once; raises GrammarError, every time, when it
        cannot be (the reason kept: building it again would fail again, as slowly)."""
        with self._lock:
            if self._ll_tokenizer is None and self._tokenizer_error is None:
                try:
                    self._ll_tokenizer = ll_tokenizer(
                        self._tokenizer, vocab_size=self._vocab_size, eos_token_ids=self.eos_token_ids
                    )
                except GrammarError as exc:
                    self._tokenizer_error = exc
            if self._tokenizer_error is not None:
                raise GrammarError(str(self._tokenizer_error))
            assert self._ll_tokenizer is not None
            return self._ll_tokenizer

    def compile(self, response_format: Mapping[str, Any]) -> Grammar | None:
        """The grammar of a response_format (None for text), from the cache when its schema was seen.
        Raises GrammarError naming why one cannot be followed."""
        schema = schema_of(response_format)
        if schema is None:
            return None
        kind = str(response_format["type"])
        key = cache_key(kind, schema)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        # Compiled outside the lock: a large schema may take a while, and cached ones need not wait.
        matcher = self._compile(schema)
        grammar = Grammar(key, kind, tuple(self.tokenizer().eos_tokens), matcher)
        with self._lock:
            self._cache[key] = grammar
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            self.num_compiled += 1
        return grammar

    def _compile(self, schema: dict[str, Any]) -> LLMatcher:
        try:
            text = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_COMPILE_OPTIONS)
        except ValueError as exc:
            raise GrammarError(f"response_format: the schema does not compile: {exc}") from None
        matcher = LLMatcher(self.tokenizer(), text, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"response_format: the schema does not compile: {matcher.get_error()}")
        return matcher
