"""Sampled, redacted logging of prompts and completions.

Nothing a client sends or gets back is logged anywhere else. With settings.LOG_PROMPTS_SAMPLE_RATE above
0 (SWITCHYARD_LOG_PROMPTS_SAMPLE_RATE; 0 by default), that share of requests is written, once each
request has ended, as one JSON line to the `switchyard.prompts` logger (route it where such records may
go): its ids, tenant, model and version, the input and the output text. Both texts are redacted first
(e-mail addresses, API keys, bearer tokens and other long secrets, IP addresses, runs of nine or more
digits such as card, phone and account numbers) and then cut to LOGGED_CHARS. A non-generative
request's inputs are logged; its vectors and scores are not."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
from typing import Any

from django.conf import settings

prompt_logger = logging.getLogger("switchyard.prompts")
LOGGED_CHARS = 2000

# Most specific first: a key is a secret before its digits are a number.
_REDACTIONS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]+"), "Bearer [SECRET]"),
    (re.compile(r"\b(?:sy|sk|pk|rk)-[A-Za-z0-9_-]{8,}"), "[SECRET]"),
    (re.compile(r"\bAKIA[0-9A-Z]{16}\b"), "[SECRET]"),
    # an opaque token: 24+ characters of letters and digits mixed (hex digests, base64 keys)
    (re.compile(r"\b(?=[A-Za-z_-]*\d)(?=[\d_-]*[A-Za-z])[A-Za-z0-9_-]{24,}\b"), "[SECRET]"),
    (re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"), "[EMAIL]"),
    (re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}\b"), "[IP]"),
    (re.compile(r"\+?\d(?:[\s().-]{0,3}\d){8,}"), "[NUMBER]"),
]

_rng = random.Random()
_writing: set[asyncio.Task[None]] = set()  # held: the loop keeps only weak references to tasks


def redact(text: str) -> str:
    for pattern, replacement in _REDACTIONS:
        text = pattern.sub(replacement, text)
    if len(text) > LOGGED_CHARS:
        text = f"{text[:LOGGED_CHARS]}…[{len(text) - LOGGED_CHARS} more characters]"
    return text


def _input_text(submission: dict[str, Any]) -> str | list[str] | list[dict[str, str]]:
    if submission.get("input") is not None:
        return redact(str(submission["input"]))
    if submission.get("messages") is not None:
        return [{"role": m["role"], "content": redact(m["content"])} for m in submission["messages"]]
    return [redact(text) for text in submission.get("inputs") or ()]


def maybe_log(handle: Any, *, tenant: str, submission: dict[str, Any]) -> bool:
    """Sample this request (a Dispatch that has been accepted); if it is drawn, write its record once it
    ends. True when drawn."""
    rate = settings.LOG_PROMPTS_SAMPLE_RATE
    if rate <= 0 or _rng.random() >= rate:
        return False
    output = handle.capture_text()  # resolves when the request ends; None if it failed or was aborted
    record = {
        "request_id": handle.request_id,
        "tenant": tenant,
        "model": handle.model_name,
        "version": handle.version,
        "input": _input_text(submission),
    }
    is_generative = submission.get("inputs") is None
    task = asyncio.get_running_loop().create_task(_write(record, output, is_generative=is_generative))
    _writing.add(task)
    task.add_done_callback(_writing.discard)
    return True


async def _write(record: dict[str, Any], output: asyncio.Future[str | None], *, is_generative: bool) -> None:
    text = await output
    record["completed"] = text is not None
    if is_generative:
        record["output"] = redact(text) if text is not None else None
    prompt_logger.info(json.dumps(record, ensure_ascii=False))
