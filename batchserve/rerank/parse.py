"""The body of `POST /v1/rerank` (Cohere's shape, as TEI, Infinity and vLLM take it), parsed and checked: 400 in
OpenAI's error shape naming the `param`. What the answer looks like is `wire.py`'s."""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchserve.http.openai_error import bad, json_object

MAX_DOCUMENTS = 1000  # documents per request (Cohere's limit)


@dataclass
class RerankRequest:
    query: str
    documents: list[str]
    top_n: int | None  # None: every document
    return_documents: bool
    model: str | None  # None: the first reranking model
    timeout_s: float


def document_text(doc: object, i: int) -> str:
    """A document: a string, or Cohere's `{"text": ...}`."""
    if isinstance(doc, dict) and isinstance(doc.get("text"), str):
        doc = doc["text"]
    if not isinstance(doc, str):
        raise bad("documents", f"documents[{i}] must be a string (or an object with a string 'text')")
    return doc


def parse(body: bytes, max_chars: int, default_timeout_ms: float, max_timeout_ms: float) -> RerankRequest:
    data = json_object(body)
    query = data.get("query")
    if not isinstance(query, str) or not query:
        raise bad("query", "'query' must be a non-empty string")
    raw = data.get("documents")
    if not isinstance(raw, list) or not raw:
        raise bad("documents", f"'documents' must be a list of 1 to {MAX_DOCUMENTS} strings")
    if len(raw) > MAX_DOCUMENTS:
        raise bad("documents", f"at most {MAX_DOCUMENTS} documents per request, not {len(raw)}")
    documents = [document_text(doc, i) for i, doc in enumerate(raw)]
    for name, text in [("query", query), *(("documents", d) for d in documents)]:
        if len(text) > max_chars:
            raise bad(name, f"a {name.rstrip('s')} is over the {max_chars}-character limit", "string_above_max_length")
    top_n = data.get("top_n")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise bad("top_n", "'top_n' must be a positive integer")
    return_documents = data.get("return_documents", False)
    if not isinstance(return_documents, bool):
        raise bad("return_documents", "'return_documents' must be true or false")
    model = data.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise bad("model", "'model' must be a non-empty string (see GET /v1/models)")
    timeout_ms = data.get("timeout_ms", default_timeout_ms)  # an extension, as on /v1/inference
    if (
        isinstance(timeout_ms, bool)
        or not isinstance(timeout_ms, int | float)
        or not (0 < timeout_ms <= max_timeout_ms)
        or not math.isfinite(timeout_ms)
    ):
        raise bad("timeout_ms", f"'timeout_ms' must be a number of milliseconds in (0, {max_timeout_ms:.0f}]")
    return RerankRequest(query, documents, top_n, return_documents, model, timeout_ms / 1000)
