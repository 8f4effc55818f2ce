"""HTTP plumbing shared by every route module: request ids, bounded body reads, JSON in and out, and the
one rendering of an `ApiError` (DESIGN §2's error shape)."""

from __future__ import annotations

import math
import os
import re

import orjson
from starlette.requests import Request
from starlette.responses import Response

from batchserve import errors
from batchserve.errors import ApiError

REQUEST_ID_OK = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
JSON = "application/json"


def json_response(body: dict, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, headers=headers, media_type=JSON)


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
    return json_response(body, err.status, headers)


class RandomIds:
    """Generated request ids: 96 bits from the OS's CSPRNG each, so no id can be guessed from another (a
    record is also readable only by its tenant). One `getrandom` call serves 340 ids, so the hot path pays a
    slice and a hex, not a syscall."""

    ID_BYTES = 12
    POOL = ID_BYTES * 340

    def __init__(self) -> None:
        self._pool = b""
        self._at = 0

    def __call__(self) -> str:
        at = self._at
        if at >= len(self._pool):
            self._pool, at = os.urandom(self.POOL), 0
        self._at = at + self.ID_BYTES
        return "req_" + self._pool[at:at + self.ID_BYTES].hex()


new_request_id = RandomIds()


def request_id_of(request: Request, given: str | None = None) -> str:
    if given is None:
        given = request.headers.get("x-request-id")
    if given and REQUEST_ID_OK.match(given):
        return given
    return new_request_id()


def client_host(request: Request) -> str:
    """The peer's address (what tells anonymous callers apart); "" when the server does not know it."""
    client = request.scope.get("client")
    return client[0] if client else ""


INFERENCE_HEADERS = {b"x-request-id": "x-request-id", b"authorization": "authorization",
                     b"content-type": "content-type", b"content-length": "content-length"}


def inference_headers(request: Request) -> dict[str, str]:
    """The four headers the inference path reads, in one pass over the raw list (not four lookups)."""
    found: dict[str, str] = {}
    for name, value in request.scope["headers"]:
        key = INFERENCE_HEADERS.get(name.lower())
        if key is not None and key not in found:
            found[key] = value.decode("latin-1")
    return found


async def read_body(request: Request, limit: int, declared: str | None = None) -> bytes:
    """The body, refused with 413 as soon as it passes `limit` (never buffered whole)."""
    if declared is None:
        declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise errors.invalid("Content-Length is not a number")
        if int(declared) > limit:
            raise errors.payload_too_large(f"the body is over the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise errors.payload_too_large(f"the body is over the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def is_json_media_type(content_type: str) -> bool:
    """application/json or a structured `+json` type (application/problem+json), any parameters; none given
    counts as JSON. Not any type that merely contains "json" (application/notjson)."""
    media = content_type.partition(";")[0].strip().lower()
    if not media or media == JSON:
        return True
    kind, slash, subtype = media.partition("/")
    return bool(slash) and kind == "application" and subtype.endswith("+json") and len(subtype) > 5


def check_json_content_type(content_type: str) -> None:
    if content_type and not is_json_media_type(content_type):
        raise errors.invalid(f"Content-Type must be application/json, not {errors.short(content_type, 60)!r}")


def parse_json_object(body: bytes, content_type: str) -> dict:
    """The body as a JSON object, or 400 saying why not (wrong Content-Type, not JSON, not UTF-8, not an object)."""
    check_json_content_type(content_type)
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise errors.invalid(f"the body is not valid JSON in UTF-8: {exc}") from None
    if not isinstance(data, dict):
        raise errors.invalid("the body must be a JSON object")
    return data
