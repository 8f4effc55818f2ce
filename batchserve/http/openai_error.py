"""OpenAI's words for errors, on the OpenAI-compatible routes (generation, embeddings, rerank, files, batches):
the refusals its clients expect (`bad`: a 400 naming the `param` and a finer `code`). The errors are `ApiError`s
like every other; `http/dialects.OPENAI` renders them as `{"error": {message, type, param, code}}`, declared for
/openapi.json as `http/shapes.OpenAIError`."""

from __future__ import annotations

from batchserve import errors
from batchserve.errors import ApiError


def bad(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    """A 400 for what the body says, naming the field at fault (`param`) and OpenAI's finer `code`."""
    return ApiError(400, "INVALID_REQUEST", message, param=param, reason=code)


def unknown_model(requested: str | None) -> ApiError:
    return ApiError(
        404,
        "MODEL_NOT_FOUND",
        f"the model '{errors.short(requested)}' does not exist here (see GET /v1/models)",
        param="model",
        reason="model_not_found",
    )
