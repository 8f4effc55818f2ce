"""OpenAI's words for errors, on the OpenAI-compatible routes (generation, embeddings, rerank, files, batches):
the refusals its clients expect (`bad`: a 400 naming the `param` and a finer `code`). The errors are `ApiError`s
like every other; `http/dialects.OPENAI` renders them as `{"error": {message, type, param, code}}`, declared for
/openapi.json as `http/shapes.OpenAIError`."""

from __future__ import annotations

import math

import msgspec

from batchserve import errors
from batchserve.errors import ApiError

JSON = "application/json"


def bad(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    """A 400 for what the body says, naming the field at fault (`param`) and OpenAI's finer `code`."""
    return ApiError(400, "INVALID_REQUEST", message, param=param, reason=code)


def timeout_s(timeout_ms: float | msgspec.UnsetType, max_timeout_ms: float) -> float | None:
    """A body's `timeout_ms` in seconds; None when it names none (the model's own default applies,
    `slo.Deadlines`). Outside (0, max] it is a 400 naming the field."""
    if timeout_ms is msgspec.UNSET:
        return None
    if not (0 < timeout_ms <= max_timeout_ms) or not math.isfinite(timeout_ms):
        raise bad("timeout_ms", f"'timeout_ms' must be a number of milliseconds in (0, {max_timeout_ms:.0f}]")
    return timeout_ms / 1000


def unknown_model(requested: str | None) -> ApiError:
    return ApiError(
        404,
        "MODEL_NOT_FOUND",
        f"the model '{errors.short(requested)}' does not exist here (see GET /v1/models)",
        param="model",
        reason="model_not_found",
    )
