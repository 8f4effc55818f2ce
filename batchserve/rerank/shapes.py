"""The declared shapes of `POST /v1/rerank` and `/rerank` (Cohere's v1, as TEI, Infinity and vLLM take it) and
`POST /v2/rerank` (Cohere's v2, as `cohere.ClientV2.rerank` sends it): the requests `parse.py` decodes, the
answers `render.py` writes, and the operations in /openapi.json. Errors in OpenAI's shape."""

from __future__ import annotations

from typing import Annotated

from msgspec import UNSET, Meta, Struct, UnsetType

from batchserve.http.openapi import DocAnswer, model_post, versioned_posts
from batchserve.http.shapes import OPENAI, NonNegative, Priority, Text, Timeout

MAX_DOCUMENTS = 1000  # documents per request (Cohere's limit)

Model = Annotated[Text | None, Meta(description="a reranking model (GET /v1/models); default: the first")]
TopN = Annotated[int, Meta(ge=1, description="answer the best N only (default: all)")]


class Document(Struct):
    text: Text


class RerankRequest(Struct):
    """What `POST /v1/rerank` takes; members it does not know are ignored."""

    query: Text
    documents: Annotated[
        list[Text | Document],
        Meta(
            min_length=1,
            max_length=MAX_DOCUMENTS,
            description="strings, or Cohere's {text}; each (query, document) pair is one input on the batcher",
        ),
    ]
    top_n: TopN | None = None
    return_documents: Annotated[bool, Meta(description="echo each document's text in its result")] = False
    model: Model = None
    timeout_ms: Timeout | UnsetType = UNSET
    service_tier: Priority | None = None


class RerankResult(Struct, omit_defaults=True):
    index: Annotated[int, Meta(ge=0, description="the document's place in the request")]
    relevance_score: Annotated[
        float,
        Meta(description="as sentence-transformers' CrossEncoder.predict gives it (sigmoid of the logit by default)"),
    ]
    document: Annotated[Document, Meta(description="with return_documents: true")] | UnsetType = UNSET


class RerankUsage(Struct):
    prompt_tokens: NonNegative
    total_tokens: NonNegative


class RerankResponse(Struct):
    id: str
    results: Annotated[list[RerankResult], Meta(description="sorted by relevance_score, highest first")]
    model: Annotated[str, Meta(description="name@version that served it")]
    usage: RerankUsage


class V2RerankRequest(Struct):
    """What `POST /v2/rerank` takes (Cohere's v2: documents are strings); members it does not know are ignored
    (`relevant_spans`, `priority`)."""

    query: Text
    documents: Annotated[
        list[Text],
        Meta(min_length=1, max_length=MAX_DOCUMENTS, description="each (query, document) pair is one input"),
    ]
    model: Model = None
    top_n: TopN | None = None
    max_tokens_per_doc: (
        Annotated[int, Meta(ge=1, description="accepted; a pair is cut at the model's own sequence length")] | None
    ) = None
    timeout_ms: Timeout | UnsetType = UNSET
    service_tier: Priority | None = None


class V2RerankResult(Struct):
    index: Annotated[int, Meta(ge=0, description="the document's place in the request")]
    relevance_score: float


class ApiVersion(Struct):
    version: str


class MetaTokens(Struct):
    input_tokens: NonNegative


class V2RerankMeta(Struct):
    api_version: ApiVersion
    tokens: MetaTokens


class V2RerankResponse(Struct):
    id: str
    results: Annotated[list[V2RerankResult], Meta(description="sorted by relevance_score, highest first")]
    meta: V2RerankMeta


OPERATIONS = (
    *versioned_posts(
        "/v1/rerank",
        "rerank",
        "Rerank documents against a query (Cohere's shape); each pair rides the batcher on its own",
        DocAnswer(200, "the documents' scores, best first", RerankResponse),
        OPENAI,
        Annotated[RerankRequest, Meta(examples=[{"query": "capital", "documents": ["Paris", "a cat"]}])],
    ),
    model_post(
        "/v2/rerank",
        "rerankV2",
        "Rerank documents against a query (Cohere's v2 shape); each pair rides the batcher on its own",
        DocAnswer(200, "the documents' scores, best first", V2RerankResponse),
        OPENAI,
        Annotated[V2RerankRequest, Meta(examples=[{"model": "rr", "query": "capital", "documents": ["Paris"]}])],
    ),
)
