"""The inference routes (DESIGN §2): `POST /v1/inference` (and `/api/inference`), `GET /v1/requests/{id}`,
`GET /v1/models`.

`InferenceEndpoint.__call__` reads top to bottom as the request path: identify the caller and take a rate
token → read and validate the body → pick the model version → through the door (`InferenceService.infer`:
admission, the batcher's queue, a worker thread runs the batch) → answer with the output and its timings.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Callable

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from batchserve import errors
from batchserve.core.handler import InferenceHandler
from batchserve.errors import ApiError, ClientGone
from batchserve.generation.routes import model_cards
from batchserve.http.body import (client_host, error_body, error_response, inference_headers, json_response,
                                  new_request_id, read_body_from, request_id_from, send_json)
from batchserve.http.inference_body import parse_inference
from batchserve.http.protocol import whole_answer_sender
from batchserve.runtime import Runtime


def disconnect_probe(receive: Receive) -> Callable[[], bool] | None:
    """A cheap "has the caller hung up?" check, read when a batch is formed, so a queued item whose caller
    left never takes a place in a batch. uvicorn's receive() is a method of its per-request cycle, which
    flags the disconnect; other ASGI servers get a watcher task instead (`_Watcher`)."""
    cycle = getattr(receive, "__self__", None)
    if cycle is not None and isinstance(getattr(cycle, "disconnected", None), bool):
        return functools.partial(getattr, cycle, "disconnected")
    return None


class _Watcher:
    """For ASGI servers without a disconnect flag: a task that notes the caller hanging up."""

    def __init__(self, receive: Receive) -> None:
        self.gone = False
        self.task = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True

    def __call__(self) -> bool:
        return self.gone


class InferenceEndpoint:
    """POST /v1/inference as a plain ASGI app: the hot path, so it reads the scope and writes the answer
    itself instead of building Starlette's Request and Response (a third of a bare endpoint's CPU).
    `app.FastPath` calls it directly, ahead of the router; the router's Route points here too (405s, OpenAPI)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rt: Runtime = scope["app"].state.rt
        s = rt.settings
        arrived = time.monotonic()
        headers = inference_headers(scope["headers"])
        request_id = request_id_from(headers.get("x-request-id"))
        model_id = "unknown"
        limit_headers: dict[str, str] = {}
        try:
            caller = rt.tenancy.identify(headers.get("authorization"), client_host(scope))
            limit_headers = rt.tenancy.take_token(caller)
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
                result = await handler.infer(text, model_id, caller.tier, caller.tenant, timeout_s, arrived,
                                             request_id, disconnect_probe(receive) or _Watcher(receive),
                                             caller.owner)
            except ClientGone:
                return  # nobody reads an answer: the connection is gone
            latency_s = time.monotonic() - arrived
            queue_ms, compute_ms = result.queue_s * 1000, result.compute_s * 1000
            rt.answered += 1
            rt.metrics.count_ok(model_id, latency_s)
            out = orjson.dumps({"request_id": request_id, "output": result.output, "model": model_id,
                                "latency_ms": round(latency_s * 1000), "queue_ms": round(queue_ms),
                                "compute_ms": round(compute_ms), "batch_size": result.batch_size})
            headers = [(b"content-type", b"application/json"), (b"x-request-id", request_id.encode()),
                       (b"server-timing", b"queue;dur=%.1f, compute;dur=%.1f" % (queue_ms, compute_ms)),
                       *[(k.encode(), v.encode()) for k, v in limit_headers.items()]]
            send_whole = whole_answer_sender(send)
            if send_whole is not None:  # our own protocol: one write, no per-header checks (all values are ours)
                await send_whole(200, b"".join(b"%s: %s\r\n" % h for h in headers), out)
                return
            headers.append((b"content-length", b"%d" % len(out)))
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": out})
        except ApiError as err:
            rt.answered += 1
            rt.metrics.count_error(model_id, err)
            if limit_headers and not err.headers:
                err.headers = limit_headers
            out, err_headers = error_body(err, request_id)
            await send_json(send, err.status, out, err_headers)


async def request_status(request: Request) -> Response:
    """A recent request's status, to the tenant that made it only: the caller is identified as on the
    inference route, and another tenant's id answers 404 exactly like an unknown one."""
    rt: Runtime = request.app.state.rt
    limit_headers: dict[str, str] = {}
    try:
        caller = rt.tenancy.identify(request.headers.get("authorization"), client_host(request.scope))
        limit_headers = rt.tenancy.take_token(caller)
        record = rt.requests.get(caller.owner, request.path_params["request_id"])
        if record is None:
            raise errors.request_not_found()
    except ApiError as err:
        if limit_headers and not err.headers:
            err.headers = limit_headers
        return error_response(err, new_request_id())  # never the path's id: it may be anything, of any length
    return json_response(record.public(), headers=limit_headers or None)


async def list_models(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    data = [{"id": spec.id, "object": "model", "owned_by": "batchserve", "name": spec.name,
             "version": spec.version, "backend": spec.backend, "weight": spec.weight,
             "output_kind": b.output_kind if (b := rt.backends.get(spec.id)) is not None else None}
            for spec in rt.registry.specs]
    # The chat model first: clients that take the first id as the model to chat with (guidellm, many UIs)
    # get one that /v1/chat/completions accepts.
    data = model_cards(rt.generation) + data
    return json_response({"object": "list", "data": data})


inference = InferenceEndpoint()

# (method, path) -> ASGI app, served by `app.FastPath` ahead of Starlette's router and middleware.
FAST_ROUTES = {("POST", "/v1/inference"): inference, ("POST", "/api/inference"): inference}

ROUTES = [
    Route("/v1/inference", inference, methods=["POST"]),
    Route("/api/inference", inference, methods=["POST"]),
    Route("/v1/requests/{request_id}", request_status, methods=["GET"]),
    Route("/v1/models", list_models, methods=["GET"]),
]
