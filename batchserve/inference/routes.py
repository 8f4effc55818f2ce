"""The inference routes (DESIGN §2): `POST /v1/inference` (and `/api/inference`), `GET /v1/requests/{id}`,
`GET /v1/models`.

`InferenceEndpoint.__call__` reads top to bottom as the request path: identify the caller and take a rate
token → read and validate the body → pick the model version → through the door (`InferenceService.infer`:
admission, the batcher's queue, a worker thread runs the batch) → answer with the output and its timings.
"""

from __future__ import annotations

import time
from typing import Protocol

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from batchserve import errors
from batchserve.backends import Backend
from batchserve.config import Settings
from batchserve.core.handler import InferenceHandler
from batchserve.core.requests_log import RequestLog
from batchserve.core.service import InferenceService
from batchserve.errors import ApiError, ClientGone
from batchserve.http.plumbing import (
    error_body,
    error_response,
    inference_headers,
    json_response,
    new_request_id,
    read_body_from,
    request_id_from,
    send_json,
)
from batchserve.http.disconnect import Watcher, disconnect_probe
from batchserve.http.guards import Guard, costs_of
from batchserve.inference.parse import parse_inference
from batchserve.http.uvicorn_protocol import whole_answer_sender
from batchserve.models import ModelRegistry
from batchserve.tenancy import Caller


class InferenceHost(Protocol):
    """What the inference routes read from `app.state.rt` (the runtime, which app.py wires): this much only."""

    settings: Settings
    guard: Guard
    registry: ModelRegistry
    service: InferenceService
    requests: RequestLog
    backends: dict[str, Backend]

    def model_cards(self) -> list[dict[str, object]]:
        """GET /v1/models' entries for the models outside the batcher (the generation engine's)."""
        ...


# The 200 answer's own header lines (X-RateLimit-* follow for a keyed caller): request id, queue and compute ms.
ANSWER_HEAD = (
    b"content-type: application/json\r\nx-request-id: %s\r\nserver-timing: queue;dur=%.1f, compute;dur=%.1f\r\n"
)


class InferenceEndpoint:
    """POST /v1/inference as a plain ASGI app: the hot path, so it reads the scope and writes the answer
    itself instead of building Starlette's Request and Response (a third of a bare endpoint's CPU).
    `app.FastPath` calls it directly, ahead of the router; the router's Route points here too (405s, OpenAPI)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rt: InferenceHost = scope["app"].state.rt
        s = rt.settings
        guard = rt.guard
        arrived = time.monotonic()
        headers = inference_headers(scope["headers"])
        request_id = request_id_from(headers.get("x-request-id"))
        model_id = "unknown"
        limit_headers: dict[str, str] = {}
        caller: Caller | None = None  # known once identified: a 429 is booked to it (the SLO ledger)
        try:
            caller = guard.identify(headers.get("authorization"), scope)
            limit_headers = guard.take(caller)
            try:
                body = await read_body_from(receive, s.max_body_bytes, headers.get("content-length"))
            except ClientDisconnect:
                return
            text, requested_model, timeout_s = parse_inference(body, headers.get("content-type", ""), s)
            spec = rt.registry.resolve(requested_model, caller.key_id)
            if spec is None:
                raise errors.model_not_found(requested_model)
            model_id = spec.id
            # The one door, read as the narrow handler: it answers on the batcher, or hands a generative model
            # to the generation engine's stepper (`--inference-path`, generation/inference.py).
            handler: InferenceHandler = rt.service
            try:
                result = await handler.infer(
                    text,
                    model_id,
                    caller.tier,
                    caller.tenant,
                    timeout_s,
                    arrived,
                    request_id,
                    disconnect_probe(receive) or Watcher(receive),
                    caller.owner,
                )
            except ClientGone:
                return  # nobody reads an answer: the connection is gone
            latency_s = time.monotonic() - arrived
            queue_ms, compute_ms = result.queue_s * 1000, result.compute_s * 1000
            guard.ok(model_id, latency_s, caller, 1, costs_of(rt.backends.get(model_id), (text,)))
            out = orjson.dumps(
                {
                    "request_id": request_id,
                    "output": result.output,
                    "model": model_id,
                    "latency_ms": round(latency_s * 1000),
                    "queue_ms": round(queue_ms),
                    "compute_ms": round(compute_ms),
                    "batch_size": result.batch_size,
                }
            )
            send_whole = whole_answer_sender(send)
            if send_whole is not None:  # our own protocol: one write, no per-header checks (all values are ours)
                head = ANSWER_HEAD % (request_id.encode(), queue_ms, compute_ms)  # one format, not one per header
                if limit_headers:
                    head += b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in limit_headers.items())
                await send_whole(200, head, out)
                return
            raw_headers = [
                (b"content-type", b"application/json"),
                (b"x-request-id", request_id.encode()),
                (b"server-timing", b"queue;dur=%.1f, compute;dur=%.1f" % (queue_ms, compute_ms)),
                *[(k.encode(), v.encode()) for k, v in limit_headers.items()],
                (b"content-length", b"%d" % len(out)),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": raw_headers})
            await send({"type": "http.response.body", "body": out})
        except ApiError as err:
            guard.refused(model_id, err, caller)
            if limit_headers and not err.headers:
                err.headers = limit_headers
            out, err_headers = error_body(err, request_id)
            await send_json(send, err.status, out, err_headers)


async def request_status(request: Request) -> Response:
    """A recent request's status, to the tenant that made it only: the caller is identified as on the
    inference route, and another tenant's id answers 404 exactly like an unknown one."""
    rt: InferenceHost = request.app.state.rt
    limit_headers: dict[str, str] = {}
    try:
        caller, limit_headers = rt.guard.admit(request.headers.get("authorization"), request.scope)
        record = rt.requests.get(caller.owner, request.path_params["request_id"])
        if record is None:
            raise errors.request_not_found()
    except ApiError as err:
        rt.guard.counted()
        if limit_headers and not err.headers:
            err.headers = limit_headers
        return error_response(err, new_request_id())  # never the path's id: it may be anything, of any length
    rt.guard.counted()
    return json_response(record.public(), headers=limit_headers or None)


async def list_models(request: Request) -> Response:
    rt: InferenceHost = request.app.state.rt
    data = [
        {
            "id": spec.id,
            "object": "model",
            "owned_by": "batchserve",
            "name": spec.name,
            "version": spec.version,
            "backend": spec.backend,
            "weight": spec.weight,
            "output_kind": b.output_kind if (b := rt.backends.get(spec.id)) is not None else None,
        }
        for spec in rt.registry.specs
    ]
    # The chat model first: clients that take the first id as the model to chat with (guidellm, many UIs)
    # get one that /v1/chat/completions accepts.
    return json_response({"object": "list", "data": [*rt.model_cards(), *data]})


inference = InferenceEndpoint()

# (method, path) -> ASGI app, served by `app.FastPath` ahead of Starlette's router and middleware.
FAST_ROUTES = {("POST", "/v1/inference"): inference, ("POST", "/api/inference"): inference}

ROUTES = [
    Route("/v1/inference", inference, methods=["POST"]),
    Route("/api/inference", inference, methods=["POST"]),
    Route("/v1/requests/{request_id}", request_status, methods=["GET"]),
    Route("/v1/models", list_models, methods=["GET"]),
]
