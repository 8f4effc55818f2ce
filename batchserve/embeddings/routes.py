"""`POST /v1/embeddings` (OpenAI's shape), top to bottom: identify the caller (401, or 429 when its bucket is
empty: before the body is read) → read and parse the body (`body.py`) → pick an embedding model → take one
rate-limit token per input → each input through the door on its own (`InferenceService.infer_many`: one
admission for the request, then each input its own item), so inputs of concurrent callers share batches → count
the tokens → answer (`wire.py`). Each module is entered once but the guard, which is left for the body and
entered again to take the tokens and to count the answer (tests/unit/http/test_request_path.py).
Errors are in OpenAI's shape; keys, tiers and rate limits are those of every other route."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from batchserve import errors
from batchserve.backends import Backend
from batchserve.config import ModelSpec, Settings
from batchserve.core.service import InferenceService
from batchserve.embeddings.parse import parse
from batchserve.embeddings.render import answer
from batchserve.errors import ApiError, ClientGone
from batchserve.http.plumbing import read_body, request_id_of
from batchserve.http.disconnect import disconnect_probe
from batchserve.http.guards import Guard, costs_of
from batchserve.http.openai_error import JSON, OpenAIError, error_response
from batchserve.models import ModelRegistry
from batchserve.tenancy import Caller

log = logging.getLogger("batchserve.embeddings")

COUNT_INLINE_CHARS = 8192  # token counting of more text than this runs on a thread, beside the inference


class EmbeddingsHost(Protocol):
    """What the embeddings route reads from `app.state.rt` (the runtime, which app.py wires): this much only."""

    settings: Settings
    guard: Guard
    registry: ModelRegistry
    service: InferenceService
    backends: dict[str, Backend]


def embedding_models(rt: EmbeddingsHost) -> list[ModelSpec]:
    """The versions whose backend makes vectors, in the configured order (read by id: `ModelSpec.id` is
    computed at each use)."""
    return [
        spec
        for model_id, spec in rt.registry.by_id.items()
        if (b := rt.backends.get(model_id)) is not None and b.output_kind == "embedding"
    ]


def pick_model(rt: EmbeddingsHost, requested: str | None, key_id: str) -> tuple[str, Backend]:
    """The id of the model version that answers (404, or 400 when it does not embed) and its backend."""
    if requested is None:
        served = embedding_models(rt)
        if not served:
            raise OpenAIError(404, "no model serves embeddings here (see GET /v1/models)", "model", "model_not_found")
        requested = served[0].name
    spec = rt.registry.resolve(requested, key_id)
    if spec is None:
        raise OpenAIError(
            404,
            f"the model '{errors.short(requested)}' does not exist here (see GET /v1/models)",
            "model",
            "model_not_found",
        )
    model_id = spec.id
    backend = rt.backends.get(model_id)
    if backend is None:
        raise OpenAIError.from_api(errors.warming_up())
    if backend.output_kind != "embedding":
        raise OpenAIError(
            400,
            f"the model '{model_id}' does not produce embeddings (its outputs are "
            f"{backend.output_kind}); use POST /v1/inference",
            "model",
            "model_not_embedding",
        )
    return model_id, backend


async def prompt_tokens(backend: Backend, inputs: list[str], counting: asyncio.Future | None) -> int:
    """usage.prompt_tokens from the backend's tokenizer; 0 when it cannot count (a plugin without
    count_tokens, or one that failed: the vectors are still the answer)."""
    try:
        counts = await counting if counting is not None else backend.count_tokens(inputs)
    except Exception:
        log.warning("count_tokens of %s failed", backend.source.name, exc_info=True)
        return 0
    return sum(counts) if counts else 0


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


async def embeddings(request: Request) -> Response:
    rt: EmbeddingsHost = request.app.state.rt
    s = rt.settings
    guard = rt.guard
    arrived = time.monotonic()
    caller: Caller | None = None  # known once identified: a 429 is booked to it (the SLO ledger)
    try:
        caller = guard.identify(request.headers.get("authorization"), request.scope, openai=True)
        guard.check(caller)
    except ApiError as err:  # refused before its body is read; the caller's request id, as on every answer
        guard.counted()
        guard.settle("unknown", caller, err.status, 0.0)
        return error_response(OpenAIError.from_api(err), {"X-Request-ID": request_id_of(request)})
    request_id = request_id_of(request)
    headers = {"X-Request-ID": request_id}
    refused: tuple[str, ApiError] | None = None
    inputs = 1  # the inputs of its list, once parsed
    try:
        try:
            body = await read_body(request, s.max_body_bytes)
        except ApiError as err:
            raise OpenAIError.from_api(err) from None
        except ClientDisconnect:
            return Response(status_code=499)
        req = parse(body, s.max_input_chars, s.timeout_ms, s.max_timeout_ms)
        inputs = len(req.inputs)
        model_id, backend = pick_model(rt, req.model, caller.key_id)
        counting = None
        if sum(map(len, req.inputs)) > COUNT_INLINE_CHARS:
            counting = asyncio.ensure_future(asyncio.to_thread(backend.count_tokens, req.inputs))
            counting.add_done_callback(_retrieve)  # when the request fails first, nobody awaits it
        try:
            headers.update(guard.take(caller, len(req.inputs)))
            # Every input as its own item, admitted together: the door predicts the batches they will make.
            results = await rt.service.infer_many(
                req.inputs,
                model_id,
                caller.tier,
                caller.tenant,
                req.timeout_s,
                arrived,
                request_id,
                disconnect_probe(request.receive),
                caller.owner,
            )
        except ApiError as err:
            refused = (model_id, err)  # counted by its code in the model's metrics, as on every route
            raise OpenAIError.from_api(err) from None
        except ClientGone:
            return Response(status_code=499)
        body = answer(
            [r.output for r in results],
            req.base64,
            model_id,
            await prompt_tokens(backend, req.inputs, counting),
            req.dimensions,
        )
        guard.ok(model_id, time.monotonic() - arrived, caller, inputs, costs_of(backend, req.inputs))
        return Response(body, media_type=JSON, headers=headers)
    except OpenAIError as err:
        if refused is not None:
            guard.refused(*refused, caller, inputs)
        else:  # the caller's mistake (4xx, no SLO outcome), or a model still warming up (503, refused)
            guard.counted()
            guard.settle("unknown", caller, err.status, 0.0, inputs)
        return error_response(err, headers)


ROUTES = [Route("/v1/embeddings", embeddings, methods=["POST"])]
