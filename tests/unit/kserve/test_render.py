"""The v2 answers (`kserve/render.py`) decoded back into their declared shapes (`kserve/shapes.py`): JSON and binary
output tensors, BYTES and FP32, and a model's metadata."""

from __future__ import annotations

import array
import struct

import msgspec
import pytest

from batchserve.errors import ApiError
from batchserve.kserve import shapes
from batchserve.kserve.parse import InferRequest
from batchserve.kserve.render import infer_answer, model_metadata


def request(binary: bool, shape: list[int], rid: str | None = "r1") -> InferRequest:
    return InferRequest(rid, ["x"] * (shape[0] if shape else 1), shape, binary)


def test_json_bytes_answer_is_the_declared_shape():
    out, header = infer_answer(request(False, [2]), "echo", "v1", ["a", {"k": 1}], "json")
    assert header is None
    answer = msgspec.json.decode(out, type=shapes.V2InferResponse)
    tensor = answer.outputs[0]
    assert (answer.model_name, answer.model_version, answer.id) == ("echo", "v1", "r1")
    assert (tensor.datatype, tensor.shape, tensor.data) == ("BYTES", [2], ["a", '{"k":1}'])


def test_binary_fp32_answer_is_the_header_then_the_floats():
    out, header = infer_answer(request(True, [2], None), "embed", "v1", [[1.0, 2.0], [3.0, 4.5]], "embedding")
    assert header is not None
    answer = msgspec.json.decode(out[:header], type=shapes.V2InferResponse)
    tensor = answer.outputs[0]
    assert answer.id is msgspec.UNSET and (tensor.datatype, tensor.shape) == ("FP32", [2, 2])
    assert tensor.parameters == {"binary_data_size": 16} and len(out) - header == 16
    assert array.array("f", out[header:]).tolist() == [1.0, 2.0, 3.0, 4.5]


def test_binary_bytes_answer_is_length_prefixed():
    out, header = infer_answer(request(True, [2]), "echo", "v1", ["ab", "c"], "json")
    assert header is not None and out[header:] == struct.pack("<I", 2) + b"ab" + struct.pack("<I", 1) + b"c"


def test_vectors_of_two_lengths_are_a_500():
    with pytest.raises(ApiError) as caught:
        infer_answer(request(False, [2]), "embed", "v1", [[1.0], [1.0, 2.0]], "embedding")
    assert caught.value.status == 500


@pytest.mark.parametrize("kind, datatype", [("embedding", "FP32"), ("json", "BYTES")])
def test_model_metadata_is_the_declared_shape(kind: str, datatype: str):
    meta = msgspec.convert(model_metadata("m", ["v1"], "batchserve.backends.sim:Sim", kind), shapes.V2ModelMetadata)
    assert meta.platform == "batchserve_Sim" and meta.outputs[0].datatype == datatype
    assert [t.name for t in meta.inputs + meta.outputs] == [shapes.INPUT_NAME, shapes.OUTPUT_NAME]
