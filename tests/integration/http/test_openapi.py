"""`GET /openapi.json` (issue 3 §7): a valid OpenAPI 3.1 document that names every route the app serves, and
whose schemas the live answers actually match."""

from __future__ import annotations

from typing import Any

import httpx
import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.routing import Route

from batchserve.config import Settings
from tests.conftest import LiveServer, start_server


@pytest.fixture(scope="module")
def server():
    s = start_server("--devices", "1", "--sim-batch-ms", "5")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def doc(server: LiveServer) -> dict[str, Any]:
    with server.client() as c:
        r = c.get("/openapi.json")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    return r.json()


def validate(doc: dict[str, Any], schema: dict[str, Any], value: Any) -> None:
    jsonschema.Draft202012Validator({**doc, **schema}).validate(value)  # the document is the root for $refs


def response_schema(doc: dict[str, Any], path: str, method: str, status: int) -> dict[str, Any]:
    return doc["paths"][path][method]["responses"][str(status)]["content"]["application/json"]["schema"]


def test_document_is_openapi_3_1_with_valid_schemas(doc):
    assert doc["openapi"].startswith("3.1")
    assert doc["info"]["title"] and doc["info"]["version"]
    for schema in doc["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)  # raises, naming the bad keyword
    for path, operations in doc["paths"].items():
        assert path.startswith("/")
        for method, op in operations.items():
            assert method in {"get", "post", "put", "patch", "delete"}, (path, method)
            assert op.get("responses"), (path, method)


def test_every_route_of_the_app_is_documented(doc):
    """A route added to the app without a contributed path (an openapi.Contribution of its wing) fails here."""
    from batchserve.app import create_app  # the whole app's imports: only this test needs them in the test process

    app = create_app(Settings())
    missing = []
    for route in app.routes:
        if not isinstance(route, Route):
            continue
        for method in sorted((route.methods or set()) - {"HEAD"}):
            if method.lower() not in doc["paths"].get(route.path, {}):
                missing.append(f"{method} {route.path}")
    assert not missing, f"routes missing from /openapi.json: {missing}"


def test_live_answers_match_the_published_schemas(server, doc):
    with server.client() as c:
        r = c.post("/v1/inference", json={"input": "schema"}, headers={"x-request-id": "openapi-1"})
        assert r.status_code == 200
        validate(doc, response_schema(doc, "/v1/inference", "post", 200), r.json())
        assert r.headers["x-request-id"] == "openapi-1" and r.headers["server-timing"].startswith("queue;dur=")

        r = c.get("/v1/requests/openapi-1")
        validate(doc, response_schema(doc, "/v1/requests/{request_id}", "get", 200), r.json())
        r = c.get("/v1/requests/nobody")
        assert r.status_code == 404
        validate(doc, response_schema(doc, "/v1/requests/{request_id}", "get", 404), r.json())

        for path in ("/healthz", "/readyz", "/internal/health", "/v1/models"):
            r = c.get(path)
            assert r.status_code == 200, path
            validate(doc, response_schema(doc, path, "get", 200), r.json())

        r = c.post("/v1/inference", json={"input": "x", "model": "nope"})
        assert r.status_code == 404
        validate(doc, response_schema(doc, "/v1/inference", "post", 404), r.json())
        assert r.json()["error"] == "MODEL_NOT_FOUND"


def test_error_schema_is_exactly_the_contract(doc):
    """docs/contract.md#errors: {"error", "message", "request_id"} plus optional retry_after_ms, nothing else."""
    error = doc["components"]["schemas"]["Error"]
    assert set(error["required"]) == {"error", "message", "request_id"}
    assert set(error["properties"]) == {"error", "message", "request_id", "retry_after_ms"}
    assert error["additionalProperties"] is False
    ok = {"error": "INVALID_REQUEST", "message": "m", "request_id": "r"}
    validate(doc, {"$ref": "#/components/schemas/Error"}, ok)
    validate(doc, {"$ref": "#/components/schemas/Error"}, {**ok, "retry_after_ms": 10})
    with pytest.raises(jsonschema.ValidationError):
        validate(doc, {"$ref": "#/components/schemas/Error"}, {**ok, "detail": "x"})
    with pytest.raises(jsonschema.ValidationError):  # a 503 must say when to come back
        validate(doc, response_schema(doc, "/v1/inference", "post", 503), {**ok, "error": "DRAINING"})


def test_metrics_and_document_routes(server, doc):
    """The two answers that are not JSON objects with a schema: each in its documented media type."""
    with server.client() as c:
        c.post("/v1/inference", json={"input": "count me"})
        r = c.get("/metrics")
        assert r.status_code == 200
        assert r.headers["content-type"].split(";")[0] in response_content(doc, "/metrics")
        families = {f.name: f for f in text_string_to_metric_families(r.text)}  # raises on malformed text
        assert {"batchserve_requests", "batchserve_request_duration_seconds", "batchserve_queue_depth"} <= set(families)
        assert any(
            s.name == "batchserve_requests_total" and s.labels.get("status") == "200" and s.value >= 1
            for s in families["batchserve_requests"].samples
        )
        r = httpx.get(server.url + "/openapi.json")
        assert r.headers["content-type"].split(";")[0] in response_content(doc, "/openapi.json")
        assert r.json() == doc


def response_content(doc: dict[str, Any], path: str) -> dict[str, Any]:
    return doc["paths"][path]["get"]["responses"]["200"]["content"]
