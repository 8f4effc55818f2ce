"""The one ApiError rendered in each dialect (`http/dialects.py`): every kind of error the factories make, in the
native shape (docs/contract.md#errors), OpenAI's and KServe v2's, with the same headers in all three."""

from __future__ import annotations

import orjson
import pytest

from batchserve import errors
from batchserve.errors import ApiError
from batchserve.http.dialects import KSERVE, NATIVE, OPENAI, error_response
from batchserve.http.openai_error import bad, unknown_model

KINDS: dict[str, ApiError] = {
    "invalid": errors.invalid("'input' must be a string"),
    "unauthorized": errors.unauthorized("no key"),
    "model_not_found": errors.model_not_found("nope"),
    "payload_too_large": errors.payload_too_large("too big"),
    "rate_limited": errors.rate_limited("slow down", 1500, {"X-RateLimit-Remaining": "0"}),
    "internal": errors.internal_error(),
    "inference_failed": errors.inference_failed("boom"),
    "overloaded": errors.overloaded("busy", 250),
    "draining": errors.draining(),
    "no_healthy_worker": errors.no_healthy_worker(),
    "deadline": errors.deadline_exceeded(),
    "openai_bad": bad("temperature", "'temperature' must be a number"),
    "openai_unknown_model": unknown_model("gpt-9"),
}
OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_native_shape(kind: str) -> None:
    err = KINDS[kind]
    body, headers = NATIVE.render(err, "req-1")
    data = orjson.loads(body)
    assert data["error"] == err.code and data["message"] == err.message and data["request_id"] == "req-1"
    assert ("retry_after_ms" in data) == (err.retry_after_ms is not None)
    assert set(data) <= {"error", "message", "request_id", "retry_after_ms"}


@pytest.mark.parametrize("kind", list(KINDS))
def test_openai_shape(kind: str) -> None:
    err = KINDS[kind]
    data = orjson.loads(OPENAI.render(err, "req-1")[0])
    assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"}
    inner = data["error"]
    assert inner["message"] == err.message
    assert inner["type"] == OPENAI_TYPES.get(err.status, "server_error")
    assert inner["param"] == err.param
    assert inner["code"] == (err.reason or err.code.lower())


def test_openai_names_the_field_and_the_finer_code() -> None:
    inner = orjson.loads(OPENAI.render(KINDS["openai_bad"], "r")[0])["error"]
    assert inner == {
        "message": "'temperature' must be a number",
        "type": "invalid_request_error",
        "param": "temperature",
        "code": "invalid_value",
    }
    inner = orjson.loads(OPENAI.render(KINDS["openai_unknown_model"], "r")[0])["error"]
    assert inner["param"] == "model" and inner["code"] == "model_not_found"
    assert orjson.loads(OPENAI.render(KINDS["overloaded"], "r")[0])["error"]["code"] == "service_overloaded"


@pytest.mark.parametrize("kind", list(KINDS))
def test_kserve_shape(kind: str) -> None:
    err = KINDS[kind]
    assert orjson.loads(KSERVE.render(err, "req-1")[0]) == {"error": err.message}


@pytest.mark.parametrize("dialect", [NATIVE, OPENAI, KSERVE], ids=lambda d: d.name)
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_headers_are_the_same_in_every_dialect(dialect, kind: str) -> None:
    err = KINDS[kind]
    headers = dialect.render(err, "req-1")[1]
    assert headers["X-Request-ID"] == "req-1"
    if err.retry_after_ms is None:
        assert "Retry-After" not in headers
    else:  # whole seconds, rounded up, at least 1
        assert headers["Retry-After"] == str(max(1, -(-err.retry_after_ms // 1000)))
    for name, value in (err.headers or {}).items():
        assert headers[name] == value  # WWW-Authenticate on a 401, X-RateLimit-* on a 429
    assert (headers.get("Connection") == "close") == (err.code == "DRAINING")


def test_error_response_is_the_dialects_rendering() -> None:
    err = KINDS["rate_limited"]
    response = error_response(err, "req-2", OPENAI)
    assert response.status_code == 429 and bytes(response.body) == OPENAI.render(err, "req-2")[0]
    assert response.headers["retry-after"] == "2" and response.headers["x-ratelimit-remaining"] == "0"
    assert orjson.loads(bytes(error_response(err, "req-2").body))["error"] == "RATE_LIMITED"  # native by default
