"""How far a shadow copy's output is from its primary's, and the differing pairs kept for staff.

The gateway compares what it has of both outputs: their token events, one per generated token, each
carrying the text that token added (the replica's incremental detokenizer; "" for a token that completed
no character yet). Token ids do not reach the gateway, so two ids that add the same text count as
agreeing; a position is compared only as far as the shorter output goes.

- first divergence: the index of the first token event whose text differs; where one output is a
  strict prefix of the other, the shorter one's length (the first token the other has and it has not);
  None when both are the same events;
- agreement: the share of the shorter output's positions whose token events are equal (1.0 when both
  are empty, 0.0 when only one is).

A copy that differs is kept, with its primary's output and the request's input, only while sampled
prompt logging is on (settings.LOG_PROMPTS_SAMPLE_RATE > 0), drawn at that rate, redacted as the prompt
log redacts, and up to settings.SHADOW_DIFF_PAIRS per candidate version
(serving/telemetry/shadow_pairs.py)."""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings

from serving.telemetry import prompt_log
from serving.telemetry.shadow_pairs import save_pair

logger = logging.getLogger(__name__)
_rng = random.Random()


@dataclass(frozen=True, slots=True)
class OutputDiff:
    first_divergence: int | None
    agreement: float

    @property
    def diverged(self) -> bool:
        return self.first_divergence is not None


def compare(primary: Sequence[str], candidate: Sequence[str]) -> OutputDiff:
    shorter = min(len(primary), len(candidate))
    agreeing = sum(1 for a, b in zip(primary, candidate, strict=False) if a == b)
    first = next((i for i, (a, b) in enumerate(zip(primary, candidate, strict=False)) if a != b), None)
    if first is None and len(primary) != len(candidate):
        first = shorter
    if not shorter:  # nothing to compare: agreement only if both are empty
        return OutputDiff(first, 1.0 if len(primary) == len(candidate) else 0.0)
    agreement = agreeing / shorter
    return OutputDiff(first, agreement)


def tokens_of(text: str | None) -> tuple[str, ...] | None:
    """The token events of a captured text (serving/gateway/text_capture.py), None without them."""
    tokens = getattr(text, "tokens", None)
    return tokens if isinstance(tokens, tuple) else None


def should_keep() -> bool:
    rate = settings.LOG_PROMPTS_SAMPLE_RATE
    return rate > 0 and int(settings.SHADOW_DIFF_PAIRS) > 0 and _rng.random() < rate


async def keep_pair(
    *,
    model_name: str,
    version: str,
    primary_version: str,
    request_id: str,
    submission: dict[str, Any],
    primary_text: str,
    candidate_text: str,
    diff: OutputDiff,
) -> bool:
    """Redact and store one differing pair (call when should_keep() drew it). True when stored."""
    redacted_input = await prompt_log.off_the_loop(prompt_log.redacted_input, submission)
    primary_output = await prompt_log.off_the_loop(prompt_log.redact, primary_text)
    candidate_output = await prompt_log.off_the_loop(prompt_log.redact, candidate_text)
    if redacted_input is None or primary_output is None or candidate_output is None:
        return False  # the redaction thread is backlogged: dropped, as a prompt log record would be
    return bool(
        # Not thread-sensitive: a copy outlives the request that started it, and its sync thread.
        await database_sync_to_async(save_pair, thread_sensitive=False)(
            model_name=model_name,
            version=version,
            primary_version=primary_version,
            request_id=request_id,
            input=redacted_input,
            primary_output=primary_output,
            candidate_output=candidate_output,
            first_divergence=diff.first_divergence,
            agreement=diff.agreement,
        )
    )
