"""The OpenAPI paths and schemas of the inference and operational routes (`inference/routes.py`, `ops/routes.py`)."""

from __future__ import annotations

from typing import Any

from batchserve.http.openapi import HEADER_REQUEST_ID, Contribution, error_responses, json_content, ok, ref

_SCHEMAS: dict[str, dict[str, Any]] = {
    "InferenceRequest": {
        "type": "object",
        "required": ["input"],
        "properties": {
            "input": {
                "type": "string",
                "minLength": 1,
                "description": "the input text; longer than --max-input-chars (default 16384) gets 413",
            },
            "model": {
                "type": "string",
                "minLength": 1,
                "description": "`name` (versions split by weight) or `name@version`; default model if absent",
            },
            "timeout_ms": {
                "type": "number",
                "exclusiveMinimum": 0,
                "description": "the request's deadline in ms, at most --max-timeout-ms "
                "(default 60000); default --timeout-ms (2000)",
            },
        },
    },
    "InferenceResponse": {
        "type": "object",
        "required": ["request_id", "output", "model", "latency_ms", "queue_ms", "compute_ms", "batch_size"],
        "properties": {
            "request_id": {"type": "string"},
            "output": {
                "description": "the backend's output for this input, any JSON value: a string for text "
                "models (sim, smollm2), 384 numbers for minilm, what a plugin returns"
            },
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
            "output_kind": {
                "enum": ["text", "json", "embedding", None],
                "description": "what the backend's outputs are; embedding models also serve "
                "POST /v1/embeddings (null while the backends load)",
            },
        },
    },
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": {"$ref": "#/components/schemas/Model"}},
        },
    },
    "Liveness": {
        "type": "object",
        "required": ["status"],
        "properties": {"status": {"const": "ok"}},
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
            "batch_ms": {
                "type": "object",
                "additionalProperties": {"type": "number"},
                "description": "learned batch time of a full batch, per model id the batcher serves",
            },
            "answer_ms": {
                "type": "object",
                "additionalProperties": {"type": "number"},
                "description": "per model id whose /v1/inference the generation engine's stepper answers "
                "(--inference-path stepper): the time an answer takes once it has "
                "started, (--max-new-tokens + 2) decode steps at the learned step time",
            },
            "inference_path": {
                "type": "object",
                "additionalProperties": {"enum": ["batcher", "stepper"]},
                "description": "per model id: what answers its /v1/inference",
            },
            "batch_ms_by_size": {
                "type": "object",
                "additionalProperties": {"type": "object", "additionalProperties": {"type": "number"}},
                "description": "per model id: measured batch time by (mean) batch size, one "
                "entry per power-of-two size bucket",
            },
            "slo_ms": {"type": "number", "description": "the SLO in force (set, or derived from the warm-up)"},
            "timeout_ms": {"type": "number", "description": "the default deadline in force (set, or derived)"},
            "gpu_timeout_ms": {"type": ["integer", "null"]},
            "load_ratio": {
                "type": "number",
                "minimum": 0,
                "description": "arrivals over the healthy workers' full-batch capacity, or (when "
                "larger) the generation engine's sequences over its slots (1 = the "
                "ceiling)",
            },
            "predicted_wait_ratio": {
                "type": "number",
                "minimum": 0,
                "description": "a new request's predicted wait for its batch over slo - "
                "batch time, or (when larger) a new sequence's predicted wait "
                "for an engine slot over slo - answer time",
            },
            "workers": {"type": "array", "items": {"$ref": "#/components/schemas/Worker"}},
            "pid": {"type": "integer", "description": "the server process that answered"},
            "process": {
                "type": ["object", "null"],
                "description": "with --processes: which child answered, of how many, and the port where "
                "it alone answers (its own /metrics, /readyz, /internal/health)",
                "properties": {
                    "index": {"type": "integer", "minimum": 0},
                    "of": {"type": "integer", "minimum": 1},
                    "own_port": {"type": "integer", "minimum": 1},
                },
            },
        },
    },
}


_DEFAULT_ERROR = {
    "default": {"description": "any other error, in the one error shape", "content": json_content(ref("Error"))}
}


