"""The body of `POST /v1/inference`, decoded into its declared shape (`shapes.InferenceRequest`) and checked
against the server's limits: shared by the route and by batch-job lines that name `/v1/inference`
(`jobs/lines.py`), so both refuse the same bodies in the same words. It imports no runtime, so the job scheduler
can use it without an import cycle."""

from __future__ import annotations

import msgspec

from batchserve import errors
from batchserve.config import Settings
from batchserve.http.plumbing import JSON, TOO_DEEP, BodyRefusal, check_json_content_type, decode, refusal
from batchserve.inference.shapes import InferenceRequest

_DECODER = msgspec.json.Decoder(InferenceRequest)


def parse_inference(body: bytes, content_type: str, s: Settings) -> tuple[str, str | None, float | None, str | None]:
    """(input, model, timeout in seconds, priority) from the body, or 400/413 with the reason. The timeout is None
    when the body names none: the model's own default applies (`slo.Deadlines`), known once it is picked."""
    if content_type != JSON:  # what nearly every client sends, compared without a call
        check_json_content_type(content_type)
    # An ASCII body (nearly all) goes straight to the decoder; `decode` checks UTF-8 first for the rest.
    try:
        req = _DECODER.decode(body) if body.isascii() else decode(_DECODER, body)
    except msgspec.ValidationError as exc:
        raise errors.invalid(refusal(str(exc)).message) from None
    except msgspec.DecodeError as exc:  # the ASCII body was not JSON
        raise errors.invalid(f"the body is not valid JSON in UTF-8: {exc}") from None
    except RecursionError:
        raise errors.invalid(TOO_DEEP) from None
    except BodyRefusal as r:
        raise errors.invalid(r.message) from None
    text = req.input
    if len(text) > s.max_input_chars:
        raise errors.payload_too_large(f'"input" is over the {s.max_input_chars}-character limit')
    if req.timeout_ms is msgspec.UNSET:
        return text, req.model, None, req.priority
    timeout_ms = req.timeout_ms
    if not timeout_ms <= s.max_timeout_ms:  # every model's longest timeout (`Deadlines.max_timeout_s`)
        raise errors.invalid(f'"timeout_ms" must be a number of milliseconds in (0, {s.max_timeout_ms:.0f}]')
    return text, req.model, timeout_ms / 1000, req.priority
