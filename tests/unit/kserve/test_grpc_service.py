"""The gRPC service's tensors in and out without a server (`kserve/grpc_service.py`): the same packing as the HTTP
binary extension (`parse.bytes_elements`, `render.output_tensor` + `to_binary`), its refusals naming
`raw_input_contents`; the live service is tests/integration/kserve/test_grpc.py."""

from __future__ import annotations

import array
import struct

import pytest

from batchserve.errors import ApiError
from batchserve.kserve.grpc_service import output_tensor
from batchserve.kserve.parse import bytes_elements


def test_fp32_and_bytes_outputs_as_raw_contents():
    datatype, shape, raw = output_tensor([[1.0, 2.0], [3.0, -0.5]], [2], "embedding")
    assert (datatype, shape) == ("FP32", [2, 2]) and array.array("f", raw).tolist() == [1.0, 2.0, 3.0, -0.5]
    datatype, shape, raw = output_tensor(["ab", {"x": 1}], [2], "json")
    assert (datatype, shape) == ("BYTES", [2])
    assert bytes_elements(raw, 2) == [b"ab", b'{"x":1}']
    with pytest.raises(ApiError) as caught:
        output_tensor([[1.0], "x"], [2], "embedding")
    assert caught.value.status == 500


@pytest.mark.parametrize(
    "raw, count, words",
    [
        (struct.pack("<I", 5) + b"ab", 1, "raw_input_contents[0] ends inside an element"),
        (b"\x01", 1, "raw_input_contents[0] ends inside an element's length prefix"),
        (struct.pack("<I", 1) + b"a" + struct.pack("<I", 1) + b"b", 1, "raw_input_contents[0] holds 2 element(s)"),
    ],
)
def test_raw_contents_that_break_the_shape_name_the_field(raw: bytes, count: int, words: str):
    with pytest.raises(ApiError) as caught:
        bytes_elements(raw, count, "raw_input_contents[0]")
    assert caught.value.status == 400 and words in caught.value.message, caught.value.message
