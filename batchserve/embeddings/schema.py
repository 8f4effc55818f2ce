"""OpenAPI paths and schemas of `POST /v1/embeddings` (`embeddings/routes.py`), contributed to /openapi.json.
OpenAI's shapes, errors included (`{"error": {message, type, param, code}}`)."""

from __future__ import annotations

from typing import Any

from batchserve.embeddings.parse import MAX_INPUTS
from batchserve.http import openai_error
from batchserve.http.openapi import Contribution, json_content, ref

SCHEMAS: dict[str, dict[str, Any]] = {
    "OpenAIError": openai_error.SCHEMA,
    "EmbeddingRequest": {
        "type": "object",
        "required": ["input"],
        "properties": {
            "input": {
                "oneOf": [
                    {"type": "string", "minLength": 1},
                    {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": MAX_INPUTS,
                        "items": {"type": "string", "minLength": 1},
                    },
                ],
                "description": "text, or a list of texts; each is one item on the batcher (token-id arrays: 400)",
            },
            "model": {
                "type": "string",
                "description": "a model whose backend produces embeddings (GET /v1/models); "
                "default: the first such model",
            },
            "encoding_format": {
                "enum": ["float", "base64"],
                "default": "float",
                "description": "base64: the little-endian float32 bytes of each vector",
            },
            "dimensions": {
                "type": "integer",
                "minimum": 1,
                "description": "keep the first N components of each vector and L2-normalise them again "
                "(Matryoshka truncation); over the model's width: 400",
            },
            "user": {"type": "string", "description": "accepted and ignored"},
            "timeout_ms": {
                "type": "number",
                "exclusiveMinimum": 0,
                "description": "extension: the request's deadline, as on /v1/inference",
            },
        },
    },
    "EmbeddingList": {
        "type": "object",
        "required": ["object", "data", "model", "usage"],
        "properties": {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["object", "index", "embedding"],
                    "properties": {
                        "object": {"const": "embedding"},
                        "index": {"type": "integer", "minimum": 0},
                        "embedding": {
                            "oneOf": [
                                {"type": "array", "items": {"type": "number"}},
                                {"type": "string", "contentEncoding": "base64"},
                            ]
                        },
                    },
                },
            },
            "model": {"type": "string", "description": "name@version that served it"},
            "usage": {
                "type": "object",
                "required": ["prompt_tokens", "total_tokens"],
                "properties": {
                    "prompt_tokens": {"type": "integer", "minimum": 0},
                    "total_tokens": {"type": "integer", "minimum": 0},
                },
            },
        },
    },
}

PATHS: dict[str, dict[str, Any]] = {
    "/v1/embeddings": {
        "post": {
            "operationId": "createEmbedding",
            "summary": "OpenAI-compatible embeddings; each input rides the batcher on its own",
            "requestBody": {"required": True, "content": json_content(ref("EmbeddingRequest"))},
            "responses": {
                "200": {
                    "description": "one vector per input, in input order",
                    "content": json_content(ref("EmbeddingList")),
                },
                **openai_error.responses(400, 401, 404, 413, 429, 500, 503, 504),
            },
        }
    },
}

OPENAPI = Contribution(PATHS, SCHEMAS)
