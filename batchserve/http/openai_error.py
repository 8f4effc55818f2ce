"""OpenAI's words for errors, on the OpenAI-compatible routes (generation, embeddings, rerank, files, batches):
the refusals its clients expect (`bad`: a 400 naming the `param` and a finer `code`; `refused`: a body not of its
declared shape, one rule for every such route). The errors are `ApiError`s
like every other; `http/dialects.OPENAI` renders them as `{"error": {message, type, param, code}}`, declared for
/openapi.json as `http/shapes.OpenAIError`."""

from __future__ import annotations

import re

from batchserve import errors
from batchserve.errors import ApiError
from batchserve.http.plumbing import BodyRefusal

_MESSAGE_MEMBER = re.compile(r"^messages\[\d+\](\.[a-z_]+)?")


def bad(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    """A 400 for what the body says, naming the field at fault (`param`) and OpenAI's finer `code`."""
    return ApiError(400, "INVALID_REQUEST", message, param=param, reason=code)


def refused(r: BodyRefusal) -> ApiError:
    """The 400 for a body that is not the declared shape: `param` is the member at fault (a chat message's own
    member, `messages[2].content`); token ids in `input` are refused as unsupported, not as mistyped."""
    if r.field is None:
        return bad(None, r.message, "invalid_json")
    if r.field == "input" and r.path.startswith("input[") and r.got in ("int", "array"):
        return bad("input", "token-id arrays are not supported here: send the text", "unsupported_value")
    if r.field == "messages" and (m := _MESSAGE_MEMBER.match(r.path)):
        return bad(m[0], r.message)
    return bad(r.field, r.message)


def no_model(message: str) -> ApiError:
    """The 404 for a `model` that names none served here, or none that does the work."""
    return ApiError(404, "MODEL_NOT_FOUND", message, param="model", reason="model_not_found")


def unknown_model(requested: str | None) -> ApiError:
    return no_model(f"the model '{errors.short(requested)}' does not exist here (see GET /v1/models)")
