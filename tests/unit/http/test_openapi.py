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
        assert (
            schema
            == msgspec.json.schema_components([declared[name]], ref_template="#/components/schemas/{name}")[1][name]
        )


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


def skeleton_statuses(endpoint: object) -> set[int]:
    """What the one request path answers on a route by its declaration alone (`http/endpoint.Endpoint`): 401
    where it identifies callers or asks the metrics key, 429 where it takes rate tokens, 400 and 413 where it
    reads and parses a body."""
    from batchserve.http.endpoint import Endpoint

    assert isinstance(endpoint, Endpoint)
    out = {401} if endpoint.identify or endpoint.ops_key else set()
    if endpoint.identify and endpoint.rate:
        out.add(429)
    if endpoint.body:
        out |= {400, 413}
    return out


def test_every_operation_declares_what_the_skeleton_answers_on_its_route_and_no_default():
    """The document lists each operation's statuses and no `default` (so the property-based run's status check
    means something): at least every status the route's `Endpoint` can answer, 500 on every one."""
    from starlette.routing import Route

    from batchserve.app import WINGS, openapi_document
    from batchserve.http.endpoint import Endpoint

    paths = openapi_document()["paths"]
    checked = 0
    for routes, _ in WINGS:
        for route in routes:
            assert isinstance(route, Route)
            for method in route.methods or ():
                if method == "HEAD":
                    continue
                responses = paths[route.path][method.lower()]["responses"]
                assert "default" not in responses and "500" in responses, (method, route.path)
                if isinstance(route.endpoint, Endpoint):
                    missing = skeleton_statuses(route.endpoint) - {int(s) for s in responses}
                    assert not missing, f"{method} {route.path} answers {sorted(missing)} undeclared"
                    checked += 1
    assert checked >= 30, checked


def test_the_skeleton_statuses_read_the_declaration():
    from batchserve.http.dialects import NATIVE
    from batchserve.http.endpoint import Endpoint, no_body, operational, public

    async def handle(rt, call, req):
        return None

    assert skeleton_statuses(public(NATIVE, handle, no_body)) == set()
    assert skeleton_statuses(operational(NATIVE, handle, no_body)) == {401}
    assert skeleton_statuses(Endpoint(NATIVE, no_body, handle, no_body)) == {400, 401, 413, 429}
    assert skeleton_statuses(Endpoint(NATIVE, no_body, handle, no_body, rate=False, body=False)) == {401}
