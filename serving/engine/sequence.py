"""A request's state inside a replica, and the sampling parameters it was submitted with."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from serving.engine.constraint import Constraint
from serving.engine.grammar import Grammar


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop sequence
    LENGTH = "length"  # max_tokens or the model's context limit
    ABORT = "abort"  # the client went away or cancelled
    ERROR = "error"


MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs
# Below this a temperature is greedy, as vLLM reads it: dividing by 1e-39 overflows float32 and by 1e-50
# (zero in float32) divides by zero, and either made every probability NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_LOGIT_BIAS = 300  # tokens one request may bias, as OpenAI's logit_bias


@dataclass(slots=True, frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or under GREEDY_BELOW_TEMPERATURE) means greedy
    top_p: float = 1.0
    top_k: int | None = None  # None: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Each output token's log probability, and this many of the likeliest tokens' at its place (0: the
    # token's own only); None: none. From the model's distribution, before temperature and top-p.
    logprobs: int | None = None
    # OpenAI's: each is subtracted from a token's logit, presence once it has been generated and frequency
    # for every time it has (the prompt's tokens do not count); -2 to 2.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, -100 to 100) added to its logit
    # vLLM's and transformers' own: a token's probability must be at least min_p times the likeliest's
    # (0: off); repetition_penalty divides a positive logit (multiplies a negative one) of every token in
    # the prompt or the output (1: off); min_tokens holds the end of sequence, stop_token_ids and stop
    # strings back until that many tokens are out (0: off; a stop string is not looked for before, as vLLM).
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    # The response_format it must follow (grammar.py), compiled by the engine's GrammarCompiler; None:
    # free text. Its rows' logits are masked to what the grammar allows (grammar_mask.py).
    grammar: Grammar | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def adjusts_logits(self) -> bool:
        return (
            bool(self.logit_bias)
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or self.min_tokens > 0
        )

    def validate(self) -> None:
        """Raise ValueError naming the first bad field; callers validate before allocating anything."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be None or an integer >= 1, got {self.top_k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop sequences must be non-empty strings")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"logprobs must be None or an integer, 0 to {MAX_LOGPROBS}: {self.logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number from -2 to 2, got {value!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may bias at most {MAX_LOGIT_BIAS} tokens")
        for pair in self.logit_bias:
            token_id, bias = pair if isinstance(pair, tuple | list) and len(pair) == 2 else (None, None)
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {pair!r}")
            if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be numbers from -100 to 100, got {pair!r}")
        min_p, penalty = self.min_p, self.repetition_penalty
        if isinstance(min_p, bool) or not isinstance(min_p, int | float) or not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be a number from 0 to 1, got {min_p!r}")
        if isinstance(penalty, bool) or not isinstance(penalty, int | float) or not 0 < penalty <= 2:
            raise ValueError(f"repetition_penalty must be a number in (0, 2], got {penalty!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise ValueError("grammar must be None or a Grammar (GrammarCompiler.compile)")


# Service tiers, highest first (docs/architecture.md, "Service tiers"): the order a replica admits
# waiting sequences in (a waiting flex one is promoted to default after an aging period), and the reverse
# of the order it preempts running ones in.
PRIORITY_TIER, DEFAULT_TIER, FLEX_TIER = 0, 1, 2
TIER_NAMES = ("priority", "default", "flex")


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A tenant's caps inside one replica, from its quota; a None is the replica's own default."""

    max_running: int | None = None  # its sequences running at once
    kv_share: float | None = None  # the share of the KV blocks its sequences may hold, in (0, 1]

    def validate(self) -> None:
        running = self.max_running
        if running is not None and (isinstance(running, bool) or not isinstance(running, int) or running < 1):
            raise ValueError(f"max_running must be None or an integer >= 1, got {self.max_running!r}")
        if self.kv_share is not None and not (
            isinstance(self.kv_share, int | float) and 0 < self.kv_share <= 1
        ):
            raise ValueError(f"kv_share must be None or in (0, 1], got {self.kv_share!r}")


@dataclass(slots=True)
class Sequence:
    """One request. `token_ids` is prompt + output; the first `num_computed_tokens` of them have
    their keys and values in the KV cache (the blocks listed in `block_table`)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    tenant_id: str = "default"
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Tenants whose requests may share cached prompt prefixes; None means the tenant's own group.
    # Prefix-cache entries are salted per group, so other groups can neither reuse nor time them.
    cache_group: str | None = None
    tier: int = DEFAULT_TIER
    limits: TenantLimits | None = None  # None: the replica's defaults for every tenant
    # The LoRA adapter it runs with (lora.py; the engine's slots hold its weights); None: the base.
    # Its prefix-cache entries are keyed on it too (kv_cache.py), so base and adapter never share.
    adapter_id: str | None = None
    enqueued_time: float | None = None  # on the scheduler's clock, when first queued: its tier's aging
    # Its place in params.grammar, having consumed exactly its output tokens (constraint.py); None: free.
    constraint: Constraint | None = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        grammar = self.params.grammar
        self.constraint = Constraint(grammar) if grammar is not None else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def prefix_cache_group(self) -> str:
        return self.tenant_id if self.cache_group is None else self.cache_group

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
