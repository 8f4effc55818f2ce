"""OpenAI's embeddings request and answer: parsing a body (400 in OpenAI's error shape, naming the `param`),
and the answer, with each vector as a JSON list of floats or, with `encoding_format: "base64"`, as the
base64 of its little-endian float32 bytes (what OpenAI sends, and what the official client asks for)."""

from __future__ import annotations

import base64
import math
import struct
from dataclasses import dataclass
from typing import Any

import orjson

from batchserve.http.openai_error import OpenAIError, bad, json_object

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request
ENCODINGS = ("float", "base64")


@dataclass
class EmbeddingRequest:
    inputs: list[str]
    model: str | None  # None: the first model that serves embeddings
    base64: bool
    timeout_s: float


def parse(body: bytes, max_chars: int, default_timeout_ms: float, max_timeout_ms: float) -> EmbeddingRequest:
    data = json_object(body)
    raw = data.get("input")
    inputs = [raw] if isinstance(raw, str) else raw
    if not isinstance(inputs, list) or not inputs:
        raise bad("input", f"'input' must be a non-empty string or a list of 1 to {MAX_INPUTS} non-empty strings")
    if len(inputs) > MAX_INPUTS:
        raise bad("input", f"at most {MAX_INPUTS} inputs per request, not {len(inputs)}")
    for i, text in enumerate(inputs):
        if isinstance(text, str):
            if not text:
                raise bad("input", f"input[{i}] is empty")
            if len(text) > max_chars:
                raise bad("input", f"input[{i}] is over the {max_chars}-character limit", "string_above_max_length")
        elif isinstance(text, int | list) and not isinstance(text, bool):
            raise bad("input", "token-id arrays are not supported here: send the text", "unsupported_value")
        else:
            raise bad("input", f"input[{i}] must be a string, not {type(text).__name__}")
    model = data.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise bad("model", "'model' must be a non-empty string (see GET /v1/models)")
    fmt = data.get("encoding_format")
    if fmt is not None and fmt not in ENCODINGS:
        raise bad("encoding_format", f"'encoding_format' must be one of {', '.join(ENCODINGS)}")
    if data.get("dimensions") is not None:
        raise bad("dimensions", "'dimensions' is not supported: this server returns the model's own vectors",
                  "unsupported_parameter")
    timeout_ms = data.get("timeout_ms", default_timeout_ms)  # an extension, as on /v1/inference
    if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int | float) or not (
            0 < timeout_ms <= max_timeout_ms) or not math.isfinite(timeout_ms):
        raise bad("timeout_ms", f"'timeout_ms' must be a number of milliseconds in (0, {max_timeout_ms:.0f}]")
    return EmbeddingRequest(inputs, model, fmt == "base64", timeout_ms / 1000)


def to_base64(vector: list[float]) -> str:
    """The vector as OpenAI's base64: little-endian float32 bytes."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def answer(vectors: list[Any], as_base64: bool, model: str, prompt_tokens: int) -> bytes:
    """The response body; OpenAIError 500 when the backend's outputs are not vectors."""
    data = []
    try:
        for i, vector in enumerate(vectors):
            if not isinstance(vector, list):
                raise TypeError(f"output {i} is {type(vector).__name__}, not a list of floats")
            data.append({"object": "embedding", "index": i,
                         "embedding": to_base64(vector) if as_base64 else vector})
    except (TypeError, struct.error, OverflowError) as exc:  # OverflowError: a component past float32 (1e300)
        raise OpenAIError(500, f"the model's output is not a vector of float32: {str(exc)[:200]}", None,
                          "inference_failed") from None
    return orjson.dumps({"object": "list", "data": data, "model": model,
                         "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})
