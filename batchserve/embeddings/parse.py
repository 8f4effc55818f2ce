"""The body of `POST /v1/embeddings`, decoded into its declared shape (`shapes.EmbeddingRequest`) and checked
against the server's limits: 400 in OpenAI's error shape, naming the `param`. Shared by the route and by batch-job
lines that name `/v1/embeddings` (`jobs/lines.py`), so both refuse the same bodies in the same words. Mirrors
`inference/parse.py`."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from batchserve.embeddings import shapes
from batchserve.http.plumbing import decode, timeout_s
from batchserve.http.openai_error import bad, refused

_DECODER = msgspec.json.Decoder(shapes.EmbeddingRequest)


@dataclass
class ParsedEmbedding:
    inputs: list[str]
    model: str | None  # None: the first model that serves embeddings
    base64: bool
    timeout_s: float | None  # None: none named, the model's own default applies (`slo.Deadlines`)
    dimensions: int | None = None  # keep the first this many components, then L2-normalise again (Matryoshka)
    service_tier: str | None = None  # the priority it asks for (`Work.ask`)


def parse(body: bytes, max_chars: int, max_timeout_ms: float) -> ParsedEmbedding:
    req = decode(_DECODER, body, refused)
    inputs = [req.input] if isinstance(req.input, str) else req.input
    for i, text in enumerate(inputs):
        if len(text) > max_chars:
            raise bad("input", f"input[{i}] is over the {max_chars}-character limit", "string_above_max_length")
    return ParsedEmbedding(
        inputs,
        req.model,
        req.encoding_format == "base64",
        timeout_s(req.timeout_ms, max_timeout_ms),
        req.dimensions,
        req.service_tier,
    )
