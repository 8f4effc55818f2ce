"""One error type, `ApiError`, rendered in each dialect the server speaks: the native shape of
docs/contract.md#errors, OpenAI's and KServe v2's. A dialect is chosen per route, so an error is raised once, with
one set of codes and retry hints, and each protocol only says how it looks. The headers are the same in every
dialect (`error_headers`)."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Send

from batchserve import errors
from batchserve.errors import ApiError
from batchserve.http.plumbing import JSON, new_request_id, request_id_from, send_json
from batchserve.logsafe import printable

log = logging.getLogger("batchserve.http")

# OpenAI's error `type` by status (what its clients switch on); any other 4xx is an invalid_request_error, a 5xx a
# server_error.
OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


def error_headers(err: ApiError, request_id: str) -> dict[str, str]:
    """The headers of an error answer, whatever its dialect; `Connection: close` on DRAINING, so the client
    reconnects elsewhere rather than reuse a connection about to close."""
    headers = {"X-Request-ID": request_id}
    if err.retry_after_ms is not None:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_ms / 1000)))
    if err.headers:
        headers.update(err.headers)
    if err.code == "DRAINING":
        headers["Connection"] = "close"
    return headers


def native_body(err: ApiError, request_id: str) -> bytes:
    """docs/contract.md#errors: `{error: CODE, message, request_id[, retry_after_ms]}`."""
    body: dict[str, object] = {"error": err.code, "message": err.message, "request_id": request_id}
    if err.retry_after_ms is not None:
        body["retry_after_ms"] = int(err.retry_after_ms)
    return orjson.dumps(body)


def openai_body(err: ApiError, request_id: str) -> bytes:
    """OpenAI's `{"error": {message, type, param, code}}`: `code` is the error's `reason` when it has one, else
    its native code in lower case."""
    kind = OPENAI_TYPES.get(err.status, "server_error" if err.status >= 500 else "invalid_request_error")
    code = err.reason or err.code.lower()
    return orjson.dumps({"error": {"message": err.message, "type": kind, "param": err.param, "code": code}})


def kserve_body(err: ApiError, request_id: str) -> bytes:
    """KServe v2's `{"error": message}`."""
    return orjson.dumps({"error": err.message})


@dataclass(frozen=True)
class Dialect:
    """How one protocol writes an error, and how it identifies callers."""

    name: str
    error_body: Callable[[ApiError, str], bytes]
    any_key_anonymous: bool = False  # OpenAI's clients always send a key: with no keys configured, any is anonymous

    def render(self, err: ApiError, request_id: str) -> tuple[bytes, dict[str, str]]:
        """The error's body and headers in this dialect."""
        return self.error_body(err, request_id), error_headers(err, request_id)


NATIVE = Dialect("native", native_body)
# The native shape on the routes OpenAI's clients call too (batches, files): any key is anonymous when no keys
# are configured, as on the OpenAI routes.
NATIVE_ANY_KEY = Dialect("native", native_body, any_key_anonymous=True)
OPENAI = Dialect("openai", openai_body, any_key_anonymous=True)
KSERVE = Dialect("kserve", kserve_body)


def error_response(err: ApiError, request_id: str, dialect: Dialect = NATIVE) -> Response:
    """The error as a Starlette Response, for the handlers that answer through Starlette."""
    body, headers = dialect.render(err, request_id)
    return Response(body, status_code=err.status, headers=headers, media_type=JSON)


async def internal_error(send: Send) -> None:
    """A JSON 500 for an error no handler expected (the traceback goes to the log, never to the caller); nothing
    when the answer had already started."""
    body, headers = NATIVE.render(errors.internal_error(), new_request_id())
    with contextlib.suppress(RuntimeError):
        await send_json(send, 500, body, headers)


async def unexpected_error(request: Request, exc: Exception) -> Response:
    """Starlette's handler of any exception no route expected: a JSON 500 that says nothing of it."""
    log.error("unexpected error on %s %s", request.method, printable(request.url.path), exc_info=exc)
    return error_response(errors.internal_error(), request_id_from(request.headers.get("x-request-id")))


async def http_error(request: Request, exc: Exception) -> Response:
    """The router's own 404 and 405 (and a static page's 404), in the native error shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        path = request.url.path
        slash = f": paths take no trailing slash ({printable(path.rstrip('/'), 200)})" if path.endswith("/") else ""
        err = errors.not_found(f"{exc.detail}{slash}")
    elif exc.status_code == 405:
        err = errors.method_not_allowed(str(exc.detail))
    else:
        err = errors.ApiError(exc.status_code, "HTTP_ERROR", str(exc.detail))
    return error_response(err, request_id_from(request.headers.get("x-request-id")))
