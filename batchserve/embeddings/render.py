"""OpenAI's embeddings answer, each vector a JSON list of floats or, with `encoding_format: "base64"`, the base64
of its little-endian float32 bytes (what the official client asks for)."""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

import orjson

from batchserve.errors import ApiError
from batchserve.http.openai_error import bad


def to_base64(vector: list[float]) -> str:
    """The vector as OpenAI's base64: little-endian float32 bytes."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def shorten(vector: list[float], dimensions: int) -> list[float]:
    """The first `dimensions` components, L2-normalised again (OpenAI's `dimensions`: a Matryoshka model's
    prefix is itself an embedding; its length is 1 again so cosine and dot product agree)."""
    head = vector[:dimensions]
    norm = math.sqrt(math.fsum(x * x for x in head))
    return [x / norm for x in head] if norm > 0 else head


def answer(vectors: list[Any], as_base64: bool, model: str, prompt_tokens: int, dimensions: int | None = None) -> bytes:
    """The response body; ApiError 500 when the backend's outputs are not vectors, 400 when `dimensions`
    is over their width."""
    data = []
    try:
        for i, vector in enumerate(vectors):
            if not isinstance(vector, list):
                raise TypeError(f"output {i} is {type(vector).__name__}, not a list of floats")
            if dimensions is not None:
                if dimensions > len(vector):
                    raise bad("dimensions", f"'dimensions' {dimensions} is over the model's width ({len(vector)})")
                vector = shorten(vector, dimensions)
            data.append({"object": "embedding", "index": i, "embedding": to_base64(vector) if as_base64 else vector})
    except (TypeError, struct.error, OverflowError) as exc:  # OverflowError: a component past float32 (1e300)
        raise ApiError(
            500, "INFERENCE_FAILED", f"the model's output is not a vector of float32: {str(exc)[:200]}"
        ) from None
    return orjson.dumps(
        {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }
    )
