"""An OpenAI batch input file's lines decoded one by one into their declared shape (`jobs/shapes.BatchInputLine`,
`jobs/openai_batch.InputCheck`): each refusal names the line and the member at fault; a checked line is read back
by the line runner with its body as the JSON it was (`jobs/lines.RAW_LINE`), for the target route's own parse."""

from __future__ import annotations

import orjson
import pytest

from batchserve.errors import ApiError
from batchserve.jobs.lines import RAW_LINE, line_texts
from batchserve.jobs.openai_batch import InputCheck

EMBED = "/v1/embeddings"


def check(*lines: bytes) -> InputCheck:
    c = InputCheck(EMBED, 100, 1 << 20)
    c.feed(b"\n".join(lines) + b"\n")
    c.end()
    return c


def line(**kw) -> bytes:
    return orjson.dumps({"custom_id": "a", "url": EMBED, "body": {"input": "x"}, **kw})


@pytest.mark.parametrize(
    "raw, words",
    [
        (
            line(custom_id=""),
            "line 1: 'custom_id' must be a string of 1 to 512 characters (`custom_id`: expected `str` of length >= 1)",
        ),
        (line(custom_id="x" * 513), "'custom_id' must be a string of 1 to 512 characters"),
        (
            orjson.dumps({"url": EMBED, "body": {}}),
            "line 1: 'custom_id' must be a string of 1 to 512 characters (`custom_id` is required)",
        ),
        (line(method="GET"), "line 1: 'method' must be POST"),
        (
            orjson.dumps({"custom_id": "a", "body": {}}),
            "line 1: 'url' must be the batch's endpoint, /v1/embeddings (`url` is required)",
        ),
        (line(url=3), "line 1: 'url' must be the batch's endpoint"),
        (line(url="/v1/inference"), "line 1: 'url' is '/v1/inference', but the batch's endpoint is /v1/embeddings"),
        (line(body=[1]), "line 1: 'body' must be a JSON object (`body`: expected `object`, got `array`)"),
        (b"[1]", "line 1 of the input file must be a JSON object"),
        (b'{"custom_id": "a", "x": "\xff"}', "line 1 of the input file is not JSON in UTF-8"),
        (b"{nope", "line 1 of the input file is not JSON in UTF-8: JSON is malformed"),
    ],
)
def test_each_refusal_names_the_line_and_the_member(raw: bytes, words: str):
    with pytest.raises(ApiError) as caught:
        check(raw)
    assert caught.value.status == 400 and words in caught.value.message, caught.value.message


def test_a_checked_line_runs_with_its_body_as_sent():
    body = b'{"input": ["a", "b"], "model": "m", "extra": {"k": [1, 2.5]}}'
    raw = b'{"custom_id": "c1", "method": "POST", "url": "/v1/embeddings", "body": ' + body + b"}"
    c = check(raw)
    assert (c.lines, c.inputs, c.models) == (1, 2, {"m"})
    stored = RAW_LINE.decode(raw.decode())
    assert stored.custom_id == "c1" and bytes(stored.body) == body
    assert line_texts(EMBED, raw.decode()) == ["a", "b"]
    assert line_texts("/v1/inference", line(url="/v1/inference", body={"input": "q"}).decode()) == ["q"]
    assert line_texts(EMBED, line(body={"input": 3}).decode()) == [] and line_texts(EMBED, "{nope") == []


def test_the_batch_body_and_expiries_are_converted_to_their_declared_shapes():
    from batchserve.jobs.openai_batch import check_batch_request, check_expires_after, expires_s

    req = check_batch_request(
        {"input_file_id": "f", "endpoint": EMBED, "output_expires_after": {"anchor": "created_at", "seconds": 9}}, False
    )
    assert (req.input_file_id, req.endpoint, req.completion_window, expires_s(req)) == ("f", EMBED, "24h", 9.0)
    assert expires_s(check_batch_request({"input_file_id": "f", "endpoint": EMBED}, False)) is None
    assert check_expires_after({"anchor": "created_at", "seconds": 60}, "expires_after") == 60.0
    assert check_expires_after(None, "expires_after") is None
    for given, words in [
        ({"anchor": "last_active_at", "seconds": 5}, "`anchor`: invalid enum value"),
        ({"anchor": "created_at", "seconds": True}, "`seconds`: expected `int`, got `bool`"),
        ({"anchor": "created_at", "seconds": 2592001}, "`seconds`: expected `int` <= 2592000"),
    ]:
        with pytest.raises(ApiError) as caught:
            check_expires_after(given, "expires_after")
        assert caught.value.message.startswith("'expires_after' must be") and words in caught.value.message
    with pytest.raises(ApiError, match="'output_expires_after' must be .*`output_expires_after.seconds`"):
        check_batch_request(
            {"input_file_id": "f", "endpoint": EMBED, "output_expires_after": {"anchor": "created_at", "seconds": 0}},
            False,
        )
    with pytest.raises(ApiError, match="generation engine, which is off"):
        check_batch_request({"input_file_id": "f", "endpoint": "/v1/chat/completions"}, False)


BIG = b"123456789012345678901234567890"  # past 64 bits: JSON, though orjson cannot write it


def test_an_integer_past_64_bits_is_the_lines_own_business():
    """Taken at the check: the route's parser judges it when the line runs (test_openai_batch in integration)."""
    big = b'{"custom_id": "b", "url": "/v1/embeddings", "body": {"input": "x", "n": ' + BIG + b"}}"
    c = check(line(), big.replace(b'"b"', b'"c"'), big)
    assert (c.lines, c.inputs) == (3, 3)


@pytest.mark.parametrize("levels, refused", [(253, False), (254, True)])
def test_a_body_past_254_levels_is_refused_with_or_without_a_big_integer(levels: int, refused: bool):
    nested = b"[" * levels + BIG + b"]" * levels  # the body itself is one level more
    raw = b'{"custom_id": "a", "url": "/v1/embeddings", "body": {"input": "x", "n": ' + nested + b"}}"
    if not refused:
        assert check(raw).lines == 1
        return
    with pytest.raises(ApiError) as caught:
        check(raw)
    assert "line 1: 'body' is nested too deeply (JSON deeper than 254 levels)" in caught.value.message
