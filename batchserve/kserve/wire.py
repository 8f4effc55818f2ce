"""KServe's Open Inference Protocol v2 (the REST flavour Triton's clients speak): the shapes in and out, and
the binary tensor data extension, with no HTTP and no server state here.

A batchserve model looks to a v2 client like a model with one BYTES input named `input` (any shape: every
element is one string, one item on the batcher) and one output named `output`: BYTES for text and JSON
outputs (a JSON output that is not a string is sent as its JSON text), FP32 `[*input shape, dim]` for
embedding models. Inputs and outputs may be JSON (`data`) or binary (`parameters.binary_data_size`, the body
holding a JSON header of `Inference-Header-Content-Length` bytes followed by the raw tensors): tritonclient and
perf_analyzer send binary by default.
"""

from __future__ import annotations

import array
import math
import re
import struct
import sys
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec
import orjson

from batchserve import errors
from batchserve.errors import ApiError
from batchserve.http.decoding import BodyRefusal, decode
from batchserve.kserve import shapes
from batchserve.kserve.shapes import MAX_DIMS
from batchserve.kserve.shapes import MAX_ELEMENTS as MAX_ELEMENTS  # re-exported: grpc_service reads it here

INPUT_NAME = "input"
OUTPUT_NAME = "output"
HEADER_LENGTH = "inference-header-content-length"
MAX_LENGTH_DIGITS = 19  # of Inference-Header-Content-Length: more than any body holds
EXTENSIONS = ["binary_tensor_data"]


def bad(message: str) -> ApiError:
    """A 400 for what the body says (rendered `{"error": message}` by `http/dialects.KSERVE`)."""
    return errors.invalid(message)


@dataclass
class InferRequest:
    """One parsed `infer` body: the strings (row-major), the shape they came in, and how to answer."""

    id: str | None
    texts: list[str]
    shape: list[int]
    binary_output: bool
    timeout_us: float | None = None
    parameters: dict[str, Any] = field(default_factory=dict)


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """(JSON header, binary tail) of an infer body; the whole body is JSON when no header length is given."""
    if header_length is None:
        return body, b""
    # At most 19 digits, checked before int(): 4,301 digits pass Python's int-string limit and raised (a 500).
    if (
        len(header_length) > MAX_LENGTH_DIGITS
        or not (header_length.isascii() and header_length.isdigit())
        or int(header_length) > len(body)
    ):
        raise bad(f"Inference-Header-Content-Length must be a byte count within the body ({len(body)} bytes)")
    n = int(header_length)
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


def _bytes_elements(raw: bytes, count: int) -> list[bytes]:
    """BYTES in the binary extension: each element a 4-byte little-endian length, then its bytes."""
    out: list[bytes] = []
    at = 0
    while at < len(raw):
        if at + 4 > len(raw):
            raise bad("binary BYTES data ends inside an element's length prefix")
        (n,) = struct.unpack_from("<I", raw, at)
        at += 4
        if at + n > len(raw):
            raise bad("binary BYTES data ends inside an element")
        out.append(raw[at : at + n])
        at += n
    if len(out) != count:
        raise bad(f"the binary data holds {len(out)} element(s), the shape says {count}")
    return out


_DECODER = msgspec.json.Decoder(shapes.V2InferRequest)
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
    """The request's strings and answer format, or a 400 saying what is wrong: the JSON header decoded into its
    declared shape (`shapes.V2InferRequest`), then what types cannot say (the data against the shape, the binary
    tail against its declared size)."""
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
    if binary_size is not None:
        if binary_size != len(tail):
            raise bad(f"'binary_data_size' must equal the {len(tail)} bytes after the JSON header")
        try:
            texts = [b.decode() for b in _bytes_elements(tail, count)]
        except UnicodeDecodeError:
            raise bad("a BYTES element is not valid UTF-8") from None
    else:
        if tail:
            raise bad("binary data follows the JSON header but no input declares 'binary_data_size'")
        elements = _elements(tensor.data, shape)
        if len(elements) != count or not all(isinstance(e, str) for e in elements):
            raise bad(f"input '{INPUT_NAME}' 'data' must hold {count} string(s), as its shape {shape} says")
        texts = cast(list[str], elements)
    for text in texts:
        if not text:
            raise bad("every element must be a non-empty string")
        if len(text) > max_chars:
            raise errors.payload_too_large(f"an element is over the {max_chars}-character limit")
    params = req.parameters
    binary_output = params is not None and params.binary_data_output is True
    for o in req.outputs or ():
        binary_output = o.parameters is not None and o.parameters.binary_data is True
    timeout = params.timeout if params is not None else None
    given = msgspec.structs.asdict(params) if params is not None else {}
    return InferRequest(req.id, texts, shape, binary_output, timeout, {k: v for k, v in given.items() if v is not None})


def output_tensor(outputs: list[object], shape: list[int], kind: str) -> tuple[dict[str, Any], list[float] | list[str]]:
    """The output tensor's descriptor and its data, flat: FP32 for embeddings, BYTES otherwise. Raises
    ApiError(500) when the vectors of an embedding model do not share one length."""
    if kind == "embedding":
        vectors = [v for v in outputs if isinstance(v, list)]
        dims = {len(v) for v in vectors}
        if len(vectors) != len(outputs) or len(dims) != 1:
            raise ApiError(500, "INFERENCE_FAILED", "the model's vectors do not share one length")
        dim = dims.pop()
        flat = [float(x) for v in vectors for x in v]
        return {"name": OUTPUT_NAME, "datatype": "FP32", "shape": [*shape, dim]}, flat
    texts = [o if isinstance(o, str) else orjson.dumps(o).decode() for o in outputs]
    return {"name": OUTPUT_NAME, "datatype": "BYTES", "shape": shape}, texts


def to_binary(datatype: str, flat: list[float] | list[str]) -> bytes:
    if datatype == "FP32":  # output_tensor's floats
        packed = array.array("f", cast("list[float]", flat))
        if sys.byteorder != "little":
            packed.byteswap()
        return packed.tobytes()
    encoded = [str(s).encode() for s in flat]
    return b"".join(struct.pack("<I", len(b)) + b for b in encoded)


def infer_answer(
    req: InferRequest, model_name: str, model_version: str, outputs: list[object], kind: str
) -> tuple[bytes, int | None]:
    """The response body, and the JSON header's length when the tensor follows in binary (else None)."""
    tensor, flat = output_tensor(outputs, req.shape, kind)
    answer: dict[str, Any] = {"model_name": model_name, "model_version": model_version, "outputs": [tensor]}
    if req.id is not None:
        answer["id"] = req.id
    if not req.binary_output:
        tensor["data"] = flat
        return orjson.dumps(answer), None
    raw = to_binary(tensor["datatype"], flat)
    tensor["parameters"] = {"binary_data_size": len(raw)}
    head = orjson.dumps(answer)
    return head + raw, len(head)


def model_metadata(name: str, versions: list[str], backend: str, kind: str) -> dict[str, Any]:
    out_type, out_shape = ("FP32", [-1, -1]) if kind == "embedding" else ("BYTES", [-1])
    return {
        "name": name,
        "versions": versions,
        "platform": f"batchserve_{backend.rsplit(':', 1)[-1]}",
        "inputs": [{"name": INPUT_NAME, "datatype": "BYTES", "shape": [-1]}],
        "outputs": [{"name": OUTPUT_NAME, "datatype": out_type, "shape": out_shape}],
    }
