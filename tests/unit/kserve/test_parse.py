"""A v2 infer body → its strings (`kserve/parse.py`), without a server: the JSON header decoded into its declared
shape, the binary extension's tail sliced by hand against the header's `binary_data_size`, and each refusal's
words (the live cases are in tests/integration/kserve/test_routes.py)."""

from __future__ import annotations

import struct

import orjson
import pytest

from batchserve.errors import ApiError
from batchserve.kserve.parse import parse_infer, split_body


def tensor(**kw) -> dict:
    return {"name": "input", "datatype": "BYTES", **kw}


def body(*inputs: dict, **kw) -> bytes:
    return orjson.dumps({"inputs": list(inputs), **kw})


def packed(*texts: str) -> bytes:
    return b"".join(struct.pack("<I", len(t.encode())) + t.encode() for t in texts)


def test_json_data_flat_or_nested_by_its_shape():
    r = parse_infer(body(tensor(shape=[3], data=["a", "b", "c"]), id="x"), None, 100)
    assert (r.id, r.texts, r.shape, r.binary_output) == ("x", ["a", "b", "c"], [3], False)
    r = parse_infer(body(tensor(shape=[2, 2], data=[["a", "b"], ["c", "d"]])), None, 100)
    assert r.texts == ["a", "b", "c", "d"] and r.shape == [2, 2]


def test_binary_tail_is_sliced_by_its_declared_size_and_answers_as_asked():
    tail = packed("héllo", "w")
    head = body(
        tensor(shape=[2], parameters={"binary_data_size": len(tail)}),
        outputs=[{"name": "output", "parameters": {"binary_data": True}}],
        parameters={"timeout": 5e5},
    )
    r = parse_infer(head + tail, str(len(head)), 100)
    assert r.texts == ["héllo", "w"] and r.binary_output and r.timeout_us == 5e5
    assert r.parameters == {"timeout": 5e5}
    assert split_body(head + tail, str(len(head))) == (head, tail)


@pytest.mark.parametrize(
    "raw, header, words",
    [
        (body(tensor(shape=[2], data=["a"])), None, "must hold 2 string(s)"),
        (body(tensor(shape=[2, 2], data=[["a"], ["b", "c", "d"]])), None, "nested unlike its shape"),
        (body(tensor(shape=[0], data=[])), None, "1 to 2048 elements"),
        (body(tensor(shape=[1], data=[""])), None, "non-empty string"),
        (body({"name": "x", "datatype": "BYTES", "shape": [1], "data": ["a"]}), None, "unknown input"),
        (body(tensor(datatype="FP32", shape=[1], data=[1.0])), None, "datatype BYTES"),
        (body(tensor(shape=[1], data=["a"]), outputs=[{"name": "nope"}]), None, "unknown output"),
        (body(tensor(shape=[1], data=["a"]), parameters={"timeout": 0}), None, "'parameters.timeout'"),
        (b"[1]", None, "JSON object"),
        (body(tensor(shape=[1], data=["a"])) + b"xx", "9999", "Inference-Header-Content-Length"),
        (body(tensor(shape=[1], data=["a"])), "9" * 4301, "Inference-Header-Content-Length"),
    ],
)
def test_refusals_say_what_is_wrong(raw: bytes, header: str | None, words: str):
    with pytest.raises(ApiError) as caught:
        parse_infer(raw, header, 100)
    assert caught.value.status == 400 and words in caught.value.message, caught.value.message


@pytest.mark.parametrize(
    "declared, tail, words",
    [
        (9, packed("ab"), "'binary_data_size' must equal"),
        (len(packed("ab")) - 1, packed("ab")[:-1], "ends inside an element"),
        (2, b"\x01\x00", "inside an element's length prefix"),
        (len(packed("ab", "c")), packed("ab", "c"), "holds 2 element(s), the shape says 1"),
        (5, b"\x01\x00\x00\x00\xff", "not valid UTF-8"),
    ],
)
def test_binary_tails_that_break_their_header(declared: int, tail: bytes, words: str):
    head = body(tensor(shape=[1], parameters={"binary_data_size": declared}))
    with pytest.raises(ApiError) as caught:
        parse_infer(head + tail, str(len(head)), 100)
    assert caught.value.status == 400 and words in caught.value.message, caught.value.message


def test_an_element_over_the_character_limit_is_413():
    with pytest.raises(ApiError) as caught:
        parse_infer(body(tensor(shape=[1], data=["x" * 11])), None, 10)
    assert caught.value.status == 413
