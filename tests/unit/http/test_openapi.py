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


def test_the_generated_document_is_valid_openapi():
    """openapi-spec-validator over the whole document: every path, parameter, response and $ref."""
    from openapi_spec_validator import validate as validate_spec

    from batchserve.app import openapi_document

    validate_spec(openapi_document())


def test_every_schema_is_generated_from_a_declared_type():
    """No hand-written schema: each component is msgspec's rendering of a Struct of that name in a wing's
    `shapes.py` (or a per-status native error generated from `http/shapes.Error`)."""
    import importlib
    import pkgutil

    import msgspec

    import batchserve
    from batchserve.app import openapi_document

    declared: dict[str, type] = {}
    for info in pkgutil.walk_packages(batchserve.__path__, prefix="batchserve."):
        if info.name.endswith(".shapes"):
            module = importlib.import_module(info.name)
            for value in vars(module).values():
                if isinstance(value, type) and issubclass(value, msgspec.Struct) and value.__module__ == info.name:
                    declared[value.__name__] = value
    components = openapi_document()["components"]["schemas"]
    for name, schema in components.items():
        if name.startswith("Error") and name[5:].isdigit():
            continue
        assert name in declared, f"{name} is not a declared shape"
        assert schema == msgspec.json.schema_components([declared[name]], ref_template="#/components/schemas/{name}")[
            1
        ][name]


def test_each_dialect_renders_its_declared_error_shape():
    """The error bodies each dialect renders decode as the declared shapes (unknown members refused)."""
    import msgspec

    from batchserve import errors
    from batchserve.http import shapes
    from batchserve.http.dialects import KSERVE, NATIVE, OPENAI
    from batchserve.http.openai_error import bad
    from batchserve.kserve.shapes import V2Error

    kinds = (errors.invalid("x"), errors.overloaded("busy", 250), errors.draining(), errors.internal_error())
    for err in kinds:
        body, headers = NATIVE.render(err, "req_1")
        decoded = msgspec.json.decode(body, type=shapes.Error)
        assert decoded.error == err.code and decoded.request_id == "req_1"
        if err.status in (429, 503):
            assert decoded.retry_after_ms is not msgspec.UNSET and "Retry-After" in headers
    for err in (*kinds, bad("input", "bad", "invalid_value")):
        msgspec.json.decode(OPENAI.render(err, "req_1")[0], type=shapes.OpenAIError)
        msgspec.json.decode(KSERVE.render(err, "req_1")[0], type=V2Error)


def test_the_usage_shape_counts_every_outcome_of_the_ledger():
    import msgspec

    from batchserve.core.ledger import OUTCOMES
    from batchserve.http.shapes import ByOutcome

    assert tuple(f.name for f in msgspec.structs.fields(ByOutcome)) == OUTCOMES
