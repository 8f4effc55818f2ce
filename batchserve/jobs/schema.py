"""The OpenAPI paths and schemas of `/v1/batches`, contributed to `/openapi.json` (see `batchserve.http.openapi`)."""

from __future__ import annotations

from typing import Any

from batchserve.http import openapi
from batchserve.http.openapi import Contribution, json_content, ok, ref

# Error codes of these routes beyond the shared table (a narrowed Error schema per status, as openapi does).
CODES = {404: ["BATCH_NOT_FOUND", "MODEL_NOT_FOUND", "NOT_FOUND"], 503: ["DRAINING", "NO_HEALTHY_WORKER",
                                                                        "JOBS_UNAVAILABLE"]}

SCHEMAS: dict[str, dict[str, Any]] = {
    "BatchRequest": {
        "type": "object",
        "required": ["inputs"],
        "properties": {
            "inputs": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1},
                       "description": "at most --jobs-max-items (400 beyond); each at most --max-input-chars "
                                      "(413 beyond)"},
            "model": {"type": "string", "minLength": 1, "description": "as for /v1/inference; resolved once, so "
                                                                       "the whole job runs on one version"},
            "metadata": {"type": "object", "description": "kept with the job and returned as given (16 KiB max)"},
        },
    },
    "BatchJob": {
        "type": "object",
        "required": ["id", "object", "status", "model", "total", "completed", "failed", "cancelled", "pending",
                     "created_at"],
        "properties": {
            "id": {"type": "string", "pattern": "^batch_"},
            "object": {"const": "batch"},
            "status": {"enum": ["queued", "running", "completed", "failed", "cancelled"],
                       "description": "completed: every item is final and at least one completed; failed: every "
                                      "item failed"},
            "model": {"type": "string", "description": "name@version running the job"},
            "total": {"type": "integer", "minimum": 1},
            "completed": {"type": "integer", "minimum": 0},
            "failed": {"type": "integer", "minimum": 0},
            "cancelled": {"type": "integer", "minimum": 0},
            "pending": {"type": "integer", "minimum": 0},
            "created_at": {"type": "number", "description": "seconds since the epoch"},
            "started_at": {"type": ["number", "null"]},
            "finished_at": {"type": ["number", "null"]},
            "metadata": {"type": ["object", "null"]},
        },
    },
    "BatchJobList": {
        "type": "object",
        "required": ["object", "data", "has_more"],
        "properties": {"object": {"const": "list"},
                       "data": {"type": "array", "items": ref("BatchJob")},
                       "has_more": {"type": "boolean"},
                       "last_id": {"type": ["string", "null"], "description": "pass as ?after= for the next page"}},
    },
    "BatchResultLine": {
        "type": "object",
        "description": "one line of the NDJSON results, in input order",
        "required": ["index", "status"],
        "properties": {
            "index": {"type": "integer", "minimum": 0},
            "status": {"enum": ["completed", "failed", "pending", "cancelled"]},
            "output": {"description": "when completed: the backend's output, any JSON value (as on /v1/inference)"},
            "error": {"type": "object", "description": "when failed or cancelled",
                      "properties": {"error": {"type": "string"}, "message": {"type": "string"}}},
        },
    },
}


def errors(*statuses: int) -> dict[str, Any]:
    out = openapi.error_responses(*statuses)
    for status, codes in CODES.items():
        if str(status) in out:
            narrowed: dict[str, Any] = {"properties": {"error": {"enum": codes}}}
            if status in openapi.RETRYABLE:
                narrowed["required"] = ["retry_after_ms"]
            out[str(status)]["content"] = json_content({"allOf": [ref("Error"), narrowed]})
    return out


BATCH_ID = {"name": "batch_id", "in": "path", "required": True, "schema": {"type": "string"}}

PATHS: dict[str, dict[str, Any]] = {
    "/v1/batches": {
        "post": {
            "operationId": "createBatch",
            "summary": "Submit a batch job: stored durably (all items) before the answer, run from spare capacity",
            "parameters": [{"name": "Idempotency-Key", "in": "header", "required": False,
                            "schema": {"type": "string", "maxLength": 255},
                            "description": "a repeat with the same key and body returns the same job (200); "
                                           "the same key with another body gets 409"}],
            "requestBody": {"required": True, "content": json_content(ref("BatchRequest"))},
            "responses": {"202": ok("BatchJob", "the new job"),
                          "200": ok("BatchJob", "the job created earlier with this Idempotency-Key"),
                          **errors(400, 401, 404, 409, 413, 429, 503)},
        },
        "get": {
            "operationId": "listBatches",
            "summary": "The caller's jobs, newest first",
            "parameters": [{"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1,
                                                                       "maximum": 100, "default": 20}},
                           {"name": "after", "in": "query", "schema": {"type": "string"},
                            "description": "a job id: list the jobs older than it"}],
            "responses": {"200": ok("BatchJobList", "the caller's jobs"), **errors(400, 401, 429, 503)},
        },
    },
    "/v1/batches/{batch_id}": {"get": {
        "operationId": "getBatch", "summary": "A job's status and counts",
        "parameters": [BATCH_ID],
        "responses": {"200": ok("BatchJob", "the job"), **errors(401, 404, 429, 503)},
    }},
    "/v1/batches/{batch_id}/results": {"get": {
        "operationId": "batchResults", "summary": "One NDJSON line per item, in input order",
        "parameters": [BATCH_ID],
        "responses": {"200": {"description": "NDJSON, one BatchResultLine per line",
                              "content": {"application/x-ndjson": {"schema": ref("BatchResultLine")}}},
                      **errors(401, 404, 429, 503)},
    }},
    "/v1/batches/{batch_id}/cancel": {"post": {
        "operationId": "cancelBatch",
        "summary": "Cancel the items not yet run (a finished job is returned as it is)",
        "parameters": [BATCH_ID],
        "responses": {"200": ok("BatchJob", "the job after cancelling"), **errors(401, 404, 429, 503)},
    }},
}


OPENAPI = Contribution(PATHS, SCHEMAS)
