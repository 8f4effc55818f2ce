"""OpenAI's error shape, shared by the OpenAI-compatible routes (generation, embeddings):
`{"error": {message, type, param, code}}`, and its rendering (its declared shape, for
/openapi.json, is `http/shapes.OpenAIError`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.responses import Response

from batchserve.errors import ApiError

JSON = "application/json"
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


@dataclass
class OpenAIError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str = ""
    headers: dict[str, str] | None = None

    @classmethod
    def from_api(cls, err: ApiError) -> OpenAIError:
        headers = dict(err.headers or {})
        if err.retry_after_ms is not None:
            headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_ms / 1000)))
        return cls(err.status, err.message, None, err.code.lower(), headers=headers)

    def body(self) -> dict[str, Any]:
        kind = self.type or ERROR_TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param, code)


def json_object(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or the OpenAI-shaped 400 that says why not."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad(None, f"the body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(data, dict):
        raise bad(None, "the body must be a JSON object", "invalid_json")
    return data


def error_response(err: OpenAIError, headers: dict[str, str]) -> Response:
    return Response(
        orjson.dumps(err.body()), status_code=err.status, headers={**headers, **(err.headers or {})}, media_type=JSON
    )
