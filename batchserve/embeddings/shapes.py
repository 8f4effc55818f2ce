"""The declared shapes of `POST /v1/embeddings` (OpenAI's): the request `parse.py` decodes, the answer
`render.py` writes, and the operation in /openapi.json. Errors in OpenAI's shape."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from batchserve.http.openapi import DocAnswer, model_post
from batchserve.http.shapes import OPENAI, NonNegative, Priority, Text, Timeout

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request


class EmbeddingRequest(Struct):
    """What `POST /v1/embeddings` takes; members it does not know are ignored."""

    input: Annotated[
        Text | Annotated[list[Text], Meta(min_length=1, max_length=MAX_INPUTS)],
        Meta(description="text, or a list of texts; each is one item on the batcher (token-id arrays: 400)"),
    ]
    model: Annotated[
        Text | None,
        Meta(description="a model whose backend produces embeddings (GET /v1/models); default: the first such model"),
    ] = None
    encoding_format: Annotated[
        Literal["float", "base64"] | None,
        Meta(description="base64: the little-endian float32 bytes of each vector"),
    ] = None
    dimensions: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(
            description="keep the first N components of each vector and L2-normalise them again (Matryoshka "
            "truncation); over the model's width: 400"
        ),
    ] = None
    user: Annotated[str | None, Meta(description="accepted and ignored")] = None
    timeout_ms: Timeout | UnsetType = UNSET
    service_tier: Priority | None = None


class Embedding(Struct):
    object: Literal["embedding"]
    index: NonNegative
    embedding: Annotated[
        list[float] | str, Meta(description="the vector, or with encoding_format base64 its float32 bytes in base64")
    ]


class EmbeddingUsage(Struct):
    prompt_tokens: NonNegative
    total_tokens: NonNegative


class EmbeddingList(Struct):
    object: Literal["list"]
    data: Annotated[list[Embedding], Meta(description="one vector per input, in input order")]
    model: Annotated[str, Meta(description="name@version that served it")]
    usage: EmbeddingUsage


OPERATIONS = (
    model_post(
        "/v1/embeddings",
        "createEmbedding",
        "OpenAI-compatible embeddings; each input rides the batcher on its own",
        DocAnswer(200, "one vector per input, in input order", EmbeddingList),
        OPENAI,
        Annotated[EmbeddingRequest, Meta(examples=[{"input": ["hello", "world"]}])],
    ),
)
