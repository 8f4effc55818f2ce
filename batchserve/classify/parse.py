"""The bodies of `POST /v1/classify` and `POST /predict`, decoded and checked against the server's limits (400
naming the `param`); both become one `Classify`."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from batchserve.classify import shapes
from batchserve.http.plumbing import decode, timeout_s
from batchserve.http.openai_error import bad, refused

CLASSIFY = msgspec.json.Decoder(shapes.ClassifyRequest)
PREDICT = msgspec.json.Decoder(shapes.PredictRequest)

Sequence = str | tuple[str, str]  # one text, or a (text, text_pair)


@dataclass
class Classify:
    sequences: list[Sequence]
    model: str | None  # None: the first classification model
    timeout_s: float | None  # None: the model's own default applies
    service_tier: str | None = None
    raw_scores: bool = False  # /predict: the logits
    batch: bool = False  # /predict: the inputs were a list of lists, answered with a list per input


def checked(
    sequences: list[Sequence], param: str, max_chars: int, timeout_ms: float | msgspec.UnsetType, max_timeout_ms: float
) -> float | None:
    """The request's timeout in seconds (None: none named), once every text is within `max_chars`."""
    for i, seq in enumerate(sequences):
        for text in (seq,) if isinstance(seq, str) else seq:
            if len(text) > max_chars:
                raise bad(param, f"{param}[{i}] is over the {max_chars}-character limit", "string_above_max_length")
    return timeout_s(timeout_ms, max_timeout_ms)


def parse_classify(body: bytes, max_chars: int, max_timeout_ms: float) -> Classify:
    """`/v1/classify`: `input` a text or a list of texts."""
    req = decode(CLASSIFY, body, refused)
    sequences: list[Sequence] = [req.input] if isinstance(req.input, str) else list(req.input)
    timeout_s = checked(sequences, "input", max_chars, req.timeout_ms, max_timeout_ms)
    return Classify(sequences, req.model, timeout_s, req.service_tier)


def sequence(items: list[str]) -> Sequence:
    return items[0] if len(items) == 1 else (items[0], items[1])


def parse_predict(body: bytes, max_chars: int, max_timeout_ms: float) -> Classify:
    """`/predict`, as TEI reads `inputs`: a text; a list of strings, one text or one pair (two strings); or a
    batch, a list of lists of one or two strings. Strings and lists mixed in one list are refused, as TEI does."""
    req = decode(PREDICT, body, refused)
    inputs = [req.inputs] if isinstance(req.inputs, str) else req.inputs
    texts = [x for x in inputs if isinstance(x, str)]
    lists = [x for x in inputs if isinstance(x, list)]
    if texts and lists:
        raise bad("inputs", "`inputs` mixes strings and lists: a batch is a list of lists ([[text], [text, pair]])")
    if len(texts) > 2:
        raise bad(
            "inputs",
            f"`inputs` is a list of {len(texts)} strings: a list of strings is one text [text] or one pair "
            "[text, text_pair]; a batch is a list of such lists",
        )
    batch = bool(lists)
    sequences: list[Sequence] = [sequence(x) for x in lists] if batch else [sequence(texts)]
    timeout_s = checked(sequences, "inputs", max_chars, req.timeout_ms, max_timeout_ms)
    return Classify(sequences, req.model, timeout_s, req.service_tier, req.raw_scores, batch)
