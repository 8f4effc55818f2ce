"""The bodies of `/v1/classify` (vLLM's `input`) and `/predict` (TEI's `inputs`: a text, one text or pair as a
list of one or two strings, or a batch of such lists): what each becomes, and the 400s in OpenAI's shape that
name the member, before anything reaches the batcher."""

from __future__ import annotations

import pytest

from batchserve.classify.parse import parse_classify, parse_predict
from batchserve.errors import ApiError

LIMITS = (100, 60000)  # max_chars, max timeout ms


def test_classify_takes_a_text_or_a_list() -> None:
    one = parse_classify(b'{"input": "a", "model": "m", "timeout_ms": 500}', *LIMITS)
    assert (one.sequences, one.model, one.timeout_s, one.batch, one.raw_scores) == (["a"], "m", 0.5, False, False)
    assert parse_classify(b'{"input": ["a", "b", "c"]}', *LIMITS).sequences == ["a", "b", "c"]


@pytest.mark.parametrize(
    "body,sequences,batch",
    [
        (b'{"inputs": "a"}', ["a"], False),
        (b'{"inputs": ["a"]}', ["a"], False),
        (b'{"inputs": ["a", "b"]}', [("a", "b")], False),  # TEI: a list of two strings is one pair
        (b'{"inputs": [["a"], ["b", "c"], ["d"]]}', ["a", ("b", "c"), "d"], True),
        (b'{"inputs": [["a", "b"]]}', [("a", "b")], True),
    ],
)
def test_predict_reads_inputs_as_tei_does(body: bytes, sequences: list, batch: bool) -> None:
    req = parse_predict(body, *LIMITS)
    assert (req.sequences, req.batch) == (sequences, batch)


def test_predict_takes_raw_scores_and_truncate() -> None:
    req = parse_predict(b'{"inputs": "a", "raw_scores": true, "truncate": true}', *LIMITS)
    assert req.raw_scores and req.sequences == ["a"]


@pytest.mark.parametrize(
    "parse,body,param,words",
    [
        (parse_classify, b'{"input": ""}', "input", "`input`"),
        (parse_classify, b'{"input": []}', "input", "`input`"),
        (parse_classify, b'{"input": ["a", ""]}', "input", "`input[1]`"),
        (parse_classify, b'{"input": [1, 2]}', "input", "token-id arrays"),
        (parse_classify, b'{"input": 3}', "input", "`input`"),
        (parse_classify, b'{"model": "m"}', "input", "`input` is required"),
        (parse_classify, b'{"input": "' + b"x" * 101 + b'"}', "input", "input[0] is over the 100-character limit"),
        (parse_classify, b'{"input": "a", "timeout_ms": 70000}', "timeout_ms", "(0, 60000]"),
        (parse_classify, b'{"input": ["a"], "model": ""}', "model", "`model`"),
        (parse_classify, b"[1]", None, "a JSON object"),
        (parse_classify, b"{", None, "not valid JSON"),
        (parse_predict, b'{"inputs": []}', "inputs", "`inputs`"),
        (parse_predict, b'{"inputs": ["a", "b", "c"]}', "inputs", "a list of 3 strings"),
        (parse_predict, b'{"inputs": ["a", ["b"]]}', "inputs", "mixes strings and lists"),
        (parse_predict, b'{"inputs": [["a", "b", "c"]]}', "inputs", "`inputs[0]`"),
        (parse_predict, b'{"inputs": [[]]}', "inputs", "`inputs[0]`"),
        (parse_predict, b'{"inputs": [["a", ""]]}', "inputs", "`inputs[0][1]`"),
        (parse_predict, b'{"inputs": [["a", "' + b"x" * 101 + b'"]]}', "inputs", "inputs[0] is over"),
        (parse_predict, b'{"inputs": "a", "raw_scores": "yes"}', "raw_scores", "`raw_scores`"),
    ],
)
def test_bad_bodies_are_refused_naming_the_member(parse, body: bytes, param: str | None, words: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse(body, *LIMITS)
    assert (caught.value.status, caught.value.param) == (400, param), caught.value.message
    assert words in caught.value.message, caught.value.message


def test_too_many_inputs_are_refused() -> None:
    from batchserve.classify.shapes import MAX_INPUTS

    many = b'{"input": [' + b",".join([b'"a"'] * (MAX_INPUTS + 1)) + b"]}"
    with pytest.raises(ApiError) as caught:
        parse_classify(many, *LIMITS)
    assert (caught.value.status, caught.value.param) == (400, "input")
    batch = b'{"inputs": [' + b",".join([b'["a"]'] * (MAX_INPUTS + 1)) + b"]}"
    with pytest.raises(ApiError) as caught:
        parse_predict(batch, *LIMITS)
    assert (caught.value.status, caught.value.param) == (400, "inputs")
