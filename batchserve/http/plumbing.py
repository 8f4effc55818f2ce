"""HTTP plumbing under the one request path (`http/endpoint.py`): request ids, bounded body reads, JSON in and
out, and a body decoded straight into its declared msgspec `Struct` (parsing and type checking in one pass, and
on failure the field that was wrong)."""

from __future__ import annotations

import math
import os
import re
from collections.abc import AsyncIterator, Callable, Collection, Iterable
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from batchserve import errors

REQUEST_ID_OK = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
JSON = "application/json"


class RandomIds:
    """Generated request ids: 96 bits from the OS's CSPRNG each, so no id can be guessed from another. One
    `getrandom` call serves many ids, so the hot path pays a slice and a hex, not a syscall."""

    ID_BYTES = 12
    POOL = ID_BYTES * 340
    _pool = b""  # this instance's own once the first id is made
    _at = 0

    def __call__(self) -> str:
        at = self._at
        if at >= len(self._pool):
            self._pool, at = os.urandom(self.POOL), 0
        self._at = at + self.ID_BYTES
        return "req_" + self._pool[at : at + self.ID_BYTES].hex()


new_request_id = RandomIds()


def request_id_from(given: str | None) -> str:
    """The caller's X-Request-ID when it is well-formed, else a generated one."""
    if given and REQUEST_ID_OK.match(given):
        return given
    return new_request_id()


def client_host(scope: Scope) -> str:
    """The peer's address (what tells anonymous callers apart); "" when the server does not know it."""
    client = scope.get("client")
    return client[0] if client else ""


def first_values(pairs: Iterable[tuple[str, str | bytes]], names: Collection[str]) -> dict[str, str]:
    """The first value of each of `names` (lower-case) among header or metadata pairs, as `Endpoint.__call__`
    reads headers, so gRPC and HTTP read a caller alike. Binary values (gRPC's `-bin` keys) are skipped."""
    found: dict[str, str] = {}
    for name, value in pairs:
        key = name.lower()
        if key in names and key not in found and isinstance(value, str):
            found[key] = value
    return found


def check_input(text: object, name: str, max_chars: int) -> str:
    """One rule for an input, on every route that takes one: a non-empty string of at most `max_chars`
    characters, valid Unicode (no lone surrogate: the streaming job parser passes one on, though orjson refuses it)."""
    if not isinstance(text, str) or not text:
        raise errors.invalid(f"{name} must be a non-empty string")
    if len(text) > max_chars:
        raise errors.payload_too_large(f"{name} is over the {max_chars}-character limit")
    check_unicode(text, name)
    return text


def check_unicode(text: str, name: str) -> None:
    """400 when `text` holds a lone surrogate (it cannot be UTF-8, so it could be neither stored nor echoed)."""
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            raise errors.invalid(f"{name} is not valid Unicode text (it holds a lone surrogate)") from None


def ascii_count(text: str, cap: int) -> int | None:
    """A count written in ASCII digits (a Content-Length, a `?limit=`), or None; past `cap` it is `cap + 1`. Not
    `int(text)`: Python refuses to convert more than 4,300 digits (a 500), and such a count is only "too large"."""
    if not (text.isascii() and text.isdigit()):
        return None
    digits = text.lstrip("0") or "0"
    if len(digits) > len(str(cap)):
        return cap + 1
    return min(int(digits), cap + 1)


async def read_body_from(receive: Receive, limit: int, declared: str | None) -> bytes:
    """The body, refused with 413 as soon as it passes `limit` (never buffered whole); ClientDisconnect
    when the caller hangs up first."""
    if declared is not None:
        # The common case without `ascii_count`'s care for huge counts: a few ASCII digits.
        size = int(declared) if len(declared) < 10 and declared.isascii() and declared.isdigit() else None
        if size is None:
            size = ascii_count(declared, limit)
        if size is None:
            raise errors.invalid("Content-Length is not a number")
        if size > limit:
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


async def body_chunks(receive: Receive) -> AsyncIterator[bytes]:
    """The body as it streams in (as Starlette's `Request.stream`, ending with b""); ClientDisconnect when the
    caller hangs up first."""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientDisconnect()
        body = message.get("body", b"")
        if body:
            yield body
        if not message.get("more_body", False):
            break
    yield b""


