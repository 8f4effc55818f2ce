"""The body of `POST /v1/rerank`, decoded into its declared shape (`shapes.RerankRequest`) and checked against
the server's limits: 400 in OpenAI's error shape naming the `param`. What the answer looks like is `render.py`'s."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from batchserve.http.plumbing import decode, timeout_s
from batchserve.http.openai_error import bad, refused
from batchserve.rerank import shapes

Shape = msgspec.json.Decoder[shapes.RerankRequest | shapes.V2RerankRequest]
V1: Shape = msgspec.json.Decoder(shapes.RerankRequest)
V2: Shape = msgspec.json.Decoder(shapes.V2RerankRequest)  # Cohere's v2: strings only, no return_documents


@dataclass
class ParsedRerank:
    query: str
    documents: list[str]
    top_n: int | None  # None: every document
    return_documents: bool
    model: str | None  # None: the first reranking model
    timeout_s: float | None  # None: none named, the model's own default applies (`slo.Deadlines`)
    service_tier: str | None = None  # the priority it asks for (`Work.ask`)


def parse(body: bytes, max_chars: int, max_timeout_ms: float, shape: Shape = V1) -> ParsedRerank:
    """`shape`: the body's declared shape, Cohere's v1 (`/v1/rerank`, the default) or v2 (`/v2/rerank`)."""
    req = decode(shape, body, refused)
    documents = [d if isinstance(d, str) else d.text for d in req.documents]
    for name, text in [("query", req.query), *(("documents", d) for d in documents)]:
        if len(text) > max_chars:
            raise bad(name, f"a {name.rstrip('s')} is over the {max_chars}-character limit", "string_above_max_length")
    return ParsedRerank(
        query=req.query,
        documents=documents,
        top_n=req.top_n,
        return_documents=isinstance(req, shapes.RerankRequest) and req.return_documents,
        model=req.model,
        timeout_s=timeout_s(req.timeout_ms, max_timeout_ms),
        service_tier=req.service_tier,
    )
