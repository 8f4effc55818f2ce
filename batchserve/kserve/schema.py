"""OpenAPI paths and schemas of KServe's v2 routes (`kserve/routes.py`), contributed to /openapi.json.
v2's own shapes, errors included (`{"error": message}`)."""

from __future__ import annotations

from typing import Any

from batchserve.http.openapi import Contribution, json_content, ref
from batchserve.kserve.wire import MAX_ELEMENTS

TENSOR_META = {
    "type": "object",
    "required": ["name", "datatype", "shape"],
    "properties": {
        "name": {"type": "string"},
        "datatype": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer"}},
    },
}

SCHEMAS: dict[str, dict[str, Any]] = {
    "V2Error": {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"type": "string"}},
        "description": "KServe v2's error body",
    },
    "V2Live": {"type": "object", "required": ["live"], "properties": {"live": {"const": True}}},
    "V2Ready": {
        "type": "object",
        "required": ["ready"],
        "properties": {
            "ready": {"type": "boolean"},
            "name": {"type": "string"},
            "reason": {"type": "string", "description": "why not, when not ready"},
        },
    },
    "V2ServerMetadata": {
        "type": "object",
        "required": ["name", "version", "extensions"],
        "properties": {
            "name": {"type": "string"},
            "version": {"type": "string"},
            "extensions": {"type": "array", "items": {"type": "string"}},
        },
    },
    "V2ModelMetadata": {
        "type": "object",
        "required": ["name", "versions", "platform", "inputs", "outputs"],
        "properties": {
            "name": {"type": "string"},
            "versions": {"type": "array", "items": {"type": "string"}},
            "platform": {"type": "string"},
            "inputs": {"type": "array", "items": TENSOR_META},
            "outputs": {"type": "array", "items": TENSOR_META},
        },
    },
    "V2InferRequest": {
        "type": "object",
        "required": ["inputs"],
        "description": f"One BYTES input named `input`; each element (1 to {MAX_ELEMENTS}) is one item on the "
        "batcher. With the binary extension the JSON is followed by the tensor "
        "(Inference-Header-Content-Length).",
        "properties": {
            "id": {"type": "string"},
            "parameters": {
                "type": "object",
                "properties": {
                    "timeout": {"type": "number", "description": "the request's deadline in microseconds"},
                    "binary_data_output": {"type": "boolean"},
                },
            },
            "inputs": {
                "type": "array",
                "minItems": 1,
                "maxItems": 1,
                "items": {
                    "type": "object",
                    "required": ["name", "datatype", "shape"],
                    "properties": {
                        "name": {"const": "input"},
                        "datatype": {"const": "BYTES"},
                        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                        "parameters": {"type": "object"},
                        "data": {"type": "array", "description": "strings, flat or nested by the shape"},
                    },
                },
            },
            "outputs": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"name": {"const": "output"}, "parameters": {"type": "object"}},
                },
            },
        },
    },
    "V2InferResponse": {
        "type": "object",
        "required": ["model_name", "outputs"],
        "properties": {
            "model_name": {"type": "string"},
            "model_version": {"type": "string"},
            "id": {"type": "string"},
            "outputs": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["name", "datatype", "shape"],
                    "properties": {
                        "name": {"const": "output"},
                        "datatype": {"enum": ["BYTES", "FP32"]},
                        "shape": {"type": "array", "items": {"type": "integer"}},
                        "data": {"type": "array"},
                        "parameters": {"type": "object"},
                    },
                },
            },
        },
    },
}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): {"description": "v2 error", "content": json_content(ref("V2Error"))} for s in statuses}


def _get(op: str, summary: str, schema: str, *statuses: int) -> dict[str, Any]:
    return {
        "get": {
            "operationId": op,
            "summary": summary,
            "tags": ["KServe v2"],
            "responses": {"200": {"description": summary, "content": json_content(ref(schema))}, **_errors(*statuses)},
        }
    }


def _ready(op: str, summary: str, *statuses: int) -> dict[str, Any]:
    doc = _get(op, summary, "V2Ready", *statuses)
    doc["get"]["responses"]["400"] = {
        "description": "not ready (v2: a 4xx means false)",
        "content": json_content(ref("V2Ready")),
    }
    return doc


def _infer(op: str) -> dict[str, Any]:
    return {
        "post": {
            "operationId": op,
            "summary": "KServe v2 infer: each element of the BYTES input rides the batcher",
            "tags": ["KServe v2"],
            "requestBody": {
                "required": True,
                "content": {**json_content(ref("V2InferRequest")), "application/octet-stream": {"schema": {}}},
            },
            "responses": {
                "200": {
                    "description": "the output tensor: BYTES, or FP32 [..., dim] for embedding models; "
                    "binary when asked (Inference-Header-Content-Length)",
                    "content": {**json_content(ref("V2InferResponse")), "application/octet-stream": {"schema": {}}},
                },
                **_errors(400, 401, 404, 413, 429, 500, 503, 504),
            },
        }
    }


def _params(path: str, doc: dict[str, Any]) -> dict[str, Any]:
    """Declare the path's {model} and {version} on its operation."""
    names = [n for n in ("model", "version") if f"{{{n}}}" in path]
    for op in doc.values():
        op["parameters"] = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}} for n in names]
    return doc


PATHS: dict[str, dict[str, Any]] = {
    "/v2/health/live": _get("v2ServerLive", "KServe v2 server liveness", "V2Live"),
    "/v2/health/ready": _ready("v2ServerReady", "KServe v2 server readiness"),
    "/v2": _get("v2ServerMetadata", "KServe v2 server metadata", "V2ServerMetadata"),
    "/v2/models/{model}": _get("v2ModelMetadata", "KServe v2 model metadata", "V2ModelMetadata", 404),
    "/v2/models/{model}/versions/{version}": _get(
        "v2ModelVersionMetadata", "KServe v2 model version metadata", "V2ModelMetadata", 404
    ),
    "/v2/models/{model}/ready": _ready("v2ModelReady", "KServe v2 model readiness", 404),
    "/v2/models/{model}/versions/{version}/ready": _ready(
        "v2ModelVersionReady", "KServe v2 model version readiness", 404
    ),
    "/v2/models/{model}/infer": _infer("v2ModelInfer"),
    "/v2/models/{model}/versions/{version}/infer": _infer("v2ModelVersionInfer"),
}

PATHS = {path: _params(path, doc) if "{" in path else doc for path, doc in PATHS.items()}

OPENAPI = Contribution(PATHS, SCHEMAS)
