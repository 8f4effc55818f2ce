"""A request body decoded straight into its declared shape (a msgspec `Struct`): parsing and type checking in one
pass, and when it fails, which field was wrong. Each wing turns a `BodyRefusal` into its dialect's 400 (the native
`INVALID_REQUEST`, OpenAI's `param`, KServe's `{"error"}`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypeVar

import msgspec

T = TypeVar("T")
NOT_JSON = "the body is not valid JSON in UTF-8"
TOO_DEEP = f"{NOT_JSON}: it is nested too deeply"

_AT = re.compile(r"^(?P<what>.*) - at `\$(?P<path>[^`]*)`$", re.S)
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]+)`$")
_FIELD = re.compile(r"^\.(?P<name>[A-Za-z_][A-Za-z0-9_]*)")
_GOT = re.compile(r"got `(?P<got>[a-z]+)`")


@dataclass
class BodyRefusal(Exception):
    """Why a body is not its declared shape. `field`: the top-level member at fault (None: the body itself);
    `path`: where exactly (`input[3]`); `got`: the JSON type found where another was expected ("" if not said)."""

    message: str
    field: str | None = None
    path: str = ""
    got: str = ""
    not_json: bool = False  # not JSON in UTF-8 at all (as opposed to JSON of the wrong shape)


def decode(decoder: msgspec.json.Decoder[T], body: bytes) -> T:
    """The body as the decoder's type, or a `BodyRefusal` naming the field.

    UTF-8 is checked first for non-ASCII bodies: msgspec validates the strings it keeps, not those of members
    it skips, and a body that is not UTF-8 is refused whole on every route (as orjson did)."""
    try:
        if not body.isascii():
            body.decode()
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise refusal(str(exc)) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise BodyRefusal(f"{NOT_JSON}: {exc}", not_json=True) from None
    except RecursionError:  # msgspec's bound on nesting (as orjson's, which refused past 1024 levels)
        raise BodyRefusal(TOO_DEEP, not_json=True) from None


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
