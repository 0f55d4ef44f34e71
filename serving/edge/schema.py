"""The inference endpoints are plain async Django views (DRF has no async views); this hook adds them
to the OpenAPI document drf-spectacular builds from the DRF views."""

from __future__ import annotations

from typing import Any

from serving.edge.request_bodies import MAX_TEXT_INPUTS

_ERROR = {
    "type": "object",
    "properties": {
        "error": {"type": "object", "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}
    },
}

# /infer's and the OpenAI endpoints' shared fields (serving/edge/request_bodies.py parse_sampling)
_SAMPLING = {
    "max_tokens": {"type": "integer", "minimum": 1, "default": 16},
    # null reads as absent, for every field (the openai client sends null for a parameter given as None)
    "stream": {"type": "boolean", "default": False, "nullable": True},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2, "default": 1, "nullable": True},
    "top_p": {
        "type": "number",
        "minimum": 0,
        "exclusiveMinimum": True,
        "maximum": 1,
        "default": 1,
        "nullable": True,
    },
    "seed": {
        "type": "integer",
        "nullable": True,
        "minimum": -(2**63),
        "maximum": 2**63 - 1,
        "description": "a negative seed is taken modulo 2**63",
    },
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2, "default": 0},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2, "default": 0},
    "logit_bias": {
        "type": "object",
        "description": 'token id (a string) to a bias from -100 to 100, at most 300: {"50256": -100}',
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        "maxProperties": 300,
    },
    # vLLM's sampling fields, which its users send to any OpenAI-compatible server
    "top_k": {"type": "integer", "minimum": -1, "nullable": True, "description": "-1 or 0: no top-k cut"},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1, "default": 0, "nullable": True},
    "repetition_penalty": {
        "type": "number",
        "minimum": 0,
        "exclusiveMinimum": True,
        "maximum": 2,
        "default": 1,
        "nullable": True,
    },
    "min_tokens": {"type": "integer", "minimum": 0, "default": 0, "nullable": True},
    "ignore_eos": {"type": "boolean", "default": False, "nullable": True},
    # Structured outputs (serving/edge/response_format.py): enforced by constrained decoding.
    "response_format": {
        "type": "object",
        "nullable": True,
        "required": ["type"],
        "description": "text (the default), any JSON object, or JSON matching a schema (at most "
        "MAX_RESPONSE_SCHEMA_BYTES, 64 KiB, of compact JSON); a schema that cannot be enforced is a 400",
        "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
            "json_schema": {
                "type": "object",
                "required": ["name", "schema"],
                "properties": {
                    "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                    "description": {"type": "string", "nullable": True},
                    "schema": {"type": "object"},
                    "strict": {"type": "boolean", "nullable": True, "description": "always enforced"},
                },
            },
        },
    },
    "service_tier": {
        "type": "string",
        "enum": ["auto", "default", "flex", "priority"],
        "nullable": True,
        "description": "the tier a replica admits it at, up to the tenant's quota (auto: default); echoed",
    },
}
_GENERATE = {
    "type": "object",
    "title": "generate (causal-lm)",
    "required": ["input"],
    "properties": {"input": {"type": "string"}, **_SAMPLING},
}
_TEXTS = {
    "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": MAX_TEXT_INPUTS}]
}
_CLASSIFY = {
    "type": "object",
    "title": "classify (classifier)",
    "required": ["input"],
    "properties": {
        "input": _TEXTS,
        "top_k": {"type": "integer", "minimum": 1, "nullable": True, "description": "default: every label"},
    },
}

# Chat's tools (serving/edge/tool_calls.py): OpenAI's shapes.
_TOOL_FIELDS = {
    "tools": {
        "type": "array",
        "nullable": True,
        "minItems": 1,
        "maxItems": 128,
        "items": {
            "type": "object",
            "required": ["type", "function"],
            "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "function": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                        "description": {"type": "string", "nullable": True},
                        "parameters": {"type": "object", "nullable": True, "description": "a JSON schema"},
                        "strict": {"type": "boolean", "nullable": True, "description": "not read"},
                    },
                },
            },
        },
    },
    "tool_choice": {
        "nullable": True,
        "description": "none, auto (the default with tools), required, or one function: the last two "
        "are enforced by constrained decoding",
        "oneOf": [
            {"type": "string", "enum": ["none", "auto", "required"]},
            {
                "type": "object",
                "required": ["type", "function"],
                "properties": {
                    "type": {"type": "string", "enum": ["function"]},
                    "function": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {"name": {"type": "string"}},
                    },
                },
            },
        ],
    },
    "parallel_tool_calls": {"type": "boolean", "nullable": True, "default": True},
}
_TOOL_CALLS = {
    "type": "array",
    "nullable": True,
    "minItems": 1,
    "items": {
        "type": "object",
        "required": ["id", "function"],
        "properties": {
            "id": {"type": "string"},
            "type": {"type": "string", "enum": ["function"]},
            "function": {
                "type": "object",
                "required": ["name", "arguments"],
                "properties": {
                    "name": {"type": "string"},
                    "arguments": {"type": "string", "description": "the arguments' JSON"},
                },
            },
        },
    },
}

