"""KServe v2's answers: the output tensor of an `infer` and a model's metadata. A batchserve model looks to a v2
client like one BYTES input `input` (every element one item on the batcher) and one output `output`: BYTES for
text and JSON outputs, FP32 `[*input shape, dim]` for embedding models.
"""

from __future__ import annotations

import array
import struct
import sys
from typing import Any, cast

import orjson

from batchserve.config import ModelSpec
from batchserve.errors import ApiError
from batchserve.kserve.host import KServeHost
from batchserve.kserve.parse import InferRequest
from batchserve.kserve.shapes import INPUT_NAME, OUTPUT_NAME


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


def metadata_of(rt: KServeHost, spec: ModelSpec) -> dict[str, Any]:
    """A model version's `model_metadata`, as v2's HTTP route and gRPC method answer it."""
    backend = rt.backends.get(spec.id)
    versions = [s.version for s in rt.registry.by_name.get(spec.name, [])]
    return model_metadata(spec.name, versions, spec.backend, backend.output_kind if backend is not None else "text")
