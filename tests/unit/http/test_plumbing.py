"""`http/plumbing.py` decode: a body decoded into a declared shape, and msgspec's refusal reworded to name the member
at fault."""

from __future__ import annotations

from typing import Annotated

import msgspec
import pytest

from batchserve.http.plumbing import BodyRefusal, decode


class Doc(msgspec.Struct):
    text: str


class Shape(msgspec.Struct):
    query: Annotated[str, msgspec.Meta(min_length=1)]
    docs: list[str | Doc] = []


D = msgspec.json.Decoder(Shape)


@pytest.mark.parametrize(
    "body,field,path,got,not_json",
    [
        (b"{", None, "", "", True),
        (b'"x"', None, "", "str", False),
        (b"{}", "query", "query", "", False),
        (b'{"query": 1}', "query", "query", "int", False),
        (b'{"query": ""}', "query", "query", "", False),
        (b'{"query": "q", "docs": [1]}', "docs", "docs[0]", "int", False),
        (b'{"query": "q", "docs": [{}]}', "docs", "docs[0].text", "", False),
        (b'{"query": "q", "z": "\xfe"}', None, "", "", True),
    ],
)
def test_the_refusal_names_the_member(body: bytes, field: str | None, path: str, got: str, not_json: bool):
    with pytest.raises(BodyRefusal) as caught:
        decode(D, body)
    r = caught.value
    assert (r.field, r.path, r.got, r.not_json) == (field, path, got, not_json), r
    if field is not None:
        assert r.message.startswith(f"`{path}") or f"`{path}" in r.message, r.message


def test_a_good_body_decodes():
    assert decode(D, '{"query": "é", "docs": ["a", {"text": "b"}]}'.encode()) == Shape("é", ["a", Doc("b")])
