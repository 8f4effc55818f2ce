"""The OpenAPI paths and schemas of `/v1/batches`, contributed to `/openapi.json` (see `batchserve.http.openapi`)."""

from __future__ import annotations

from typing import Any

from batchserve.http import openapi
from batchserve.http.openapi import Contribution, json_content, ok, ref

# Error codes of these routes beyond the shared table (a narrowed Error schema per status, as openapi does).
CODES = {
    404: ["BATCH_NOT_FOUND", "MODEL_NOT_FOUND", "NOT_FOUND", "FILE_NOT_FOUND"],
    503: ["DRAINING", "NO_HEALTHY_WORKER", "JOBS_UNAVAILABLE"],
}

SCHEMAS: dict[str, dict[str, Any]] = {
    "BatchRequest": {
        "type": "object",
        "required": ["inputs"],
        "properties": {
            "inputs": {
                "type": "array",
                "minItems": 1,
                "items": {"type": "string", "minLength": 1},
                "description": "at most --jobs-max-items (400 beyond); each at most --max-input-chars (413 beyond)",
            },
            "model": {
                "type": "string",
                "minLength": 1,
                "description": "as for /v1/inference; resolved once, so the whole job runs on one version",
            },
            "metadata": {"type": "object", "description": "kept with the job and returned as given (16 KiB max)"},
        },
    },
    "BatchJob": {
        "type": "object",
        "required": [
            "id",
            "object",
            "status",
            "model",
            "total",
            "completed",
            "failed",
            "cancelled",
            "pending",
            "created_at",
        ],
        "properties": {
            "id": {"type": "string", "pattern": "^batch_"},
            "object": {"const": "batch"},
            "status": {
                "enum": ["queued", "running", "completed", "failed", "cancelled"],
                "description": "completed: every item is final and at least one completed; failed: every item failed",
            },
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
            "bytes": {
                "type": "integer",
                "minimum": 0,
                "description": "what the job keeps (inputs and outputs), counted against --tenant-storage-mb",
            },
            "expires_at": {"type": ["number", "null"], "description": "deleted after this once finished"},
            "reason": {"type": "string", "description": "why the job failed whole (a storage quota)"},
        },
    },
    "OpenAIBatchRequest": {
        "type": "object",
        "description": "OpenAI's Batch API (told apart from BatchRequest by input_file_id)",
        "required": ["input_file_id", "endpoint"],
        "properties": {
            "input_file_id": {"type": "string", "description": "a file uploaded with POST /v1/files, purpose batch"},
            "endpoint": {
                "enum": ["/v1/embeddings", "/v1/inference", "/v1/chat/completions", "/v1/completions"],
                "description": "/v1/chat/completions and /v1/completions are refused (400) for now",
            },
            "completion_window": {"const": "24h"},
            "metadata": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
            "output_expires_after": ref("ExpiresAfter"),
        },
    },
    "ExpiresAfter": {
        "type": "object",
        "required": ["anchor", "seconds"],
        "properties": {
            "anchor": {"const": "created_at"},
            "seconds": {"type": "integer", "minimum": 1, "maximum": 2592000},
        },
    },
    "BatchDeleted": {
        "type": "object",
        "required": ["id", "object", "deleted"],
        "properties": {"id": {"type": "string"}, "object": {"const": "batch"}, "deleted": {"const": True}},
    },
    "OpenAIBatch": {
        "type": "object",
        "description": "OpenAI's batch object, for a job created with input_file_id",
        "required": [
            "id",
            "object",
            "endpoint",
            "input_file_id",
            "completion_window",
            "status",
            "created_at",
            "request_counts",
        ],
        "properties": {
            "id": {"type": "string", "pattern": "^batch_"},
            "object": {"const": "batch"},
            "endpoint": {"type": "string"},
            "input_file_id": {"type": "string"},
            "completion_window": {"type": "string"},
            "status": {
                "enum": ["in_progress", "completed", "cancelled", "failed"],
                "description": "failed: its outputs would have passed a storage quota (see errors)",
            },
            "errors": {"type": ["object", "null"]},
            "output_expires_at": {"type": ["integer", "null"]},
            "output_file_id": {"type": ["string", "null"], "description": "the 2xx lines, once finished"},
            "error_file_id": {"type": ["string", "null"], "description": "the other lines, once finished"},
            "created_at": {"type": "integer"},
            "request_counts": {
                "type": "object",
                "required": ["total", "completed", "failed"],
                "properties": {
                    "total": {"type": "integer"},
                    "completed": {"type": "integer"},
                    "failed": {"type": "integer"},
                },
            },
            "metadata": {"type": ["object", "null"]},
        },
    },
    "File": {
        "type": "object",
        "required": ["id", "object", "bytes", "created_at", "filename", "purpose"],
        "properties": {
            "id": {"type": "string", "pattern": "^file-"},
            "object": {"const": "file"},
            "bytes": {"type": "integer", "minimum": 0},
            "created_at": {"type": "integer"},
            "filename": {"type": "string"},
            "purpose": {"enum": ["batch", "batch_output"]},
            "status": {"const": "processed"},
            "expires_at": {"type": ["integer", "null"]},
        },
    },
    "FileList": {
        "type": "object",
        "required": ["object", "data", "has_more"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": ref("File")},
            "has_more": {"type": "boolean"},
            "first_id": {"type": ["string", "null"]},
            "last_id": {"type": ["string", "null"], "description": "pass as ?after= for the next page"},
        },
    },
    "FileDeleted": {
        "type": "object",
        "required": ["id", "object", "deleted"],
        "properties": {"id": {"type": "string"}, "object": {"const": "file"}, "deleted": {"const": True}},
    },
    "BatchJobList": {
        "type": "object",
        "required": ["object", "data", "has_more"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": {"anyOf": [ref("BatchJob"), ref("OpenAIBatch")]}},
            "has_more": {"type": "boolean"},
            "last_id": {"type": ["string", "null"], "description": "pass as ?after= for the next page"},
        },
    },
    "BatchResultLine": {
        "type": "object",
        "description": "one line of the NDJSON results, in input order",
        "required": ["index", "status"],
        "properties": {
            "index": {"type": "integer", "minimum": 0},
            "status": {"enum": ["completed", "failed", "pending", "cancelled"]},
            "output": {"description": "when completed: the backend's output, any JSON value (as on /v1/inference)"},
            "error": {
                "type": "object",
                "description": "when failed or cancelled",
                "properties": {"error": {"type": "string"}, "message": {"type": "string"}},
            },
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
FILE_ID = {"name": "file_id", "in": "path", "required": True, "schema": {"type": "string"}}


def either(description: str) -> dict[str, Any]:
    """A job in the shape it was created in."""
    return {"description": description, "content": json_content({"anyOf": [ref("BatchJob"), ref("OpenAIBatch")]})}


PATHS: dict[str, dict[str, Any]] = {
    "/v1/batches": {
        "post": {
            "operationId": "createBatch",
            "summary": "Submit a batch job: stored durably (all items) before the answer, run from spare capacity",
            "parameters": [
                {
                    "name": "Idempotency-Key",
                    "in": "header",
                    "required": False,
                    "schema": {"type": "string", "maxLength": 255},
                    "description": "a repeat with the same key and body returns the same job (200); "
                    "the same key with another body gets 409",
                }
            ],
            "requestBody": {
                "required": True,
                "content": json_content({"anyOf": [ref("BatchRequest"), ref("OpenAIBatchRequest")]}),
            },
            "responses": {
                "202": either("the new job"),
                "200": either("the job created earlier with this Idempotency-Key"),
                **errors(400, 401, 404, 409, 413, 429, 503),
            },
        },
        "get": {
            "operationId": "listBatches",
            "summary": "The caller's jobs, newest first",
            "parameters": [
                {
                    "name": "limit",
                    "in": "query",
                    "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20},
                },
                {
                    "name": "after",
                    "in": "query",
                    "schema": {"type": "string"},
                    "description": "a job id: list the jobs older than it",
                },
            ],
            "responses": {"200": ok("BatchJobList", "the caller's jobs"), **errors(400, 401, 429, 503)},
        },
    },
    "/v1/batches/{batch_id}": {
        "get": {
            "operationId": "getBatch",
            "summary": "A job's status and counts",
            "parameters": [BATCH_ID],
            "responses": {"200": either("the job"), **errors(401, 404, 429, 503)},
        },
        "delete": {
            "operationId": "deleteBatch",
            "summary": "Delete a finished job with its items and output and error files (frees its bytes)",
            "parameters": [BATCH_ID],
            "responses": {"200": ok("BatchDeleted", "deleted"), **errors(401, 404, 409, 429, 503)},
        },
    },
    "/v1/batches/{batch_id}/results": {
        "get": {
            "operationId": "batchResults",
            "summary": "One NDJSON line per item, in input order",
            "parameters": [BATCH_ID],
            "responses": {
                "200": {
                    "description": "NDJSON, one BatchResultLine per line",
                    "content": {"application/x-ndjson": {"schema": ref("BatchResultLine")}},
                },
                **errors(401, 404, 429, 503),
            },
        }
    },
    "/v1/batches/{batch_id}/cancel": {
        "post": {
            "operationId": "cancelBatch",
            "summary": "Cancel the items not yet run (a finished job is returned as it is)",
            "parameters": [BATCH_ID],
            "responses": {"200": either("the job after cancelling"), **errors(401, 404, 429, 503)},
        }
    },
    "/v1/files": {
        "post": {
            "operationId": "createFile",
            "summary": "Upload a JSONL batch input file (multipart: file, purpose=batch), OpenAI's Files API",
            "requestBody": {
                "required": True,
                "content": {
                    "multipart/form-data": {
                        "schema": {
                            "type": "object",
                            "required": ["file", "purpose"],
                            "properties": {
                                "file": {
                                    "type": "string",
                                    "format": "binary",
                                    "description": "at most --files-max-bytes (413 beyond), streamed into "
                                    "the store; 413 past the caller's --tenant-storage-mb",
                                },
                                "purpose": {"const": "batch"},
                                "expires_after[anchor]": {"const": "created_at"},
                                "expires_after[seconds]": {"type": "integer", "minimum": 1, "maximum": 2592000},
                            },
                        }
                    }
                },
            },
            "responses": {"200": ok("File", "the stored file"), **errors(400, 401, 409, 413, 429, 503)},
        },
        "get": {
            "operationId": "listFiles",
            "summary": "The caller's uploaded files, newest first",
            "parameters": [
                {
                    "name": "limit",
                    "in": "query",
                    "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20},
                },
                {"name": "after", "in": "query", "schema": {"type": "string"}},
                {"name": "purpose", "in": "query", "schema": {"type": "string"}},
            ],
            "responses": {"200": ok("FileList", "the caller's files"), **errors(400, 401, 429, 503)},
        },
    },
    "/v1/files/{file_id}": {
        "get": {
            "operationId": "getFile",
            "summary": "A file's metadata (uploads, and finished jobs' output and error files)",
            "parameters": [FILE_ID],
            "responses": {"200": ok("File", "the file"), **errors(401, 404, 429, 503)},
        },
        "delete": {
            "operationId": "deleteFile",
            "summary": "Delete an uploaded file (frees its bytes and a --files-max-count place)",
            "parameters": [FILE_ID],
            "responses": {"200": ok("FileDeleted", "deleted"), **errors(401, 404, 429, 503)},
        },
    },
    "/v1/files/{file_id}/content": {
        "get": {
            "operationId": "fileContent",
            "summary": "The file's bytes: JSONL",
            "parameters": [FILE_ID],
            "responses": {
                "200": {"description": "the file", "content": {"application/jsonl": {"schema": {"type": "string"}}}},
                **errors(401, 404, 429, 503),
            },
        }
    },
}


OPENAPI = Contribution(PATHS, SCHEMAS)