def _inference_op(operation_id: str, summary: str) -> dict[str, Any]:
    return {
        "operationId": operation_id,
        "summary": summary,
        "parameters": [
            {
                "name": "X-Request-ID",
                "in": "header",
                "required": False,
                "description": "echoed back when it matches ^[A-Za-z0-9._:-]{1,128}$",
                "schema": {"type": "string"},
            }
        ],
        "requestBody": {"required": True, "content": json_content(ref("InferenceRequest"))},
        "responses": {
            "200": {
                "description": "the input's output",
                "headers": {
                    "X-Request-ID": HEADER_REQUEST_ID,
                    "Server-Timing": {"description": "queue;dur=<ms>, compute;dur=<ms>", "schema": {"type": "string"}},
                },
                "content": json_content(ref("InferenceResponse")),
            },
            **error_responses(400, 401, 404, 413, 429, 500, 503, 504),
            **_DEFAULT_ERROR,
        },
    }


_PATHS: dict[str, dict[str, Any]] = {
    "/v1/inference": {"post": _inference_op("inference", "One input, one synchronous answer")},
    "/api/inference": {"post": _inference_op("inferenceAlias", "Same as POST /v1/inference")},
    "/v1/requests/{request_id}": {
        "get": {
            "operationId": "requestStatus",
            "summary": "Status of a recent request on this node, with timings",
            "parameters": [{"name": "request_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": ok("RequestStatus", "the request's status"), **error_responses(404), **_DEFAULT_ERROR},
        }
    },
    "/v1/models": {
        "get": {
            "operationId": "listModels",
            "summary": "The models and versions served here (OpenAI list shape)",
            "responses": {"200": ok("ModelList", "the served models"), **_DEFAULT_ERROR},
        }
    },
    "/healthz": {
        "get": {
            "operationId": "healthz",
            "summary": "Liveness: the process answers",
            "security": [],
            "responses": {"200": ok("Liveness", "alive")},
        }
    },
    "/readyz": {
        "get": {
            "operationId": "readyz",
            "security": [],
            "summary": "Readiness: models warmed, at least one healthy worker, not draining",
            "responses": {
                "200": ok("Readiness", "ready"),
                "503": ok("Readiness", "not ready (status not_ready, with the reason)"),
            },
        }
    },
    "/health": {
        "get": {
            "operationId": "health",
            "security": [],
            "summary": "Serving: the name vLLM, TGI, TEI and Infinity use (load generators such as guidellm probe it); "
            "the same answer as /readyz",
            "responses": {
                "200": ok("Readiness", "serving"),
                "503": ok("Readiness", "not serving (status not_ready, with the reason)"),
            },
        }
    },
    "/internal/health": {
        "get": {
            "operationId": "internalHealth",
            "summary": "Workers, queue depth, utilisation and rate",
            "security": [],
            "responses": {"200": ok("InternalHealth", "the node's health")},
        }
    },
    "/metrics": {
        "get": {
            "operationId": "metrics",
            "summary": "Prometheus metrics (batchserve_ prefix)",
            "security": [],
            "responses": {
                "200": {
                    "description": "Prometheus text exposition format",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                }
            },
        }
    },
    "/openapi.json": {
        "get": {
            "operationId": "openapi",
            "summary": "This document",
            "security": [],
            "responses": {"200": {"description": "OpenAPI 3.1", "content": json_content({"type": "object"})}},
        }
    },
}

INFERENCE_PATHS = ("/v1/inference", "/api/inference", "/v1/requests/{request_id}", "/v1/models")
INFERENCE = Contribution(
    {p: _PATHS[p] for p in INFERENCE_PATHS},
    {
        k: v
        for k, v in _SCHEMAS.items()
        if k in ("InferenceRequest", "InferenceResponse", "RequestStatus", "Model", "ModelList")
    },
)
OPS = Contribution(
    {p: v for p, v in _PATHS.items() if p not in INFERENCE_PATHS},
    {k: v for k, v in _SCHEMAS.items() if k in ("Liveness", "Readiness", "Worker", "InternalHealth")},
)
