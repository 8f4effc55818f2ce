"""The OpenAPI 3.1 document served at `GET /openapi.json` (DESIGN §2).

Written by hand, next to the contract, so that the schemas say exactly what DESIGN §2 promises (tests check
live answers against them). Modules that add routes contribute their own paths and schemas at import time:

    from batchserve import openapi
    openapi.add_paths({"/v1/batches": {"post": {...}}}, schemas={"BatchJob": {...}})

and may refer to the shared pieces with `openapi.ref("Error")` and `openapi.error_responses(400, 404, ...)`.
"""

from __future__ import annotations

import copy
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

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
    500: ["INFERENCE_FAILED"],
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
    500: "the backend failed on this input (after isolation and retry)",
    503: "admission refused: queue full, predicted wait past the deadline, no healthy worker, shutting down",
    504: "the request's deadline passed before it could be answered",
}
RETRYABLE = {429, 503}

_HEADER_REQUEST_ID = {"description": "the caller's X-Request-ID when it sent a valid one, else the generated id",
                      "schema": {"type": "string"}}
_HEADER_RETRY_AFTER = {"description": "seconds to wait before retrying (retry_after_ms rounded up)",
                       "schema": {"type": "integer", "minimum": 1}}
_RATE_HEADERS = {
    "X-RateLimit-Limit": {"description": "the key's bucket size: the most requests it may send at once (the "
                                         "bucket refills at the tier's or key's rate per second)",
                          "schema": {"type": "number"}},
    "X-RateLimit-Remaining": {"description": "whole requests left in the key's bucket, never above the limit",
                              "schema": {"type": "number"}},
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
            "retry_after_ms": {"type": "integer", "minimum": 0,
                               "description": "present where retrying later can help (with a Retry-After header)"},
        },
    },
    "InferenceRequest": {
        "type": "object",
        "required": ["input"],
        "properties": {
            "input": {"type": "string", "minLength": 1,
                      "description": "the input text; longer than --max-input-chars (default 16384) gets 413"},
            "model": {"type": "string", "minLength": 1,
                      "description": "`name` (versions split by weight) or `name@version`; default model if absent"},
            "timeout_ms": {"type": "number", "exclusiveMinimum": 0,
                           "description": "the request's deadline in ms, at most --max-timeout-ms "
                                          "(default 60000); default --timeout-ms (2000)"},
        },
    },
    "InferenceResponse": {
        "type": "object",
        "required": ["request_id", "output", "model", "latency_ms", "queue_ms", "compute_ms", "batch_size"],
        "properties": {
            "request_id": {"type": "string"},
            "output": {"type": "string"},
            "model": {"type": "string", "description": "name@version that served it"},
            "latency_ms": {"type": "integer", "minimum": 0},
            "queue_ms": {"type": "integer", "minimum": 0},
            "compute_ms": {"type": "integer", "minimum": 0},
            "batch_size": {"type": "integer", "minimum": 1},
        },
    },
    "RequestStatus": {
        "type": "object",
        "required": ["request_id", "model", "status", "created_at"],
        "properties": {
            "request_id": {"type": "string"},
            "model": {"type": "string"},
            "status": {"enum": ["queued", "processing", "completed", "failed"]},
            "created_at": {"type": "number", "description": "seconds since the epoch"},
            "latency_ms": {"type": ["number", "null"]},
            "queue_ms": {"type": ["number", "null"]},
            "compute_ms": {"type": ["number", "null"]},
            "batch_size": {"type": ["integer", "null"]},
            "error": {"type": ["string", "null"], "description": "the error code when failed"},
        },
    },
    "Model": {
        "type": "object",
        "required": ["id", "object"],
        "properties": {
            "id": {"type": "string", "description": "name@version"},
            "object": {"const": "model"},
            "owned_by": {"type": "string"},
            "name": {"type": "string"},
            "version": {"type": "string"},
            "backend": {"type": "string"},
            "weight": {"type": "number"},
        },
    },
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"const": "list"},
                       "data": {"type": "array", "items": {"$ref": "#/components/schemas/Model"}}},
    },
    "Liveness": {
        "type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}},
    },
    "Readiness": {
        "type": "object",
        "required": ["status", "healthy_workers"],
        "properties": {
            "status": {"enum": ["ready", "not_ready"]},
            "reason": {"type": "string", "description": "why not ready: warming up, draining, no healthy worker"},
            "healthy_workers": {"type": "integer", "minimum": 0},
        },
    },
    "Worker": {
        "type": "object",
        "required": ["id", "device", "healthy", "busy"],
        "properties": {
            "id": {"type": "integer"},
            "device": {"type": "string"},
            "healthy": {"type": "boolean"},
            "busy": {"type": "boolean"},
            "batch_size": {"type": "integer", "minimum": 0},
            "running_ms": {"type": "integer", "minimum": 0},
            "batches": {"type": "integer", "minimum": 0},
            "busy_ratio": {"type": "number", "minimum": 0, "maximum": 1},
        },
    },
    "InternalHealth": {
        "type": "object",
        "required": ["status", "gpu_utilization", "queue_depth", "requests_per_second", "workers"],
        "properties": {
            "status": {"enum": ["ok", "degraded", "unavailable", "draining", "starting"]},
            "gpu_utilization": {"type": "number", "minimum": 0, "maximum": 1},
            "queue_depth": {"type": "integer", "minimum": 0},
            "requests_per_second": {"type": "number", "minimum": 0},
            "inflight": {"type": "integer", "minimum": 0},
            "batch_ms": {"type": "object", "additionalProperties": {"type": "number"},
                         "description": "learned batch time per model id"},
            "slo_ms": {"type": "number", "description": "the SLO in force (set, or derived from the warm-up)"},
            "timeout_ms": {"type": "number", "description": "the default deadline in force (set, or derived)"},
            "gpu_timeout_ms": {"type": ["integer", "null"]},
            "workers": {"type": "array", "items": {"$ref": "#/components/schemas/Worker"}},
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
        headers: dict[str, Any] = {"X-Request-ID": _HEADER_REQUEST_ID}
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


def _ok(schema_name: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": json_content(ref(schema_name))}


_DEFAULT_ERROR = {"default": {"description": "any other error, in the one error shape",
                              "content": json_content(ref("Error"))}}


def _inference_op(operation_id: str, summary: str) -> dict[str, Any]:
    return {
        "operationId": operation_id,
        "summary": summary,
        "parameters": [{"name": "X-Request-ID", "in": "header", "required": False,
                        "description": "echoed back when it matches ^[A-Za-z0-9._:-]{1,128}$",
                        "schema": {"type": "string"}}],
        "requestBody": {"required": True, "content": json_content(ref("InferenceRequest"))},
        "responses": {
            "200": {
                "description": "the input's output",
                "headers": {"X-Request-ID": _HEADER_REQUEST_ID,
                            "Server-Timing": {"description": "queue;dur=<ms>, compute;dur=<ms>",
                                              "schema": {"type": "string"}}},
                "content": json_content(ref("InferenceResponse")),
            },
            **error_responses(400, 401, 404, 413, 429, 500, 503, 504),
            **_DEFAULT_ERROR,
        },
    }


PATHS: dict[str, dict[str, Any]] = {
    "/v1/inference": {"post": _inference_op("inference", "One input, one synchronous answer")},
    "/api/inference": {"post": _inference_op("inferenceAlias", "Same as POST /v1/inference")},
    "/v1/requests/{request_id}": {"get": {
        "operationId": "requestStatus",
        "summary": "Status of a recent request on this node, with timings",
        "parameters": [{"name": "request_id", "in": "path", "required": True, "schema": {"type": "string"}}],
        "responses": {"200": _ok("RequestStatus", "the request's status"), **error_responses(404),
                      **_DEFAULT_ERROR},
    }},
    "/v1/models": {"get": {
        "operationId": "listModels",
        "summary": "The models and versions served here (OpenAI list shape)",
        "responses": {"200": _ok("ModelList", "the served models"), **_DEFAULT_ERROR},
    }},
    "/healthz": {"get": {
        "operationId": "healthz", "summary": "Liveness: the process answers", "security": [],
        "responses": {"200": _ok("Liveness", "alive")},
    }},
    "/readyz": {"get": {
        "operationId": "readyz", "security": [],
        "summary": "Readiness: models warmed, at least one healthy worker, not draining",
        "responses": {"200": _ok("Readiness", "ready"),
                      "503": _ok("Readiness", "not ready (status not_ready, with the reason)")},
    }},
    "/internal/health": {"get": {
        "operationId": "internalHealth", "summary": "Workers, queue depth, utilisation and rate", "security": [],
        "responses": {"200": _ok("InternalHealth", "the node's health")},
    }},
    "/metrics": {"get": {
        "operationId": "metrics", "summary": "Prometheus metrics (batchserve_ prefix)", "security": [],
        "responses": {"200": {"description": "Prometheus text exposition format",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}},
    }},
    "/openapi.json": {"get": {
        "operationId": "openapi", "summary": "This document", "security": [],
        "responses": {"200": {"description": "OpenAPI 3.1", "content": json_content({"type": "object"})}},
    }},
}


def add_paths(paths: dict[str, dict[str, Any]], schemas: dict[str, dict[str, Any]] | None = None) -> None:
    """Contribute routes (and their schemas) from another module; operations on one path are merged."""
    for path, operations in paths.items():
        PATHS.setdefault(path, {}).update(operations)
    SCHEMAS.update(schemas or {})


def document() -> dict[str, Any]:
    """The whole document, built from what every module has contributed so far."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "batchserve", "version": VERSION,
                 "description": "Dynamic-batching inference server: single synchronous requests in, GPU batches "
                                "inside. Every error is JSON {error, message, request_id} plus retry_after_ms "
                                "and Retry-After where retrying later can help."},
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "paths": copy.deepcopy(PATHS),
        "components": {
            "schemas": copy.deepcopy(SCHEMAS),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "an API key, when the server has keys configured"}},
        },
        "security": [{"bearer": []}, {}],
    }


async def openapi_json(request: Request) -> Response:
    return Response(orjson.dumps(document()), media_type=JSON)