async def send_json(send: Send, status: int, body: bytes, headers: dict[str, str]) -> None:
    """A JSON answer written straight to the ASGI `send` (the hot route skips Starlette's Response)."""
    raw = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    raw += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def check_json_content_type(content_type: str) -> None:
    """400 unless application/json or a structured `+json` type (application/problem+json), any parameters; none
    given counts as JSON. Not any type that merely contains "json" (application/notjson)."""
    if content_type == JSON:  # what nearly every client sends: no parsing
        return
    media = content_type.partition(";")[0].strip().lower()
    kind, slash, subtype = media.partition("/")
    structured = slash and kind == "application" and subtype.endswith("+json") and len(subtype) > 5
    if media and media != JSON and not structured:
        raise errors.invalid(f"Content-Type must be application/json, not {errors.short(content_type, 60)!r}")


# -- a body decoded into its declared shape ---------------------------------------------------------------------
T = TypeVar("T")
NOT_JSON = "the body is not valid JSON in UTF-8"
TOO_DEEP = f"{NOT_JSON}: it is nested too deeply"

_AT = re.compile(r"^(?P<what>.*) - at `\$(?P<path>[^`]*)`$", re.S)
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]+)`$")
_FIELD = re.compile(r"^\.(?P<name>[A-Za-z_][A-Za-z0-9_]*)")
_GOT = re.compile(r"got `(?P<got>[a-z]+)`")


@dataclass
class BodyRefusal(Exception):
    """Why a body is not its declared shape; each wing turns it into its dialect's 400. `field`: the top-level
    member at fault (None: the body itself); `path`: where exactly (`input[3]`); `got`: the JSON type found."""

    message: str
    field: str | None = None
    path: str = ""
    got: str = ""
    not_json: bool = False  # not JSON in UTF-8 at all (as opposed to JSON of the wrong shape)


def decode(
    decoder: msgspec.json.Decoder[T], body: bytes, refuse: Callable[[BodyRefusal], Exception] | None = None
) -> T:
    """The body as the decoder's type, or a `BodyRefusal` naming the field, raised as is or as `refuse` words it
    (the OpenAI routes' 400, `http/openai_error.refused`).

    UTF-8 is checked first for non-ASCII bodies: msgspec validates only the strings it keeps, and a body that is
    not UTF-8 is refused whole on every route."""
    try:
        if not body.isascii():
            body.decode()
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        why = refusal(str(exc))
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        why = BodyRefusal(f"{NOT_JSON}: {exc}", not_json=True)
    except RecursionError:  # msgspec's bound on nesting
        why = BodyRefusal(TOO_DEEP, not_json=True)
    raise (why if refuse is None else refuse(why)) from None


def refusal(text: str) -> BodyRefusal:
    """msgspec's validation message reworded to name the field first: "`input`: expected `str`, got `int`"."""
    if m := _MISSING.match(text):
        name = m["name"]
        return BodyRefusal(f"`{name}` is required", name, name)
    m = _AT.match(text)
    if m is None:  # the body itself: "Expected `object`, got `array`"
        return BodyRefusal("the body must be a JSON object", got=_got(text))
    what, path = m["what"], m["path"]
    field = _FIELD.match(path)
    name = field["name"] if field else None
    where = path.removeprefix(".")
    missing = _MISSING.match(what)
    if missing:
        where = f"{where}.{missing['name']}" if where else missing["name"]
        return BodyRefusal(f"`{where}` is required", name, where)
    return BodyRefusal(f"`{where}`: {what[:1].lower()}{what[1:]}", name, where, _got(what))


def _got(text: str) -> str:
    m = _GOT.search(text)
    return m["got"] if m else ""


def timeout_s(timeout_ms: float | msgspec.UnsetType, max_timeout_ms: float) -> float | None:
    """A body's `timeout_ms` in seconds; None when it names none (the model's default applies). Outside (0, max]
    it is a 400 naming the field, in OpenAI's words (`openai_error.bad`'s, built here: that module imports this)."""
    if timeout_ms is msgspec.UNSET:
        return None
    if not (0 < timeout_ms <= max_timeout_ms) or not math.isfinite(timeout_ms):
        message = f"'timeout_ms' must be a number of milliseconds in (0, {max_timeout_ms:.0f}]"
        raise errors.ApiError(400, "INVALID_REQUEST", message, param="timeout_ms", reason="invalid_value")
    return timeout_ms / 1000
