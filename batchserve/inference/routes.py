"""The inference routes (docs/contract.md#api): `POST /v1/inference` (and `/api/inference`), `GET /v1/requests/{id}`,
`GET /v1/models`, each declared on the one request path (`http/endpoint.py`).

`POST /v1/inference` is the hot path: `parse` (pick the model version) → `handle` (the door,
`InferenceService.infer`) → `render` (the output and its timings).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Protocol

import orjson
from starlette.routing import Route

from batchserve import errors
from batchserve.backends import Backend
from batchserve.http.model_choice import ModelRegistry
from batchserve.core.fairqueue import ItemResult
from batchserve.core.ledger import RequestLog
from batchserve.core.service import InferenceService
from batchserve.http.dialects import NATIVE
from batchserve.http.endpoint import COUNTED, JSON_MEDIA, Answer, Call, Endpoint, Served, as_json, no_body, public
from batchserve.inference.parse import parse_inference


class InferenceHost(Served, Protocol):
    """What the inference routes read from `app.state.rt`."""

    registry: ModelRegistry
    service: InferenceService
    requests: RequestLog
    backends: dict[str, Backend]

    def model_cards(self) -> list[dict[str, object]]: ...  # the generation engine's, outside the batcher


def parse(rt: InferenceHost, call: Call, body: bytes) -> str:
    """The input; the model version that answers (404 when none) and the deadline, in `call.work`."""
    text, requested_model, timeout_s, priority = parse_inference(
        body, call.headers.get("content-type", ""), rt.settings
    )
    caller = call.caller
    assert caller is not None  # the endpoint identifies its callers
    model = rt.registry.resolve_id(requested_model, caller.key_id)
    if model is None:
        raise errors.model_not_found(requested_model)
    call.work.model = model
    call.work.due_in(rt.registry.deadlines[model].timeout_s if timeout_s is None else timeout_s)  # its own default
    if priority is not None:
        call.run_at(priority, "priority")
    return text


def infer(rt: InferenceHost, call: Call, text: str) -> Awaitable[ItemResult]:
    """The door's awaitable, handed back to the skeleton as it is (no coroutine of this route's own in between:
    the hot path)."""
    return rt.service.infer(call.work, text)


def render(rt: InferenceHost, call: Call, text: str, result: ItemResult) -> Answer:
    queue_ms, compute_ms = result.queue_s * 1000, result.compute_s * 1000
    out = orjson.dumps(
        {
            "request_id": call.work.request_id,
            "output": result.output,
            "model": call.work.model,
            "latency_ms": round((time.monotonic() - call.work.arrived) * 1000),
            "queue_ms": round(queue_ms),
            "compute_ms": round(compute_ms),
            "batch_size": result.batch_size,
        }
    )
    timing = b"queue;dur=%.1f, compute;dur=%.1f" % (queue_ms, compute_ms)
    return Answer(out, JSON_MEDIA, ((b"server-timing", timing),))  # positional: the hot path


async def find_request(rt: InferenceHost, call: Call, req: None) -> dict:
    """A recent request's status, to its own tenant only: another tenant's id answers 404 like an unknown one."""
    record = rt.requests.get(call.who.owner, call.scope["path_params"]["request_id"])
    if record is None:
        raise errors.request_not_found()
    return record.public()


async def models(rt: InferenceHost, call: Call, req: None) -> list[dict[str, object]]:
    data: list[dict[str, object]] = [
        {
            "id": spec.id,
            "object": "model",
            "owned_by": "batchserve",
            "name": spec.name,
            "version": spec.version,
            "backend": spec.backend,
            "weight": spec.weight,
            "output_kind": b.output_kind if (b := rt.backends.get(spec.id)) is not None else None,
            **rt.registry.deadlines[spec.id].public(),  # its own SLO and timeouts (slo.Deadlines)
        }
        for spec in rt.registry.specs
    ]
    # The chat model first: clients that take the first id as the model to chat with (guidellm, many UIs)
    # get one that /v1/chat/completions accepts.
    return [*rt.model_cards(), *data]


def render_models(rt: InferenceHost, call: Call, req: None, data: list[dict[str, object]]) -> Answer:
    return Answer(orjson.dumps({"object": "list", "data": data}))


inference: Endpoint[InferenceHost, str, ItemResult] = Endpoint(NATIVE, parse, infer, render)
request_status: Endpoint[InferenceHost, None, dict] = Endpoint(
    NATIVE, no_body, find_request, as_json, book=COUNTED, body=False
)
list_models: Endpoint[InferenceHost, None, list[dict[str, object]]] = public(NATIVE, models, render_models)

ROUTES = [
    Route("/v1/inference", inference, methods=["POST"]),
    Route("/api/inference", inference, methods=["POST"]),
    Route("/v1/requests/{request_id}", request_status, methods=["GET"]),
    Route("/v1/models", list_models, methods=["GET"]),
]
