"""The answers of `POST /v1/classify` (vLLM's shape) and `POST /predict` (TEI's). Each input's output is the
model's classes in label order, `{label, score, logit}` (`backends/hf.FolderClassifier`); anything else is the
model's fault (500)."""

from __future__ import annotations

import math
import secrets
import time
from typing import Any

import orjson

from batchserve.errors import ApiError

Classes = list[tuple[str, float, float]]  # (label, score, logit) in the model's label order


def classes(outputs: list[Any]) -> list[Classes]:
    """Each output as its classes; ApiError 500 when one is not a non-empty list of {label, score, logit}."""
    out = []
    for i, output in enumerate(outputs):
        try:
            row = [(c["label"], c["score"], c["logit"]) for c in output]
        except (TypeError, KeyError, IndexError):
            row = []
        if not row or not all(
            isinstance(label, str) and all(number(v) for v in (score, logit)) for label, score, logit in row
        ):
            raise ApiError(500, "INFERENCE_FAILED", f"the model's output {i} is not a list of classes with scores")
        out.append(row)
    return out


def number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def answer(outputs: list[Any], model: str, tokens: int) -> bytes:
    """The /v1/classify response body."""
    data = []
    for i, row in enumerate(classes(outputs)):
        best = max(range(len(row)), key=lambda k: row[k][1])  # the first of equal scores, as numpy's argmax
        probs = [float(score) for _, score, _ in row]
        data.append({"index": i, "label": row[best][0], "probs": probs, "num_classes": len(row)})
    return orjson.dumps(
        {
            "id": "classify-" + secrets.token_hex(12),
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }
    )


def predictions(row: Classes, raw_scores: bool) -> list[dict[str, Any]]:
    """Every class as TEI's `{score, label}`, highest first (equal scores in label order)."""
    picked = [(float(logit if raw_scores else score), label) for label, score, logit in row]
    return [{"score": s, "label": label} for s, label in sorted(picked, key=lambda p: -p[0])]


def answer_predict(outputs: list[Any], raw_scores: bool, batch: bool) -> bytes:
    """The /predict response body: one list of predictions, or with `batch` one per input."""
    lists = [predictions(row, raw_scores) for row in classes(outputs)]
    return orjson.dumps(lists if batch else lists[0])
