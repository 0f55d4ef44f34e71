"""Parsing and validating inference request bodies at the edge, before any model work."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest

from registry.parsers import refuse_lone_surrogates
from serving.edge.response_format import parse_response_format
from serving.gateway.errors import GatewayError
from serving.gateway.service_tiers import parse_service_tier
from serving.transport.protocol import MAX_LOGIT_BIAS

MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256


@dataclass(frozen=True, slots=True)
class InferRequest:
    input: str
    max_tokens: int = 16
    stream: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: list[list[int | float]] = field(default_factory=list)
    # vLLM's sampling fields (serving/engine/sequence.py says what each does); set only where given
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    service_tier: str | None = None  # as asked; granted by the caller (serving/gateway/service_tiers.py)
    # JSON or a JSON schema the output must follow, as the replica is sent it (response_format.py)
    response_format: dict[str, Any] | None = None

    def sampling_params(self) -> dict[str, Any]:
        """The fields a replica turns into engine SamplingParams (a plain dict: it crosses the layer);
        the penalties, logit_bias and response_format only where set."""
        params: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": list(self.stop),
        }
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                params[name] = getattr(self, name)
        for name in VLLM_FIELDS:
            if getattr(self, name) is not None:
                params[name] = getattr(self, name)
        if self.logit_bias:
            params["logit_bias"] = self.logit_bias
        if self.response_format is not None:
            params["response_format"] = self.response_format
        return params


# A \uD800-\uDFFF escape: the only way JSON can carry a lone surrogate, which json.loads lets through.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def loads_json(data: str | bytes) -> Any:
    """json.loads with every way a client's bytes can fail it raised as ValueError: besides malformed
    JSON and invalid UTF-8, Python 3.11 refuses an integer of over 4,300 digits with a plain ValueError,
    a few thousand bytes of nested brackets exhaust the recursion limit, and an escaped lone surrogate
    is no Unicode text (unrefused, it failed later: the Redis layer's encoder, a tokenizer, a key's
    hash)."""
    if isinstance(data, bytes):
        # Strictly, before json.loads: it would take UTF-16 and UTF-32 too, and UTF-8's surrogate
        # sequences (surrogatepass). A BOM is let through, as json.loads lets it.
        data = data.decode("utf-8-sig")
    try:
        value = json.loads(data)
    except RecursionError:
        raise ValueError("it is nested too deeply") from None
    if _SURROGATE_ESCAPE.search(data):
        refuse_lone_surrogates(value)
    return value


def parse_json_body(request: HttpRequest) -> dict[str, Any]:
    try:
        raw = request.body
    except RequestDataTooBig:
        raw = None
    if raw is None or len(raw) > settings.MAX_REQUEST_BYTES:
        raise GatewayError(413, f"request body over {settings.MAX_REQUEST_BYTES} bytes")
    try:
        body = loads_json(raw)
    except ValueError as exc:
        raise GatewayError(400, f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "body must be a JSON object")
    return body


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past float's range: JSON has no limit on digits
        return False


def parse_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise GatewayError(400, "stop must be a non-empty string or a list of non-empty strings")
    if len(stops) > MAX_STOP_SEQUENCES or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise GatewayError(400, f"at most {MAX_STOP_SEQUENCES} stop sequences of {MAX_STOP_CHARS} characters")
    return tuple(stops)


def _or_default(body: dict[str, Any], name: str, default: Any) -> Any:
    value = body.get(name)
    return default if value is None else value


def check_max_tokens(value: Any, name: str = "max_tokens") -> None:
    """GatewayError(400) unless `value` is a token count this server takes (a bool is none)."""
    if not is_int(value) or not 1 <= value <= settings.MAX_TOKENS_LIMIT:
        raise GatewayError(400, f"{name} must be an integer from 1 to {settings.MAX_TOKENS_LIMIT}")


def parse_sampling(body: dict[str, Any], *, default_max_tokens: int | None = 16) -> dict[str, Any]:
    """The sampling fields shared by /infer and the OpenAI-shaped endpoints. `default_max_tokens` None
    (chat completions, as OpenAI's): without max_tokens the replica generates until the model ends its
    answer or its context is full, up to MAX_TOKENS_LIMIT."""
    out: dict[str, Any] = {}
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens
    else:
        check_max_tokens(max_tokens)
    out["max_tokens"] = max_tokens
    # null is absent, as in OpenAI's schema (its client sends null for a parameter passed as None)
    stream = _or_default(body, "stream", False)
    if not isinstance(stream, bool):
        raise GatewayError(400, "stream must be true or false")
    out["stream"] = stream
    temperature = _or_default(body, "temperature", 1.0)
    if not _is_number(temperature) or not 0 <= temperature <= 2:
        raise GatewayError(400, "temperature must be a number from 0 to 2")
    out["temperature"] = float(temperature)
    top_p = _or_default(body, "top_p", 1.0)
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise GatewayError(400, "top_p must be a number in (0, 1]")
    out["top_p"] = float(top_p)
    seed = body.get("seed")
    if seed is not None and (not is_int(seed) or not -(2**63) <= seed < 2**63):
        raise GatewayError(400, "seed must be a 64-bit integer")
    # Any int64, as OpenAI's and vLLM's; a negative one (-1 from a UI meaning "pick one", say) is taken
    # modulo 2**63, as the engine's generators want a non-negative one.
    out["seed"] = None if seed is None else seed % 2**63
    out["stop"] = parse_stop(body.get("stop"))
    for name in ("presence_penalty", "frequency_penalty"):
        penalty = body.get(name)
        if penalty is None:
            continue
        if not _is_number(penalty) or not -2 <= penalty <= 2:
            raise GatewayError(400, f"{name} must be a number from -2 to 2")
        if penalty:  # the default crosses no layer
            out[name] = float(penalty)
    logit_bias = parse_logit_bias(body.get("logit_bias"))
    if logit_bias:
        out["logit_bias"] = logit_bias
    out.update(parse_vllm_fields(body, max_tokens=max_tokens))
    response_format = parse_response_format(body.get("response_format"))
    if response_format is not None:  # text crosses no layer: it is what the replica makes anyway
        out["response_format"] = response_format
    return out


def parse_logit_bias(value: Any) -> list[list[int | float]]:
    """OpenAI's `{"token id": bias}` as [[id, bias], …] (JSON has no tuples). Whether each id is in
    the model's vocabulary only the replica knows: it refuses one that is not, with a 400."""
    if value is None:
        return []
    if not isinstance(value, dict):
        raise GatewayError(400, 'logit_bias must be an object of token ids to biases, {"50256": -100}')
    if len(value) > MAX_LOGIT_BIAS:
        raise GatewayError(400, f"logit_bias may bias at most {MAX_LOGIT_BIAS} tokens")
    pairs: list[list[int | float]] = []
    for key, bias in value.items():
        # One spelling per id ("7", never "07"), so that no two keys bias one token past the limit.
        if not (isinstance(key, str) and re.fullmatch(r"0|[1-9][0-9]{0,8}", key)):
            raise GatewayError(400, f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        if not _is_number(bias) or not -100 <= bias <= 100:
            raise GatewayError(400, f"logit_bias[{key!r}] must be a number from -100 to 100")
        pairs.append([int(key), float(bias)])
    return pairs


# vLLM's sampling fields past OpenAI's, which its users send to any OpenAI-compatible server.
VLLM_FIELDS = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos")


def parse_vllm_fields(body: dict[str, Any], *, max_tokens: int | None) -> dict[str, Any]:
    """top_k (an integer >= 1; -1 or 0 is vLLM's "off"), min_p (0 to 1), repetition_penalty (in (0, 2]),
    min_tokens (0 to max_tokens) and ignore_eos (true or false): those given, at their non-default values
    (a default crosses no layer)."""
    out: dict[str, Any] = {}
    top_k = body.get("top_k")
    if top_k is not None:
        if not is_int(top_k) or top_k < -1:
            raise GatewayError(400, "top_k must be an integer >= 1 (or -1 for none)")
        if top_k >= 1:
            out["top_k"] = top_k
    min_p = body.get("min_p")
    if min_p is not None:
        if not _is_number(min_p) or not 0 <= min_p <= 1:
            raise GatewayError(400, "min_p must be a number from 0 to 1")
        if min_p:
            out["min_p"] = float(min_p)
    penalty = body.get("repetition_penalty")
    if penalty is not None:
        if not _is_number(penalty) or not 0 < penalty <= 2:
            raise GatewayError(400, "repetition_penalty must be a number in (0, 2]")
        if penalty != 1:
            out["repetition_penalty"] = float(penalty)
    min_tokens = body.get("min_tokens")
    if min_tokens is not None:
        if not is_int(min_tokens) or min_tokens < 0:
            raise GatewayError(400, "min_tokens must be an integer >= 0")
        if max_tokens is not None and min_tokens > max_tokens:
            raise GatewayError(400, f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})")
        if min_tokens:
            out["min_tokens"] = min_tokens
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None:
        if not isinstance(ignore_eos, bool):
            raise GatewayError(400, "ignore_eos must be true or false")
        if ignore_eos:
            out["ignore_eos"] = True
    return out


# What parse_sampling reads: /infer's fields besides its input, and the OpenAI endpoints' besides theirs.
SAMPLING_FIELDS = frozenset(
    {
        "max_tokens",
        "stream",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "response_format",
        *VLLM_FIELDS,
    }
)
INFER_FIELDS = SAMPLING_FIELDS | {"input", "service_tier"}


def parse_infer(body: dict[str, Any]) -> InferRequest:
    unknown = sorted(set(body) - INFER_FIELDS)
    if unknown:
        raise GatewayError(400, f"unknown field(s): {', '.join(unknown)}")
    text = body.get("input")
    if not isinstance(text, str) or not text:
        raise GatewayError(400, "input must be a non-empty string")
    if len(text) > settings.MAX_INPUT_CHARS:
        raise GatewayError(400, f"input is {len(text)} characters; the limit is {settings.MAX_INPUT_CHARS}")
    tier = parse_service_tier(body.get("service_tier"))
    return InferRequest(input=text, service_tier=tier, **parse_sampling(body))


MAX_TEXT_INPUTS = 2048  # texts in one request to a non-generative model, as the OpenAI API's embeddings


def parse_text_inputs(raw: Any) -> list[str]:
    """A non-generative request's `input`: one text or a list of them, each non-empty and within
    MAX_INPUT_CHARS. Token-id arrays, which the OpenAI API also takes, are refused: ids mean nothing
    across tokenizers."""
    inputs = [raw] if isinstance(raw, str) else raw
    if not isinstance(inputs, list) or not inputs or not all(isinstance(t, str) for t in inputs):
        raise GatewayError(400, "input must be a non-empty string or a non-empty list of strings")
    if len(inputs) > MAX_TEXT_INPUTS:
        raise GatewayError(400, f"input holds {len(inputs)} texts; the limit is {MAX_TEXT_INPUTS}")
    for i, text in enumerate(inputs):
        if not text:
            raise GatewayError(400, f"input[{i}] is empty")
        if len(text) > settings.MAX_INPUT_CHARS:
            raise GatewayError(
                400, f"input[{i}] is {len(text)} characters; the limit is {settings.MAX_INPUT_CHARS}"
            )
    return inputs


CLASSIFY_FIELDS = frozenset({"input", "top_k"})


def parse_classify(body: dict[str, Any]) -> tuple[list[str], int | None]:
    """/infer's body for a classifier: the texts, and how many of the best labels to return for each
    (None: all of them)."""
    unknown = sorted(set(body) - CLASSIFY_FIELDS)
    if unknown:
        raise GatewayError(400, f"unknown field(s) for a classifier: {', '.join(unknown)}")
    top_k = body.get("top_k")
    if top_k is not None and (not is_int(top_k) or top_k < 1):
        raise GatewayError(400, "top_k must be a positive integer")
    return parse_text_inputs(body.get("input")), top_k
