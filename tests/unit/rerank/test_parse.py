"""`/v1/rerank`'s body: an empty document, plain or as Cohere's `{text}`, is the caller's 400 naming its place
(as an empty input is on /v1/embeddings), before any pair reaches the batcher."""

from __future__ import annotations

import pytest

from batchserve.errors import ApiError
from batchserve.rerank.parse import V2, parse


def test_a_typical_body() -> None:
    req = parse(b'{"query": "q", "documents": ["a", {"text": "b"}], "top_n": 1}', 100, 60000)
    assert (req.query, req.documents, req.top_n, req.timeout_s) == ("q", ["a", "b"], 1, None)  # the model's default
    assert parse(b'{"query": "q", "documents": ["a"], "timeout_ms": 1500}', 100, 60000).timeout_s == 1.5


@pytest.mark.parametrize(
    "body,where",
    [
        (b'{"query": "q", "documents": ["", "x"]}', "`documents[0]`"),
        (b'{"query": "q", "documents": ["x", {"text": ""}]}', "`documents[1].text`"),
    ],
)
def test_an_empty_document_is_refused_naming_its_index(body: bytes, where: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse(body, 100, 60000)
    assert (caught.value.status, caught.value.param) == (400, "documents")
    assert caught.value.message.startswith(where), caught.value.message


def test_cohere_v2_takes_strings_and_no_return_documents() -> None:
    req = parse(b'{"query": "q", "documents": ["a"], "return_documents": true, "max_tokens_per_doc": 9}', 100, 9, V2)
    assert (req.documents, req.return_documents) == (["a"], False)
    with pytest.raises(ApiError) as caught:
        parse(b'{"query": "q", "documents": [{"text": "a"}]}', 100, 60000, V2)
    assert (caught.value.status, caught.value.param) == (400, "documents")
