"""OpenAPI paths and schemas of `POST /v1/rerank` and `/rerank` (`rerank/routes.py`), contributed to
/openapi.json. Cohere's request and answer shape; errors in OpenAI's shape."""

from __future__ import annotations

from typing import Any

from batchserve.http import openai_error
from batchserve.http.openapi import Contribution, json_content, ref
from batchserve.rerank.parse import MAX_DOCUMENTS

SCHEMAS: dict[str, dict[str, Any]] = {
    "OpenAIError": openai_error.SCHEMA,
    "RerankRequest": {
        "type": "object",
        "required": ["query", "documents"],
        "properties": {
            "query": {"type": "string", "minLength": 1},
            "documents": {
                "type": "array",
                "minItems": 1,
                "maxItems": MAX_DOCUMENTS,
                "items": {
                    "oneOf": [
                        {"type": "string"},
                        {"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}},
                    ]
                },
                "description": "each (query, document) pair is one input on the batcher",
            },
            "top_n": {"type": "integer", "minimum": 1, "description": "answer the best N only (default: all)"},
            "return_documents": {
                "type": "boolean",
                "default": False,
                "description": "echo each document's text in its result",
            },
            "model": {"type": "string", "description": "a reranking model (GET /v1/models); default: the first"},
            "timeout_ms": {
                "type": "number",
                "exclusiveMinimum": 0,
                "description": "extension: the request's deadline, as on /v1/inference",
            },
        },
    },
    "RerankResponse": {
        "type": "object",
        "required": ["id", "results", "model", "usage"],
        "properties": {
            "id": {"type": "string"},
            "results": {
                "type": "array",
                "description": "sorted by relevance_score, highest first",
                "items": {
                    "type": "object",
                    "required": ["index", "relevance_score"],
                    "properties": {
                        "index": {
                            "type": "integer",
                            "minimum": 0,
                            "description": "the document's place in the request",
                        },
                        "relevance_score": {
                            "type": "number",
                            "description": "as sentence-transformers' CrossEncoder.predict "
                            "gives it (sigmoid of the logit by default)",
                        },
                        "document": {
                            "type": "object",
                            "required": ["text"],
                            "properties": {"text": {"type": "string"}},
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

_OPERATION = {
    "summary": "Rerank documents against a query (Cohere's shape); each pair rides the batcher on its own",
    "requestBody": {"required": True, "content": json_content(ref("RerankRequest"))},
    "responses": {
        "200": {"description": "the documents' scores, best first", "content": json_content(ref("RerankResponse"))},
        **openai_error.responses(400, 401, 404, 413, 429, 500, 503, 504),
    },
}

PATHS: dict[str, dict[str, Any]] = {
    "/v1/rerank": {"post": {"operationId": "rerank", **_OPERATION}},
    "/rerank": {"post": {"operationId": "rerankUnversioned", **_OPERATION}},
}

OPENAPI = Contribution(PATHS, SCHEMAS)
