"""The body of `POST /v1/inference`, parsed and checked: shared by the route and by batch-job lines that name
`/v1/inference` (`jobs/lines.py`), so both refuse the same bodies in the same words. It imports no runtime, so
the job scheduler can use it without an import cycle."""

from __future__ import annotations

from batchserve import errors
from batchserve.config import Settings
from batchserve.http.plumbing import check_input, parse_json_object


def parse_inference(body: bytes, content_type: str, s: Settings) -> tuple[str, str | None, float]:
    """(input, model, timeout in seconds) from the body, or 400/413 with the reason."""
    data = parse_json_object(body, content_type)
    text = check_input(data.get("input"), '"input"', s.max_input_chars)
    model = data.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise errors.invalid('"model" must be a non-empty string when given')
    timeout_ms = data.get("timeout_ms", s.timeout_ms)
    if (
        isinstance(timeout_ms, bool)
        or not isinstance(timeout_ms, int | float)
        or not (0 < timeout_ms <= s.max_timeout_ms)
    ):
        raise errors.invalid(f'"timeout_ms" must be a number of milliseconds in (0, {s.max_timeout_ms:.0f}]')
    return text, model, timeout_ms / 1000
