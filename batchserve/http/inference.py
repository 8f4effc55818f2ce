"""The inference routes (DESIGN §2): `POST /v1/inference` (and `/api/inference`), `GET /v1/requests/{id}`,
`GET /v1/models`.

`inference` reads top to bottom as the request path: identify the caller and take a rate token → read and
validate the body → pick the model version → through the door (`InferenceService.infer`: admission, the
batcher's queue, a worker thread runs the batch) → answer with the output and its timings.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from batchserve import errors
from batchserve.config import Settings
from batchserve.errors import ApiError, ClientGone
from batchserve.generation.routes import model_cards
from batchserve.http.body import (error_response, inference_headers, json_response, parse_json_object, read_body,
                                  request_id_of)
from batchserve.runtime import Runtime


def parse_inference(body: bytes, content_type: str, s: Settings) -> tuple[str, str | None, float]:
    """(input, model, timeout in seconds) from the body, or 400/413 with the reason."""
    data = parse_json_object(body, content_type)
    text = data.get("input")
    if not isinstance(text, str) or not text:
        raise errors.invalid('"input" must be a non-empty string')
    if len(text) > s.max_input_chars:
        raise errors.payload_too_large(f'"input" is over the {s.max_input_chars}-character limit')
    model = data.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise errors.invalid('"model" must be a non-empty string when given')
    timeout_ms = data.get("timeout_ms", s.timeout_ms)
    if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int | float) or not (
            0 < timeout_ms <= s.max_timeout_ms):
        raise errors.invalid(f'"timeout_ms" must be a number of milliseconds in (0, {s.max_timeout_ms:.0f}]')
    return text, model, timeout_ms / 1000


def disconnect_probe(request: Request) -> Callable[[], bool] | None:
    """A cheap "has the caller hung up?" check, read when a batch is formed, so a queued item whose caller
    left never takes a place in a batch. uvicorn's receive() is a method of its per-request cycle, which
    flags the disconnect; other ASGI servers get a watcher task instead (`watch_disconnect`)."""
    cycle = getattr(request.receive, "__self__", None)
    if cycle is not None and isinstance(getattr(cycle, "disconnected", None), bool):
        return functools.partial(getattr, cycle, "disconnected")
    return None


class _Watcher:
    """For ASGI servers without a disconnect flag: a task that notes the caller hanging up."""

    def __init__(self, request: Request) -> None:
        self.gone = False
        self.task = asyncio.ensure_future(self._watch(request))

    async def _watch(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.gone = True

    def __call__(self) -> bool:
        return self.gone


async def inference(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    s = rt.settings
    arrived = time.monotonic()
    headers = inference_headers(request)
    request_id = request_id_of(request, headers.get("x-request-id", ""))
    model_id = "unknown"
    limit_headers: dict[str, str] = {}
    try:
        caller = rt.tenancy.identify(headers.get("authorization"))
        limit_headers = rt.tenancy.take_token(caller)
        try:
            body = await read_body(request, s.max_body_bytes, headers.get("content-length"))
        except ClientDisconnect:
            return Response(status_code=499)
        text, requested_model, timeout_s = parse_inference(body, headers.get("content-type", ""), s)
        spec = rt.registry.resolve(requested_model, caller.key_id)
        if spec is None:
            raise errors.model_not_found(requested_model)
        model_id = spec.id
        try:
            result = await rt.service.infer(text, model_id, caller.tier, caller.tenant, timeout_s, arrived,
                                            request_id, disconnect_probe(request) or _Watcher(request))
        except ClientGone:
            return Response(status_code=499)
        latency_ms = (time.monotonic() - arrived) * 1000
        queue_ms, compute_ms = result.queue_s * 1000, result.compute_s * 1000
        rt.answered += 1
        rt.metrics.count_ok(model_id, latency_ms / 1000)
        return json_response(
            {"request_id": request_id, "output": result.output, "model": model_id,
             "latency_ms": round(latency_ms), "queue_ms": round(queue_ms), "compute_ms": round(compute_ms),
             "batch_size": result.batch_size},
            headers={"X-Request-ID": request_id,
                     "Server-Timing": f"queue;dur={queue_ms:.1f}, compute;dur={compute_ms:.1f}",
                     **limit_headers},
        )
    except ApiError as err:
        rt.answered += 1
        rt.metrics.count_error(model_id, err)
        if limit_headers and not err.headers:
            err.headers = limit_headers
        return error_response(err, request_id)


async def request_status(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    request_id = request.path_params["request_id"]
    record = rt.requests.get(request_id)
    if record is None:
        return error_response(errors.request_not_found(), request_id)
    return json_response(record.public())


async def list_models(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    data = [{"id": spec.id, "object": "model", "owned_by": "batchserve", "name": spec.name,
             "version": spec.version, "backend": spec.backend, "weight": spec.weight,
             "output_kind": b.output_kind if (b := rt.backends.get(spec.id)) is not None else None}
            for spec in rt.registry.specs]
    data += model_cards(rt.generation)
    return json_response({"object": "list", "data": data})


ROUTES = [
    Route("/v1/inference", inference, methods=["POST"]),
    Route("/api/inference", inference, methods=["POST"]),
    Route("/v1/requests/{request_id}", request_status, methods=["GET"]),
    Route("/v1/models", list_models, methods=["GET"]),
]
