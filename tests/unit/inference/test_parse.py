"""`POST /v1/inference`'s body decoded into its declared shape: the status of each refusal (400, or 413 for an
input over the limit) and a message that names the member at fault."""

from __future__ import annotations

import pytest

from batchserve.config import Settings
from batchserve.errors import ApiError
from batchserve.inference.parse import parse_inference

S = Settings()
JSON = "application/json"


def test_a_typical_body():
    assert parse_inference(b'{"input": "hi", "model": "sim@v1", "timeout_ms": 1500}', JSON, S) == (
        "hi",
        "sim@v1",
        1.5,
        None,
    )
    assert parse_inference(b'{"input": "hi", "priority": "flex"}', JSON, S)[3] == "flex"
    assert parse_inference(b'{"input": "hi", "extra": [1, {"x": null}]}', "", S) == (
        "hi",
        None,
        None,  # no timeout named: the model's own default applies, once the route has picked the model
        None,
    )
    assert parse_inference('{"input": "café"}'.encode(), JSON, S)[0] == "café"


@pytest.mark.parametrize(
    "body,status,named",
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (b"{}", 400, "`input` is required"),
        (b'{"input": 5}', 400, "`input`"),
        (b'{"input": ""}', 400, "`input`"),
        (b'{"input": "a", "model": 7}', 400, "`model`"),
        (b'{"input": "a", "model": ""}', 400, "`model`"),
        (b'{"input": "a", "timeout_ms": -1}', 400, "`timeout_ms`"),
        (b'{"input": "a", "timeout_ms": true}', 400, "`timeout_ms`"),
        (b'{"input": "a", "timeout_ms": null}', 400, "`timeout_ms`"),
        (b'{"input": "a", "timeout_ms": 1e999}', 400, "`timeout_ms`"),
        (b'{"input": "a", "timeout_ms": 99999999}', 400, "timeout_ms"),
        (b'{"input": "\xff"}', 400, "UTF-8"),
        (b'{"input": "a", "other": "\xff"}', 400, "UTF-8"),  # a skipped member is not UTF-8: the body is not JSON
        (b'{"input": "\\ud800"}', 400, "not valid JSON"),  # a lone surrogate
        (b'{"input": "a", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "nested too deeply"),
        (b'{"input": "' + b"a" * (S.max_input_chars + 1) + b'"}', 413, "input"),
    ],
)
def test_refusals_name_the_member(body: bytes, status: int, named: str):
    with pytest.raises(ApiError) as caught:
        parse_inference(body, JSON, S)
    assert caught.value.status == status and named in caught.value.message, caught.value.message


def test_a_content_type_other_than_json_is_refused():
    with pytest.raises(ApiError) as caught:
        parse_inference(b'{"input": "a"}', "text/plain", S)
    assert caught.value.status == 400 and "Content-Type" in caught.value.message
