"""The answers of `POST /v1/rerank` (Cohere's v1 shape, as vLLM and Infinity send it) and `POST /v2/rerank`
(Cohere's v2 shape): `results` sorted by `relevance_score`, highest first."""

from __future__ import annotations

import math
import secrets
from typing import Any

import orjson

from batchserve.errors import ApiError


def ranked(scores: list[Any], top_n: int | None) -> list[int]:
    """The documents' indices, best score first (ties by index), cut at top_n; ApiError 500 when the model's
    outputs are not scores."""
    for i, score in enumerate(scores):
        if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
            raise ApiError(500, "INFERENCE_FAILED", f"the model's output {i} is not a finite score")
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:top_n]


def answer(
    scores: list[Any], documents: list[str], top_n: int | None, return_documents: bool, model: str, tokens: int
) -> bytes:
    """The v1 response body."""
    results = []
    for i in ranked(scores, top_n):
        result: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
        if return_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    return orjson.dumps(
        {
            "id": "rerank-" + secrets.token_hex(12),
            "results": results,
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


def answer_v2(scores: list[Any], top_n: int | None, tokens: int) -> bytes:
    """The v2 response body (Cohere's `V2RerankResponse`)."""
    return orjson.dumps(
        {
            "id": "rerank-" + secrets.token_hex(12),
            "results": [{"index": i, "relevance_score": float(scores[i])} for i in ranked(scores, top_n)],
            "meta": {"api_version": {"version": "2"}, "tokens": {"input_tokens": tokens}},
        }
    )
