"""The one error shape of the API: `{"error", "message", "request_id"}` plus retry hints (DESIGN §2)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import orjson
from starlette.responses import Response


@dataclass
class ApiError(Exception):
    """An answer other than 200; raised anywhere on the request path, rendered once in `app`."""

    status: int
    code: str
    message: str
    retry_after_ms: int | None = None
    headers: dict[str, str] | None = None

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}"


class ClientGone(Exception):
    """The caller disconnected before its answer was ready; nobody reads this answer."""


def error_response(err: ApiError, request_id: str) -> Response:
    body: dict = {"error": err.code, "message": err.message, "request_id": request_id}
    headers = {"X-Request-ID": request_id}
    if err.retry_after_ms is not None:
        body["retry_after_ms"] = int(err.retry_after_ms)
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_ms / 1000)))
    if err.headers:
        headers.update(err.headers)
    if err.code == "DRAINING":  # the client should reconnect elsewhere, not reuse a connection about to close
        headers["Connection"] = "close"
    return Response(orjson.dumps(body), status_code=err.status, headers=headers, media_type="application/json")


def invalid(message: str) -> ApiError:
    return ApiError(400, "INVALID_REQUEST", message)


def overloaded(message: str, retry_after_ms: float) -> ApiError:
    return ApiError(503, "SERVICE_OVERLOADED", message, retry_after_ms=max(1, int(retry_after_ms)))


def deadline_exceeded() -> ApiError:
    return ApiError(504, "DEADLINE_EXCEEDED", "the request's deadline passed before it could be answered")


def inference_failed(detail: str) -> ApiError:
    return ApiError(500, "INFERENCE_FAILED", f"the backend failed on this input: {detail}")
