"""The published OpenAPI document in process: an InferenceResponse output may be any JSON value (the live document
is tests/integration/http/test_openapi.py)."""

from __future__ import annotations

from pathlib import Path

import jsonschema


def validate(doc: dict, schema: dict, value: object) -> None:
    jsonschema.Draft202012Validator({**doc, **schema}).validate(value)  # the document is the root for $refs


def test_json_outputs_in_the_inference_schema(tmp_path: Path):
    """An output may be any JSON value: the published InferenceResponse does not narrow it to a string."""
    from batchserve.app import openapi_document

    doc = openapi_document()
    schema = {"$ref": "#/components/schemas/InferenceResponse"}
    base = {"request_id": "r", "model": "m@v1", "latency_ms": 1, "queue_ms": 0, "compute_ms": 1, "batch_size": 1}
    for output in ("text", [0.1, -0.2], {"label": "positive", "score": 0.5}, 3, None):
        validate(doc, schema, {**base, "output": output})
