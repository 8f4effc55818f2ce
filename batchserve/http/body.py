"""HTTP plumbing shared by every route module: request ids, bounded body reads, JSON in and out, and the
one rendering of an `ApiError` (DESIGN §2's error shape)."""

from __future__ import annotations

import itertools
import math
import re
import secrets

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Send

from batchserve import errors
from batchserve.errors import ApiError

REQUEST_ID_OK = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
JSON = "application/json"


def json_response(body: dict, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, headers=headers, media_type=JSON)


def error_response(err: ApiError, request_id: str) -> Response:
    body, headers = error_body(err, request_id)
    return Response(body, status_code=err.status, headers=headers, media_type=JSON)


# Generated ids: a random per-process prefix and a counter: unique across nodes, no syscall per request.
_ID_PREFIX = "req_" + secrets.token_hex(5)
_id_counter = itertools.count(1)


def request_id_from(given: str | None) -> str:
    """The caller's X-Request-ID when it is well-formed, else a generated one."""
    if given and REQUEST_ID_OK.match(given):
        return given
    return f"{_ID_PREFIX}{next(_id_counter):07x}"


def request_id_of(request: Request) -> str:
    return request_id_from(request.headers.get("x-request-id"))


INFERENCE_HEADERS = {b"x-request-id": "x-request-id", b"authorization": "authorization",
                     b"content-type": "content-type", b"content-length": "content-length"}


def inference_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The four headers the inference path reads, in one pass over the raw list (not four lookups)."""
    found: dict[str, str] = {}
    for name, value in raw:
        key = INFERENCE_HEADERS.get(name.lower())
        if key is not None and key not in found:
            found[key] = value.decode("latin-1")
    return found


async def read_body_from(receive: Receive, limit: int, declared: str | None) -> bytes:
    """The body, refused with 413 as soon as it passes `limit` (never buffered whole); ClientDisconnect
    when the caller hangs up first."""
    if declared is not None:
        if not declared.isdigit():
            raise errors.invalid("Content-Length is not a number")
        if int(declared) > limit:
            raise errors.payload_too_large(f"the body is over the {limit}-byte limit")
    message = await receive()
    if message["type"] == "http.request" and not message.get("more_body", False):
        body = message.get("body", b"")  # the common case: the whole body in one message
        if len(body) > limit:
            raise errors.payload_too_large(f"the body is over the {limit}-byte limit")
        return body
    chunks: list[bytes] = []
    size = 0
    while True:
        if message["type"] != "http.request":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise errors.payload_too_large(f"the body is over the {limit}-byte limit")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)
        message = await receive()


async def read_body(request: Request, limit: int) -> bytes:
    return await read_body_from(request.receive, limit, request.headers.get("content-length"))


async def send_json(send: Send, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
    """A JSON answer written straight to the ASGI `send` (the hot route skips Starlette's Response)."""
    raw = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if headers:
        raw += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


async def internal_error(send: Send) -> None:
    """A JSON 500 for an error no handler expected (the traceback goes to the log, never to the caller)."""
    err = errors.internal_error()
    body, headers = error_body(err, request_id_from(None))
    try:
        await send_json(send, err.status, body, headers)
    except RuntimeError:  # the answer had already started: nothing more can be said on this connection
        pass


def error_body(err: ApiError, request_id: str) -> tuple[bytes, dict[str, str]]:
    """DESIGN §2's error body and headers for `err`."""
    body: dict = {"error": err.code, "message": err.message, "request_id": request_id}
    headers = {"X-Request-ID": request_id}
    if err.retry_after_ms is not None:
        body["retry_after_ms"] = int(err.retry_after_ms)
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_ms / 1000)))
    if err.headers:
        headers.update(err.headers)
    if err.code == "DRAINING":  # the client should reconnect elsewhere, not reuse a connection about to close
        headers["Connection"] = "close"
    return orjson.dumps(body), headers


def parse_json_object(body: bytes, content_type: str) -> dict:
    """The body as a JSON object, or 400 saying why not (wrong Content-Type, not JSON, not UTF-8, not an object)."""
    if content_type and "json" not in content_type.split(";")[0].lower():
        raise errors.invalid(f"Content-Type must be application/json, not {content_type[:60]!r}")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise errors.invalid(f"the body is not valid JSON in UTF-8: {exc}") from None
    if not isinstance(data, dict):
        raise errors.invalid("the body must be a JSON object")
    return data
