"""The declared shapes of `POST /tokenize` (vLLM's `{prompt}`, or TEI's `{inputs}`) and `POST /detokenize`
(vLLM's `{tokens}`): what `routes.py` decodes and writes, and the operations in /openapi.json. Errors in
OpenAI's shape."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

from batchserve.http.openapi import DocAnswer, Operation
from batchserve.http.shapes import OPENAI, NonNegative

MAX_INPUTS = 1000  # TEI's `inputs` per request

Model = Annotated[
    Annotated[str, Meta(min_length=1)] | None,
    Meta(description="a served model with a tokenizer (GET /v1/models); default: the generation model, else the first"),
]


class TokenizeRequest(Struct):
    """vLLM's `{prompt}` or TEI's `{inputs}` (one of the two); members it does not know are ignored."""

    prompt: Annotated[str, Meta(description="vLLM's shape: answered as {count, max_model_len, tokens}")] | None = None
    inputs: (
        Annotated[
            str | Annotated[list[str], Meta(min_length=1, max_length=MAX_INPUTS)],
            Meta(description="TEI's shape: answered as one list of {id, text} per input"),
        ]
        | None
    ) = None
    model: Model = None
    add_special_tokens: Annotated[bool, Meta(description="the model's special tokens around the text")] = True


class TokenizeResponse(Struct):
    count: NonNegative
    max_model_len: Annotated[int, Meta(ge=0, description="the tokens one input may hold (0: not known)")]
    tokens: list[NonNegative]


class TeiToken(Struct):
    id: NonNegative
    text: Annotated[str, Meta(description="the token as the vocabulary writes it")]


class DetokenizeRequest(Struct):
    """vLLM's `{tokens}`."""

    tokens: Annotated[list[NonNegative], Meta(max_length=1_000_000)]
    model: Model = None


class DetokenizeResponse(Struct):
    prompt: str


OPERATIONS = (
    Operation(
        "POST",
        "/tokenize",
        "tokenize",
        "A text's token ids under a served model's tokenizer (vLLM's shape, or TEI's with `inputs`); no batch runs",
        (DocAnswer(200, "the token ids", TokenizeResponse | list[list[TeiToken]]),),
        OPENAI,
        errors=(400, 401, 404, 413, 429, 500, 503),
        request=Annotated[TokenizeRequest, Meta(examples=[{"prompt": "hello world"}])],
    ),
    Operation(
        "POST",
        "/detokenize",
        "detokenize",
        "The text of token ids under a served model's tokenizer (vLLM's shape); no batch runs",
        (DocAnswer(200, "the text", DetokenizeResponse),),
        OPENAI,
        errors=(400, 401, 404, 413, 429, 500, 503),
        request=Annotated[DetokenizeRequest, Meta(examples=[{"tokens": [1, 2, 3]}])],
    ),
)
