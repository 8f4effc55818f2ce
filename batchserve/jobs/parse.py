"""Reading a `POST /v1/batches` body: parsed as it streams in, a slice at a time, never in one go.

A job body may be megabytes: parsed whole, 16 MB of one-character inputs holds the event loop (and, through the GIL,
every thread) for most of a second and takes a gigabyte before the item limit can refuse it. So the body is fed to an
incremental parser (ijson's yajl2 C backend) as it arrives, in slices of `SLICE` bytes with a yield to the loop after
each, and the limits are checked per value: a body with one item too many is refused after that item.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import ijson

from batchserve import errors
from batchserve.http.plumbing import ascii_count, check_input, check_json_content_type, check_unicode

SLICE = 64 << 10  # bytes parsed between two yields to the event loop (~1 ms of parsing)
MAX_METADATA_BYTES = 16 << 10
MAX_METADATA_DEPTH = 32  # containers nested inside "metadata" (orjson cannot encode 255 deep)
MAX_OTHER_EVENTS = 4 * MAX_METADATA_BYTES  # values outside "inputs" (metadata, unknown keys): a bound, not a target
SCALARS = ("string", "number", "boolean", "null")
# A `\uD800`-`\uDBFF` escape (at the start of a run of backslashes of odd length, so not an escaped backslash
# followed by "u") that no `\uDC00`-`\uDFFF` escape follows: a lone high surrogate. yajl turns it into "?"
# without a word (a lone low one it refuses), so it is looked for in the bytes, before the parser sees them.
LONE_HIGH = re.compile(rb"(?<!\\)(?:\\\\)*\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})")
SCAN_TAIL = 12  # bytes of a slice scanned again with the next one: an escape pair may straddle the two
LONE_SURROGATE = "the body holds a string that is not valid Unicode text (a lone surrogate)"


def not_json(exc: Exception) -> errors.ApiError:
    first = str(exc).split("\\n")[0].split("\n")[0].lstrip("b'\"")
    if "integer overflow" in first:  # yajl's: JSON, but past what its integers hold
        return errors.invalid("the body holds an integer outside the 64-bit range, which no member of a job takes")
    return errors.invalid(f"the body is not valid JSON in UTF-8: {errors.short(first, 80)}")


@dataclass
class JobBody:
    inputs: list[str]
    model: str | None
    metadata: dict | None
    values: dict[str, object] = field(default_factory=dict)  # every top-level key but "inputs"

    @property
    def openai(self) -> bool:
        """OpenAI's Batch API body (`input_file_id`, `endpoint`, ...), not batchserve's own."""
        return "input_file_id" in self.values


@dataclass
class JobBodyParser:
    """Turns the parser's events into a `JobBody`, refusing (400/413) at the first value that breaks a limit."""

    max_items: int
    max_input_chars: int
    inputs: list[str] = field(default_factory=list)
    values: dict[str, object] = field(default_factory=dict)  # top-level keys other than "inputs"
    _events: list = field(default_factory=ijson.sendable_list)
    _coro: object = None
    _depth: int = 0
    _key: str | None = None
    _builder: ijson.ObjectBuilder | None = None
    _other_events: int = 0
    _seen: set[str] = field(default_factory=set)
    _tail: bytes = b""  # the last bytes fed, scanned again with the next slice (`_scan`)

    def __post_init__(self) -> None:
        self._coro = ijson.basic_parse_coro(self._events, use_float=True)

    def feed(self, data: bytes) -> None:
        self._scan(data)
        self._parse(lambda: self._coro.send(data))  # type: ignore[attr-defined]

    def finish(self) -> JobBody:
        self._scan(b"", final=True)
        self._parse(self._coro.close)  # type: ignore[attr-defined]
        if "input_file_id" in self._seen:  # OpenAI's shape: checked by jobs/openai_batch.py
            if "inputs" in self._seen:
                raise errors.invalid('give either "inputs" or "input_file_id", not both')
            return JobBody([], None, None, self.values)
        if "inputs" not in self._seen or not self.inputs:
            raise errors.invalid('"inputs" must be a non-empty array of strings')
        model = self.values.get("model")
        if model is not None and (not isinstance(model, str) or not model):
            raise errors.invalid('"model" must be a non-empty string when given')
        metadata = self.values.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise errors.invalid('"metadata" must be an object when given')
        return JobBody(self.inputs, model, metadata, self.values)

    def _parse(self, step: Callable[[], object]) -> None:
        """`step` the parser, then take the events it made."""
        try:
            step()
        except ijson.JSONError as exc:
            raise not_json(exc) from None
        except UnicodeDecodeError:  # yajl's escape of a lone surrogate: the parser is dead after it
            raise errors.invalid(LONE_SURROGATE) from None
        events, self._events[:] = list(self._events), []
        for event, value in events:
            self._event(event, value)

    def _scan(self, data: bytes, final: bool = False) -> None:
        """400 at a lone high surrogate escape. A match within 6 bytes of the end may yet be followed by its low
        half in the next slice: it is judged then (the tail, widened over a run of backslashes, is kept)."""
        text = self._tail + data
        if b"\\u" in text:
            for match in LONE_HIGH.finditer(text):
                if final or match.end() + 6 <= len(text):
                    raise errors.invalid(LONE_SURROGATE)
        start = max(0, len(text) - SCAN_TAIL)
        floor = max(0, start - 64)  # a longer run of backslashes (absurd in a job) is not followed further
        while start > floor and text[start - 1 : start] == b"\\":
            start -= 1
        self._tail = text[start:]

    def _event(self, event: str, value: object) -> None:
        depth = self._depth
        if event in ("start_map", "start_array"):
            self._depth += 1
        elif event in ("end_map", "end_array"):
            self._depth -= 1
        if depth == 0:
            if event != "start_map":
                raise errors.invalid("the body must be a JSON object")
            return
        if depth == 1 and event == "end_map":  # the body's object closes
            self._key = None
            return
        if event == "map_key":
            check_unicode(str(value), "a key")
        if depth == 1 and event == "map_key":
            key = str(value)
            if key in self._seen:
                raise errors.invalid(f"the key {errors.short(key)!r} appears twice")
            self._seen.add(key)
            self._key = key
            return
        if self._key == "inputs":
            self._input(depth, event, value)
            return
        self._other(depth, event, value)

    def _input(self, depth: int, event: str, value: object) -> None:
        if depth == 1:  # the value of "inputs" itself
            if event != "start_array":
                raise errors.invalid('"inputs" must be a non-empty array of strings')
            return
        if depth == 2 and event == "end_array":
            return
        i = len(self.inputs)
        if depth > 2 or event != "string":
            raise errors.invalid(f'"inputs"[{i}] must be a non-empty string')
        if i >= self.max_items:
            raise errors.invalid(
                f'"inputs" has more than {self.max_items} inputs; a job takes at most '
                f"{self.max_items} inputs (--jobs-max-items)"
            )
        self.inputs.append(check_input(value, f'"inputs"[{i}]', self.max_input_chars))

    def _other(self, depth: int, event: str, value: object) -> None:
        self._other_events += 1
        if self._other_events > MAX_OTHER_EVENTS:
            raise errors.payload_too_large(f'"metadata" (or other keys) is over {MAX_METADATA_BYTES} bytes')
        if self._depth > MAX_METADATA_DEPTH + 1:
            raise errors.invalid(f'"metadata" (or another key) is nested more than {MAX_METADATA_DEPTH} deep')
        if isinstance(value, str):
            check_unicode(value, f"a string in {errors.short(self._key, 40)!r}")
        if self._builder is None:
            if depth == 1 and event in SCALARS:
                self.values[self._key or ""] = value
                return
            self._builder = ijson.ObjectBuilder()
        self._builder.event(event, value)
        if self._depth == 1:  # the container just closed
            self.values[self._key or ""] = self._builder.value
            self._builder = None


async def read_job_body(
    chunks: AsyncIterator[bytes],
    content_type: str,
    declared: str | None,
    body_limit: int,
    max_items: int,
    max_input_chars: int,
) -> JobBody:
    """The job's inputs, model and metadata, parsed as the body (`chunks`, `declared` long) streams in (see the
    module docstring)."""
    check_json_content_type(content_type)
    if declared is not None and (ascii_count(declared, body_limit) or 0) > body_limit:
        raise errors.payload_too_large(f"the body is over the {body_limit}-byte limit")
    parser = JobBodyParser(max_items, max_input_chars)
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > body_limit:
            raise errors.payload_too_large(f"the body is over the {body_limit}-byte limit")
        for at in range(0, len(chunk), SLICE):
            parser.feed(chunk[at : at + SLICE])
            await asyncio.sleep(0)
    return parser.finish()
