"""Sampled, redacted logging of prompts and completions.

Nothing a client sends or gets back is logged anywhere else. With settings.LOG_PROMPTS_SAMPLE_RATE above
0 (SWITCHYARD_LOG_PROMPTS_SAMPLE_RATE; 0 by default), that share of requests is written, once each
request has ended, as one JSON line to the `switchyard.prompts` logger (route it where such records may
go): its ids, tenant, model and version, the input and the output text. Both texts are redacted first
(private keys, bearer and basic credentials, passwords in URLs, the values of `password=…`-style pairs
whose name ends in a secret's word, quoted or not (`DB_PASSWORD=…`, `"api_key": "…"`, `?access_token=…`), API
keys, runs of 24+ characters mixing letters and digits such as digests and base64 secrets, e-mail
addresses, IPv4 and IPv6 addresses, runs of nine or more digits such as card, phone and account
numbers) and then cut to LOGGED_CHARS. Redaction is pattern matching: it catches the common shapes,
not every secret a prompt can hold, which is why logging is off unless asked for. A non-generative
request's first MAX_LOGGED_INPUTS inputs are logged; its vectors and scores are not. Redaction runs on
a thread of its own, off the gateway's event loop; a record that finds MAX_REDACTING others waiting for
it is dropped, with a warning (a sampled log may miss records; the gateway may not slow down)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from django.conf import settings

from serving.throttle import Throttle

logger = logging.getLogger(__name__)
prompt_logger = logging.getLogger("switchyard.prompts")
LOGGED_CHARS = 2000


def _opaque_token(match: re.Match[str]) -> str:
    """A run of 24+ token characters is a secret when it mixes letters and digits (keys, digests,
    base64); a long word or number alone is not."""
    run = match.group(0)
    has_digit = any(c.isdigit() for c in run)
    return "[SECRET]" if has_digit and any(c.isalpha() for c in run) else run


# Most specific first: a key is a secret before its digits are a number. Every pattern runs in time
# linear in the text (bounded repeats, no nested unbounded ones).
_REDACTIONS: list[tuple[re.Pattern[str], str | Any]] = [
    (re.compile(r"-----BEGIN [A-Z ]{1,40}-----.*?(?:-----END [A-Z ]{1,40}-----|\Z)", re.S), "[SECRET]"),
    (re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]+"), r"\1 [SECRET]"),
    (re.compile(r"(?<=://)[^\s/:@]{1,256}:[^\s/@]{1,256}(?=@)"), "[SECRET]"),  # user:password@ in a URL
    (
        # A key=value or key: value pair whose name ends in a secret's word, prefixed or not (DB_PASSWORD,
        # PGPASSWORD, refresh_token, OPENAI_API_KEY), the name quoted or not (JSON, YAML, a query
        # string). The value: a quoted one whole (escaped quotes too), else up to the next space or the
        # & before a query string's next name= (a password holds any other character: & ; ' ,). Better
        # a neighbour redacted with it than part of a secret left.
        re.compile(
            r"(?i)(?<![A-Za-z0-9])([A-Za-z0-9_.-]{0,40}?"
            r"(?:password|passwd|passphrase|pwd|secret|token|api[_-]?key|access[_-]?key|private[_-]?key)"
            r"[\"']?\s*[:=]\s*)"
            r"(?:\"(?:[^\"\\\n]|\\.){1,256}\"|'(?:[^'\\\n]|\\.){1,256}'|(?:[^\s&]|&(?![\w.-]{1,40}=))+)"
        ),
        r"\1[SECRET]",
    ),
    (re.compile(r"\b(?:sy|sk|pk|rk)-[A-Za-z0-9_-]{8,}"), "[SECRET]"),
    (re.compile(r"\bAKIA[0-9A-Z]{16}\b"), "[SECRET]"),
    (re.compile(r"[A-Za-z0-9_+/=-]{24,}"), _opaque_token),
    (
        re.compile(
            r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(?:\.[A-Za-z0-9-]{1,63}){0,8}\.[A-Za-z]{2,24}"
        ),
        "[EMAIL]",
    ),
    (re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}\b"), "[IP]"),
    (re.compile(r"\b[0-9A-Fa-f]{1,4}(?::[0-9A-Fa-f]{0,4}){3,7}\b"), "[IP]"),  # IPv6, :: included
    (re.compile(r"\+?\d(?:[\s().-]{0,3}\d){8,}"), "[NUMBER]"),
]

_rng = random.Random()
_writing: set[asyncio.Task[None]] = set()  # held: the loop keeps only weak references to tasks


def redact(text: str) -> str:
    """The text with secrets and personal data replaced, then cut to LOGGED_CHARS. The patterns run over
    the whole text (the gateway bounds it: MAX_INPUT_CHARS): run over a first cut, a secret split by it
    escaped them, and once what came before had shrunk into placeholders its fragment moved inside the
    part that is logged."""
    num_chars = len(text)
    for pattern, replacement in _REDACTIONS:
        text = pattern.sub(replacement, text)
    if len(text) > LOGGED_CHARS:
        text = f"{text[:LOGGED_CHARS]}…[{num_chars - LOGGED_CHARS} more characters]"
    return text


# Of an embedding or classification request's texts (up to 2,048, each up to MAX_INPUT_CHARS): the
# redaction's cost grows with what it reads, and a record of them all would be mostly placeholders.
MAX_LOGGED_INPUTS = 8


def _input_text(submission: dict[str, Any]) -> str | list[str] | list[dict[str, str]]:
    if submission.get("input") is not None:
        return redact(str(submission["input"]))
    if submission.get("messages") is not None:
        return [{"role": m["role"], "content": redact(m["content"])} for m in submission["messages"]]
    inputs = list(submission.get("inputs") or ())
    logged = [redact(text) for text in inputs[:MAX_LOGGED_INPUTS]]
    if len(inputs) > MAX_LOGGED_INPUTS:
        logged.append(f"…[{len(inputs) - MAX_LOGGED_INPUTS} more inputs]")
    return logged


def redacted_input(submission: dict[str, Any]) -> str | list[str] | list[dict[str, str]]:
    """A request's input as this log writes it, for the other records kept as redacted as this one (the
    differing outputs of shadow copies). Runs the patterns: call it through `off_the_loop`."""
    return _input_text({name: submission.get(name) for name in ("input", "messages", "inputs")})


def maybe_log(handle: Any, *, tenant: str, submission: dict[str, Any]) -> bool:
    """Sample this request (an InFlightRequest that has been accepted); if it is drawn, write its record
    once it ends. True when drawn."""
    rate = settings.LOG_PROMPTS_SAMPLE_RATE
    if rate <= 0 or _rng.random() >= rate:
        return False
    output = handle.capture_text()  # resolves when the request ends; None if it failed or was aborted
    record = {
        "request_id": handle.request_id,
        "tenant": tenant,
        "model": handle.model_name,
        "version": handle.version,
    }
    inputs = {name: submission.get(name) for name in ("input", "messages", "inputs")}
    is_generative = submission.get("inputs") is None
    task = asyncio.get_running_loop().create_task(_write(record, inputs, output, is_generative=is_generative))
    _writing.add(task)
    task.add_done_callback(_writing.discard)
    return True


# The patterns take up to a tenth of a second over a long text made to be slow: on the event loop that
# held every other request of the gateway. On a thread of their own, not the loop's default pool, which
# key lookups and routing reads wait for; and with a bounded backlog, as Python's regexes hold the GIL.
MAX_REDACTING = 32
_redactor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompt-log-redaction")
_redacting = 0
_dropped_warning = Throttle()
_T = TypeVar("_T")


class _Backlogged(Exception):
    pass


async def _off_the_loop(function: Callable[[Any], _T], argument: Any) -> _T:
    global _redacting
    if _redacting >= MAX_REDACTING:
        raise _Backlogged
    _redacting += 1
    try:
        return await asyncio.get_running_loop().run_in_executor(_redactor, function, argument)
    finally:
        _redacting -= 1


async def off_the_loop(function: Callable[[Any], _T], argument: Any) -> _T | None:
    """`function(argument)` (redact, redacted_input) on the redaction thread, as this log's records are
    redacted; None, with the log's warning, when MAX_REDACTING records already wait for it."""
    try:
        return await _off_the_loop(function, argument)
    except _Backlogged:
        if _dropped_warning.is_due():
            logger.warning("prompt log: %d records wait for redaction; records are being dropped", _redacting)
        return None


async def _write(
    record: dict[str, Any],
    inputs: dict[str, Any],
    output: asyncio.Future[str | None],
    *,
    is_generative: bool,
) -> None:
    try:
        record["input"] = await _off_the_loop(_input_text, inputs)
        text = await output
        record["completed"] = text is not None
        if is_generative:
            record["output"] = await _off_the_loop(redact, text) if text is not None else None
    except _Backlogged:
        if _dropped_warning.is_due():
            logger.warning("prompt log: %d records wait for redaction; records are being dropped", _redacting)
        return
    prompt_logger.info(json.dumps(record, ensure_ascii=False))
