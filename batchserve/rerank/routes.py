"""`POST /v1/rerank` and `/rerank` (Cohere's shape), top to bottom, as `/v1/embeddings` does it: identify the
caller (401, or 429 before the body is read) → read and parse the body (`body.py`) → pick a reranking model →
one rate-limit token per document → each (query, document) pair through the door as one input
(`InferenceService.infer_many`: one admission for the request, each pair its own item), so the pairs of
concurrent callers share batches → sort by score, cut at top_n → answer (`wire.py`). Errors in OpenAI's shape."""

from __future__ import annotations

import time
from typing import Protocol

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from batchserve import errors
from batchserve.backends import Backend
from batchserve.backends.hf import pair_input
from batchserve.config import ModelSpec, Settings
from batchserve.core.service import InferenceService
from batchserve.errors import ApiError, ClientGone
from batchserve.http.plumbing import read_body, request_id_of
from batchserve.http.disconnect import disconnect_probe
from batchserve.http.guards import Guard, costs_of
from batchserve.http.openai_error import JSON, OpenAIError, error_response
from batchserve.models import ModelRegistry
from batchserve.rerank.parse import parse
from batchserve.rerank.render import answer
from batchserve.tenancy import Caller

RERANKING = "reranking"


class RerankHost(Protocol):
    """What the rerank route reads from `app.state.rt` (the runtime, which app.py wires)."""

    settings: Settings
    guard: Guard
    registry: ModelRegistry
    service: InferenceService
    backends: dict[str, Backend]


def reranking_models(rt: RerankHost) -> list[ModelSpec]:
    return [spec for spec in rt.registry.by_id.values() if spec.task == RERANKING]


def pick_model(rt: RerankHost, requested: str | None, key_id: str) -> tuple[str, Backend]:
    """The id of the model version that answers (404, or 400 when it does not rerank) and its backend."""
    if requested is None:
        served = reranking_models(rt)
        if not served:
            raise OpenAIError(
                404,
                "no model serves reranking here (serve a cross-encoder folder with --model; see GET /v1/models)",
                "model",
                "model_not_found",
            )
        requested = served[0].name
    spec = rt.registry.resolve(requested, key_id)
    if spec is None:
        raise OpenAIError(
            404,
            f"the model '{errors.short(requested)}' does not exist here (see GET /v1/models)",
            "model",
            "model_not_found",
        )
    if spec.task != RERANKING:
        raise OpenAIError(
            400, f"the model '{spec.id}' does not rerank (a cross-encoder folder does)", "model", "model_not_reranker"
        )
    backend = rt.backends.get(spec.id)
    if backend is None:
        raise OpenAIError.from_api(errors.warming_up())
    return spec.id, backend


async def rerank(request: Request) -> Response:
    rt: RerankHost = request.app.state.rt
    s = rt.settings
    guard = rt.guard
    arrived = time.monotonic()
    caller: Caller | None = None  # known once identified: a 429 is booked to it (the SLO ledger)
    try:
        caller = guard.identify(request.headers.get("authorization"), request.scope, openai=True)
        guard.check(caller)
    except ApiError as err:  # refused before its body is read
        guard.counted()
        guard.settle("unknown", caller, err.status, 0.0)
        return error_response(OpenAIError.from_api(err), {"X-Request-ID": request_id_of(request)})
    headers = {"X-Request-ID": request_id_of(request)}
    refused: tuple[str, ApiError] | None = None
    pairs: list[str] = []
    try:
        try:
            body = await read_body(request, s.max_body_bytes)
        except ApiError as err:
            raise OpenAIError.from_api(err) from None
        except ClientDisconnect:
            return Response(status_code=499)
        req = parse(body, s.max_input_chars, s.timeout_ms, s.max_timeout_ms)
        model_id, backend = pick_model(rt, req.model, caller.key_id)
        pairs = [pair_input(req.query, doc) for doc in req.documents]
        try:
            headers.update(guard.take(caller, len(pairs)))
            results = await rt.service.infer_many(
                pairs,
                model_id,
                caller.tier,
                caller.tenant,
                req.timeout_s,
                arrived,
                headers["X-Request-ID"],
                disconnect_probe(request.receive),
                caller.owner,
            )
        except ApiError as err:
            refused = (model_id, err)
            raise OpenAIError.from_api(err) from None
        except ClientGone:
            return Response(status_code=499)
        try:
            tokens = sum(backend.count_tokens(pairs) or ())  # the pairs' kept encodings: no tokenizing here
        except Exception:  # noqa: BLE001 - usage is not worth failing the answer
            tokens = 0
        out = answer([r.output for r in results], req.documents, req.top_n, req.return_documents, model_id, tokens)
        guard.ok(model_id, time.monotonic() - arrived, caller, len(pairs), costs_of(backend, pairs))
        return Response(out, media_type=JSON, headers=headers)
    except OpenAIError as err:
        if refused is not None:
            guard.refused(*refused, caller, max(1, len(pairs)))
        else:
            guard.counted()
        return error_response(err, headers)


ROUTES = [Route("/v1/rerank", rerank, methods=["POST"]), Route("/rerank", rerank, methods=["POST"])]