_OPENAI_SAMPLING = {
    **_SAMPLING,
    "model": {"type": "string"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "n": {"type": "integer", "minimum": 1, "maximum": 16, "default": 1},
}
_OPENAI_PATHS = [
    (
        "/v1/completions",
        "completions_create",
        "Complete a prompt (a causal-lm model)",
        {
            "type": "object",
            "required": ["model", "prompt"],
            "properties": {
                **_OPENAI_SAMPLING,
                "prompt": {"type": "string"},
                # the model's own log probabilities (before temperature and top-p) and this many alternatives
                "logprobs": {"type": "integer", "minimum": 0, "maximum": 5, "nullable": True},
            },
        },
    ),
    (
        "/v1/chat/completions",
        "chat_completions_create",
        "Answer a chat (a causal-lm model; the tokenizer's chat template, or a plain default)",
        {
            "type": "object",
            "required": ["model", "messages"],
            "properties": {
                **_OPENAI_SAMPLING,
                # As OpenAI's: without it, the answer runs to its end or the context's (MAX_TOKENS_LIMIT).
                "max_tokens": {"type": "integer", "minimum": 1},
                "max_completion_tokens": {"type": "integer", "minimum": 1, "nullable": True},
                "logprobs": {"type": "boolean", "default": False},
                "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20, "nullable": True},
                **_TOOL_FIELDS,
                "messages": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["role"],
                        "properties": {
                            # developer: OpenAI's newer name for system, read as system
                            "role": {
                                "type": "string",
                                "enum": ["system", "developer", "user", "assistant", "tool"],
                            },
                            # an assistant's calls, as a response returned them (chat_messages.py)
                            "tool_calls": _TOOL_CALLS,
                            "tool_call_id": {
                                "type": "string",
                                "description": "a tool message's: the id of the call it answers",
                            },
                            "content": {
                                "nullable": True,
                                "description": "required but for an assistant's message with tool_calls",
                                "anyOf": [
                                    {"type": "string"},
                                    {
                                        "type": "array",
                                        "minItems": 1,
                                        "items": {
                                            "type": "object",
                                            "required": ["type", "text"],
                                            "properties": {
                                                "type": {"type": "string", "enum": ["text"]},
                                                "text": {"type": "string"},
                                            },
                                        },
                                    },
                                ],
                            },
                        },
                    },
                },
            },
        },
    ),
    (
        "/v1/embeddings",
        "embeddings_create",
        "Embed texts (an embedding model)",
        {
            "type": "object",
            "required": ["model", "input"],
            "properties": {
                "model": {"type": "string"},
                "input": _TEXTS,
                "encoding_format": {"type": "string", "enum": ["float", "base64"], "default": "float"},
            },
        },
    ),
]


def add_inference_paths(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    errors = {
        str(code): {"description": text, "content": {"application/json": {"schema": _ERROR}}}
        for code, text in [
            (400, "invalid request (an input over the character limit too)"),
            (401, "missing or invalid API key"),
            (403, "model or pin not allowed"),
            (404, "unknown model or version"),
            (413, "request body over the byte limit"),
            (429, "over quota; see Retry-After"),
            (503, "no ready replica"),
        ]
    }
    result.setdefault("paths", {})["/v1/models/{model}/infer"] = {
        "post": {
            "operationId": "models_infer",
            "summary": "Generate from a model (JSON, or SSE when stream is true), or classify texts",
            "description": "The body a model takes depends on its kind: a causal LM generates from "
            "`input`; a classifier scores its labels for each of the inputs and returns "
            "`{predictions: [[{label, score}, ...] per input, best first], usage}`.",
            "parameters": [
                {
                    "name": "model",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "string"},
                    "description": "model name, optionally `name@alias`",
                },
                {"name": "X-Version-Pin", "in": "header", "required": False, "schema": {"type": "string"}},
            ],
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {"anyOf": [_GENERATE, _CLASSIFY]},
                    }
                },
            },
            "responses": {
                "200": {
                    "description": "the output, or an SSE stream of `data: {token, index}` events then "
                    "`data: {finish_reason, usage}`; a classifier's predictions",
                    "headers": {"X-Served-Version": {"schema": {"type": "string"}}},
                },
                **errors,
            },
            "security": [{"bearerAuth": []}],
        }
    }
    paths = result["paths"]
    for path, operation_id, summary, body in _OPENAI_PATHS:
        paths[path] = {
            "post": {
                "operationId": operation_id,
                "summary": summary,
                "description": "The OpenAI API's shape (the `openai` client works with base_url=…/v1); "
                "fields we do not implement are refused with a 400, never ignored.",
                "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
                "responses": {
                    "200": {
                        "description": "the OpenAI response object, or an SSE stream ending with "
                        "`data: [DONE]` when stream is true",
                        "headers": {"X-Served-Version": {"schema": {"type": "string"}}},
                    },
                    **errors,
                },
                "security": [{"bearerAuth": []}],
            }
        }
    result.setdefault("components", {}).setdefault("securitySchemes", {})["bearerAuth"] = {
        "type": "http",
        "scheme": "bearer",
    }
    return result
