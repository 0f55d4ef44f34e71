"""The inference endpoints are plain async Django views (DRF has no async views); this hook adds them
to the OpenAPI document drf-spectacular builds from the DRF views."""

from __future__ import annotations

from typing import Any

from serving.requests import MAX_TEXT_INPUTS

_ERROR = {
    "type": "object",
    "properties": {
        "error": {"type": "object", "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}
    },
}

_GENERATE = {
    "type": "object",
    "title": "generate (causal-lm)",
    "required": ["input"],
    "properties": {
        "input": {"type": "string"},
        "max_tokens": {"type": "integer", "minimum": 1, "default": 16},
        "stream": {"type": "boolean", "default": False},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2, "default": 1},
        "top_p": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1, "default": 1},
        "seed": {"type": "integer", "nullable": True},
        "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    },
}
_CLASSIFY = {
    "type": "object",
    "title": "classify (classifier)",
    "required": ["input"],
    "properties": {
        "input": {
            "oneOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "maxItems": MAX_TEXT_INPUTS},
            ]
        },
        "top_k": {"type": "integer", "minimum": 1, "nullable": True, "description": "default: every label"},
    },
}


def add_inference_paths(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    errors = {
        str(code): {"description": text, "content": {"application/json": {"schema": _ERROR}}}
        for code, text in [
            (400, "invalid request"),
            (401, "missing or invalid API key"),
            (403, "model or pin not allowed"),
            (404, "unknown model or version"),
            (413, "input too large"),
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
    result.setdefault("components", {}).setdefault("securitySchemes", {})["bearerAuth"] = {
        "type": "http",
        "scheme": "bearer",
    }
    return result
