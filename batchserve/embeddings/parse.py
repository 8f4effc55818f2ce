"""The body of `POST /v1/embeddings`, parsed and checked (400 in OpenAI's error shape, naming the `param`):
what a request may say. Shared by the route and by batch-job lines that name `/v1/embeddings`
(`jobs/lines.py`), so both refuse the same bodies in the same words; the answer's shape is `wire.py`'s. Mirrors
`inference/parse.py`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchserve.http.openai_error import bad, json_object

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request
ENCODINGS = ("float", "base64")


@dataclass
class EmbeddingRequest:
    inputs: list[str]
    model: str | None  # None: the first model that serves embeddings
    base64: bool
    timeout_s: float
    dimensions: int | None = None  # keep the first this many components, then L2-normalise again (Matryoshka)


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
    dimensions = data.get("dimensions")
    if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1):
        raise bad("dimensions", "'dimensions' must be a positive integer (at most the model's own width)")
    timeout_ms = data.get("timeout_ms", default_timeout_ms)  # an extension, as on /v1/inference
    if (
        isinstance(timeout_ms, bool)
        or not isinstance(timeout_ms, int | float)
        or not (0 < timeout_ms <= max_timeout_ms)
        or not math.isfinite(timeout_ms)
    ):
        raise bad("timeout_ms", f"'timeout_ms' must be a number of milliseconds in (0, {max_timeout_ms:.0f}]")
    return EmbeddingRequest(inputs, model, fmt == "base64", timeout_ms / 1000, dimensions)
