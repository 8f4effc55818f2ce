"""The body of a KServe v2 `infer` (the REST flavour Triton's clients speak) → the request's strings and how to
answer. With the binary tensor data extension the body is the JSON header (`Inference-Header-Content-Length`
bytes) followed by the raw tensor, which is not JSON, so it is sliced by hand here. No HTTP and no server state.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec

from batchserve import errors
from batchserve.errors import ApiError
from batchserve.http.plumbing import BodyRefusal, ascii_count, decode
from batchserve.kserve import shapes
from batchserve.kserve.shapes import INPUT_NAME, MAX_DIMS, MAX_ELEMENTS, OUTPUT_NAME

bad = errors.invalid  # a 400 for what the body says (rendered `{"error": message}` by `http/dialects.KSERVE`)


@dataclass
class InferRequest:
    """One parsed `infer` body: the strings (row-major), the shape they came in, and how to answer."""

    id: str | None
    texts: list[str]
    shape: list[int]
    binary_output: bool
    timeout_us: float | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    priority: str | int | None = None  # `parameters.priority`: the tier it asks to run at (`Work.ask`)


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """(JSON header, binary tail) of an infer body; the whole body is JSON when no header length is given."""
    if header_length is None:
        return body, b""
    n = ascii_count(header_length, len(body))
    if n is None or n > len(body):
        raise bad(f"Inference-Header-Content-Length must be a byte count within the body ({len(body)} bytes)")
    return body[:n], body[n:]


def _elements(data: object, shape: list[int]) -> list[object]:
    """Row-major elements of `data`: v2 allows the tensor flat (a list of `prod(shape)` elements) or nested by
    its shape — exactly: `[["a"], ["b", "c", "d"]]` is not a [2, 2] tensor, though it holds four elements."""
    if not isinstance(data, list):
        return [data]
    if not any(isinstance(e, list) for e in data):
        return data  # flat; its length is checked against the shape by the caller
    out: list[object] = []

    def walk(node: object, depth: int) -> None:
        if depth == len(shape):
            if isinstance(node, list):
                raise bad(f"'data' is nested deeper than its shape {shape}")
            out.append(node)
            return
        if not isinstance(node, list) or len(node) != shape[depth]:
            size = f"{len(node)} element(s)" if isinstance(node, list) else "a single element"
            raise bad(
                f"'data' is nested unlike its shape {shape}: {size} at depth {depth}, where the shape "
                f"says {shape[depth]}"
            )
        for element in node:
            walk(element, depth + 1)

    walk(data, 0)
    return out


def bytes_elements(raw: bytes, count: int, what: str = "the binary BYTES data") -> list[bytes]:
    """BYTES packed as v2 packs them (the HTTP binary extension's tail, gRPC's raw contents): each element a
    4-byte little-endian length, then its bytes. `what`: the refusals' name for `raw`."""
    out: list[bytes] = []
    at = 0
    while at < len(raw):
        if at + 4 > len(raw):
            raise bad(f"{what} ends inside an element's length prefix")
        (n,) = struct.unpack_from("<I", raw, at)
        at += 4
        if at + n > len(raw):
            raise bad(f"{what} ends inside an element")
        out.append(raw[at : at + n])
        at += n
    if len(out) != count:
        raise bad(f"{what} holds {len(out)} element(s), the shape says {count}")
    return out


def texts_of(elements: Sequence[str | bytes], max_chars: int) -> list[str]:
    """The elements as text (BYTES as UTF-8), each non-empty and within `max_chars`: v2's HTTP and gRPC alike."""
    try:
        texts = [e if isinstance(e, str) else e.decode() for e in elements]
    except UnicodeDecodeError:
        raise bad("a BYTES element is not valid UTF-8") from None
    for text in texts:
        if not text:
            raise bad("every element must be a non-empty string")
        if len(text) > max_chars:
            raise errors.payload_too_large(f"an element is over the {max_chars}-character limit")
    return texts


_DECODER = msgspec.json.Decoder(shapes.V2InferRequest)
_NO_PARAMETERS = shapes.InferParameters()  # read only
# What each member of the declared shape means, said first when a body breaks it (the path of the refusal).
_WHAT = {
    "inputs": f"'inputs' must hold exactly one tensor, named '{INPUT_NAME}' (see GET /v2/models/{{model}})",
    "inputs[0].name": f"unknown input: this model's one input is '{INPUT_NAME}'",
    "inputs[0].datatype": f"input '{INPUT_NAME}' must have datatype BYTES (strings)",
    "inputs[0].shape": f"'shape' must be a list of at most {MAX_DIMS} integers from 0 to {MAX_ELEMENTS}",
    "parameters.timeout": "'parameters.timeout' must be a positive number of microseconds",
}
_OUTPUT_NAME = re.compile(r"^outputs\[\d+\]\.name$")


def _refused(r: BodyRefusal) -> ApiError:
    path = re.sub(r"^inputs\[0\]\.shape\[\d+\]$", "inputs[0].shape", r.path)
    what = _WHAT.get(path) or (
        f"unknown output: this model's one output is '{OUTPUT_NAME}'" if _OUTPUT_NAME.match(path) else ""
    )
    return bad(f"{what} ({r.message})" if what else r.message)


def parse_infer(body: bytes, header_length: str | None, max_chars: int) -> InferRequest:
    """The request's strings and answer format, or a 400 saying what is wrong: the JSON header decoded into
    `shapes.V2InferRequest`, then what types cannot say (the data against the shape, the binary tail's size)."""
    head, tail = split_body(body, header_length)
    try:
        req = decode(_DECODER, head)
    except BodyRefusal as r:
        raise _refused(r) from None
    tensor = req.inputs[0]
    shape = tensor.shape
    count = math.prod(shape)
    if count < 1 or count > MAX_ELEMENTS:
        raise bad(f"input '{INPUT_NAME}' must hold 1 to {MAX_ELEMENTS} elements, its shape {shape} holds {count}")
    binary_size = tensor.parameters.binary_data_size if tensor.parameters is not None else None
    elements: Sequence[str | bytes]
    if binary_size is not None:
        if binary_size != len(tail):
            raise bad(f"'binary_data_size' must equal the {len(tail)} bytes after the JSON header")
        elements = bytes_elements(tail, count)
    else:
        if tail:
            raise bad("binary data follows the JSON header but no input declares 'binary_data_size'")
        data = _elements(tensor.data, shape)
        if len(data) != count or not all(isinstance(e, str) for e in data):
            raise bad(f"input '{INPUT_NAME}' 'data' must hold {count} string(s), as its shape {shape} says")
        elements = cast(list[str], data)
    texts = texts_of(elements, max_chars)
    params = _NO_PARAMETERS if req.parameters is None else req.parameters
    binary_output = params.binary_data_output is True
    for o in req.outputs or ():
        binary_output = o.parameters is not None and o.parameters.binary_data is True
    given = {k: v for k, v in msgspec.structs.asdict(params).items() if v is not None}
    return InferRequest(req.id, texts, shape, binary_output, params.timeout, given, params.priority)
