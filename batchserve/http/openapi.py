"""The OpenAPI 3.1 document served at `GET /openapi.json` (DESIGN §2): its shared pieces and its assembly.

Written by hand, next to the contract, so that the schemas say exactly what DESIGN §2 promises (tests check
live answers against them). Each route module declares its own paths and schemas as a `Contribution`
(`inference/schema.py`, `jobs/schema.py`, `generation/schema.py`), and `app.create_app` builds the document from the
contributions of the routes it mounts: nothing is registered by importing a module. Contributions refer to
the shared pieces with `ref("Error")` and `error_responses(400, 404, ...)`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

JSON = "application/json"
VERSION = "0.1.0"

# Error codes by status (DESIGN §2 table), plus the ones the router itself answers.
ERROR_CODES: dict[int, list[str]] = {
    400: ["INVALID_REQUEST"],
    401: ["UNAUTHORIZED"],
    404: ["MODEL_NOT_FOUND", "REQUEST_NOT_FOUND", "NOT_FOUND"],
    405: ["METHOD_NOT_ALLOWED"],
    409: ["CONFLICT"],
    413: ["PAYLOAD_TOO_LARGE"],
    429: ["RATE_LIMITED"],
    500: ["INFERENCE_FAILED", "INTERNAL_ERROR"],
    503: ["SERVICE_OVERLOADED", "DRAINING", "NO_HEALTHY_WORKER"],
    504: ["DEADLINE_EXCEEDED"],
}
ERROR_WHEN: dict[int, str] = {
    400: "not JSON, not an object, `input` missing / not a string / empty, bad `timeout_ms`, invalid UTF-8",
    401: "API keys are configured and the key is missing or wrong",
    404: "unknown model or version, unknown request id, or unknown route",
    405: "the route does not take this method",
    409: "the request conflicts with an earlier one (same idempotency key, different body)",
    413: "body or input over the configured limit (checked before the whole body is buffered)",
    429: "the caller's key or tier is over its rate",
    500: "the backend failed on this input (after isolation and retry), or an unexpected server error",
    503: "admission refused: queue full, predicted wait past the deadline, no healthy worker, shutting down",
    504: "the request's deadline passed before it could be answered",
}
RETRYABLE = {429, 503}

HEADER_REQUEST_ID = {
    "description": "the caller's X-Request-ID when it sent a valid one, else the generated id",
    "schema": {"type": "string"},
}
_HEADER_RETRY_AFTER = {
    "description": "seconds to wait before retrying (retry_after_ms rounded up)",
    "schema": {"type": "integer", "minimum": 1},
}
_RATE_HEADERS = {
    "X-RateLimit-Limit": {
        "description": "the key's bucket size: the most requests it may send at once (the "
        "bucket refills at the tier's or key's rate per second)",
        "schema": {"type": "number"},
    },
    "X-RateLimit-Remaining": {
        "description": "whole requests left in the key's bucket, never above the limit",
        "schema": {"type": "number"},
    },
    "X-RateLimit-Reset": {"description": "seconds until the bucket is full again", "schema": {"type": "number"}},
}

SCHEMAS: dict[str, dict[str, Any]] = {
    "Error": {
        "type": "object",
        "description": "The one error body of the API (DESIGN §2).",
        "required": ["error", "message", "request_id"],
        "additionalProperties": False,
        "properties": {
            "error": {"type": "string", "pattern": "^[A-Z][A-Z0-9_]*$", "description": "machine-readable code"},
            "message": {"type": "string", "description": "a human sentence"},
            "request_id": {"type": "string"},
            "retry_after_ms": {
                "type": "integer",
                "minimum": 0,
                "description": "present where retrying later can help (with a Retry-After header)",
            },
        },
    },
}


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def json_content(schema: dict[str, Any]) -> dict[str, Any]:
    return {JSON: {"schema": schema}}


def error_schema(status: int) -> dict[str, Any]:
    """The Error body narrowed to the codes this status carries (so a test can check status and code agree)."""
    narrowed: dict[str, Any] = {"properties": {"error": {"enum": ERROR_CODES[status]}}}
    if status in RETRYABLE:
        narrowed["required"] = ["retry_after_ms"]
    return {"allOf": [ref("Error"), narrowed]}


def error_responses(*statuses: int) -> dict[str, Any]:
    """Response objects for these error statuses, for a contributed operation's `responses`."""
    out: dict[str, Any] = {}
    for status in statuses:
        headers: dict[str, Any] = {"X-Request-ID": HEADER_REQUEST_ID}
        if status in RETRYABLE:
            headers["Retry-After"] = _HEADER_RETRY_AFTER
        if status == 429:
            headers.update(_RATE_HEADERS)
        out[str(status)] = {
            "description": f"{' / '.join(ERROR_CODES[status])}: {ERROR_WHEN[status]}",
            "headers": headers,
            "content": json_content(error_schema(status)),
        }
    return out


@dataclass(frozen=True)
class Contribution:
    """One route module's share of the document."""

    paths: dict[str, dict[str, Any]]
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)


def ok(schema_name: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": json_content(ref(schema_name))}


def build(*contributions: Contribution) -> dict[str, Any]:
    """The whole document from these contributions (operations on one path are merged)."""
    paths: dict[str, dict[str, Any]] = {}
    schemas = copy.deepcopy(SCHEMAS)
    for c in contributions:
        for path, operations in c.paths.items():
            paths.setdefault(path, {}).update(copy.deepcopy(operations))
        schemas.update(copy.deepcopy(c.schemas))
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "batchserve",
            "version": VERSION,
            "description": "Dynamic-batching inference server: single synchronous requests in, GPU batches "
            "inside. Every error is JSON: {error, message, request_id} (plus retry_after_ms) "
            "on batchserve's own routes, OpenAI's {error: {message, type, param, code}} on "
            "/v1/embeddings, /v1/chat/completions and /v1/completions, KServe v2's {error} on "
            "/v2; a Retry-After header wherever retrying later can help.",
        },
        # OAS 3.1's own dialect (JSON Schema 2020-12 plus OpenAPI's vocabulary), its default: tools such as
        # Swagger UI refuse any other value with a warning.
        "jsonSchemaDialect": "https://spec.openapis.org/oas/3.1/dialect/base",
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "an API key, when the server has keys configured",
                }
            },
        },
        "security": [{"bearer": []}, {}],
    }
