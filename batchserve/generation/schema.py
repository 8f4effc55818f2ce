"""OpenAPI paths and schemas of the generation routes (`generation/routes.py`), contributed to /openapi.json.

These routes follow OpenAI's API, not DESIGN §2: their errors are `{"error": {message, type, param, code}}`.
"""

from __future__ import annotations

from typing import Any

from batchserve.http import openai_error
from batchserve.http.openapi import Contribution, json_content, ref

_SAMPLING = {
    "max_tokens": {
        "type": "integer",
        "minimum": 1,
        "description": "capped at --generation-max-tokens (default 512), which is also the default",
    },
    "temperature": {"type": "number", "minimum": 0, "maximum": 2, "default": 1, "description": "0 = greedy"},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1},
    "stop": {
        "oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "maxItems": 4, "items": {"type": "string", "minLength": 1}},
        ]
    },
    "seed": {"type": "integer", "description": "same seed, same prompt and parameters: same tokens"},
    "stream": {"type": "boolean", "default": False, "description": "server-sent events ending in `data: [DONE]`"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "ignore_eos": {"type": "boolean", "default": False, "description": "extension: generate max_tokens exactly"},
    "n": {"const": 1},
}
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    },
}
_FINISH = {"enum": ["stop", "length", None]}

SCHEMAS: dict[str, dict[str, Any]] = {
    "OpenAIError": openai_error.SCHEMA,
    "ChatCompletionRequest": {
        "type": "object",
        "required": ["messages"],
        "properties": {
            "model": {
                "type": "string",
                "description": "the generation model id (GET /v1/models); default: the one served here",
            },
            "messages": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["role", "content"],
                    "properties": {
                        "role": {"enum": ["system", "developer", "user", "assistant"]},
                        "content": {"oneOf": [{"type": "string"}, {"type": "array"}]},
                    },
                },
            },
            "max_completion_tokens": {"type": "integer", "minimum": 1},
            **_SAMPLING,
        },
    },
    "CompletionRequest": {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            "model": {"type": "string", "description": "default: the generation model served here"},
            "prompt": {
                "oneOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "array", "items": {"type": "integer", "minimum": 0}},
                ]
            },
            **_SAMPLING,
        },
    },
    "ChatCompletion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "chat.completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "usage": _USAGE,
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "index": {"type": "integer"},
                        "finish_reason": _FINISH,
                        "message": {
                            "type": "object",
                            "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}},
                        },
                    },
                },
            },
        },
    },
    "Completion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "text_completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "usage": _USAGE,
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"index": {"type": "integer"}, "text": {"type": "string"}, "finish_reason": _FINISH},
                },
            },
        },
    },
    "GenerationStatus": {
        "type": "object",
        "required": ["enabled", "ready"],
        "properties": {
            "enabled": {"type": "boolean"},
            "ready": {"type": "boolean"},
            "running": {"type": "integer"},
            "waiting": {"type": "integer"},
            "kv_blocks": {"type": "integer"},
            "kv_blocks_reserved": {"type": "integer"},
            "step_ms": {"type": "number"},
            "cancelled": {"type": "integer"},
        },
    },
}


_errors = openai_error.responses


def _operation(op_id: str, summary: str, request: str, answer: str) -> dict[str, Any]:
    return {
        "operationId": op_id,
        "summary": summary,
        "requestBody": {"required": True, "content": json_content(ref(request))},
        "responses": {
            "200": {
                "description": "the whole answer, or with stream: true, text/event-stream chunks",
                "content": {**json_content(ref(answer)), "text/event-stream": {"schema": {"type": "string"}}},
            },
            **_errors(400, 401, 404, 413, 429, 500, 503, 504),
        },
    }


PATHS: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "post": _operation(
            "createChatCompletion",
            "OpenAI-compatible chat completion, continuous batching",
            "ChatCompletionRequest",
            "ChatCompletion",
        )
    },
    "/v1/completions": {
        "post": _operation(
            "createCompletion",
            "OpenAI-compatible text completion, continuous batching",
            "CompletionRequest",
            "Completion",
        )
    },
    "/internal/generation": {
        "get": {
            "operationId": "generationStatus",
            "summary": "The generation engine: sequences, KV blocks, step time",
            "responses": {"200": {"description": "engine state", "content": json_content(ref("GenerationStatus"))}},
        }
    },
}


OPENAPI = Contribution(PATHS, SCHEMAS)
