"""The answer of `POST /v1/rerank`: Cohere's shape (as vLLM and Infinity send it): `results` sorted by
`relevance_score`, highest first, each with the document's `index` in the request and, when asked, the
`document` as `{"text": ...}`; the model that answered; usage in tokens."""

from __future__ import annotations

import math
import secrets
from typing import Any

import orjson

from batchserve.errors import ApiError


def answer(
    scores: list[Any], documents: list[str], top_n: int | None, return_documents: bool, model: str, tokens: int
) -> bytes:
    """The response body; ApiError 500 when the model's outputs are not scores."""
    for i, score in enumerate(scores):
        if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
            raise ApiError(500, "INFERENCE_FAILED", f"the model's output {i} is not a finite score")
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:top_n]
    results = []
    for i in order:
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
