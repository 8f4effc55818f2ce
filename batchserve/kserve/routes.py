"""KServe Open Inference Protocol v2 over HTTP (`/v2/...`), the protocol of Triton's clients and KServe.

`InferEndpoint` top to bottom: identify the caller → read the body (bounded) → parse the v2 tensor
(`wire.py`) → the model by name (and version) → one rate-limit token per element → each element through the
door (`InferenceService.infer`) as its own item, so v2 clients share batches with every other route → the
output tensor, JSON or binary as asked. Errors are v2's `{"error": message}`, with X-Request-ID and, where retrying
later helps, Retry-After; keys, tiers and rate limits are those of every other route.
"""

from __future__ import annotations

import math
import time
from typing import Protocol

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from batchserve import __version__, errors
from batchserve.backends import Backend
from batchserve.config import ModelSpec, Settings
from batchserve.core.service import InferenceService
from batchserve.errors import ApiError, ClientGone
from batchserve.http.plumbing import read_body_from, request_id_from, send_json
from batchserve.http.disconnect import disconnect_probe
from batchserve.http.guards import Guard, costs_of
from batchserve.http.uvicorn_protocol import whole_answer_sender
from batchserve.kserve.wire import EXTENSIONS, HEADER_LENGTH, V2Error, infer_answer, model_metadata, parse_infer
from batchserve.models import ModelRegistry
from batchserve.tenancy import Caller

JSON = "application/json"
CODES = {400: "INVALID_REQUEST", 404: "MODEL_NOT_FOUND", 413: "PAYLOAD_TOO_LARGE"}  # v2 refusals, for the metrics


class KServeHost(Protocol):
    """What the v2 routes read from `app.state.rt` (the runtime, which app.py wires): this much only."""

    settings: Settings
    guard: Guard
    registry: ModelRegistry
    service: InferenceService
    backends: dict[str, Backend]

    def not_ready_reason(self) -> str | None:
        """Why the node takes no traffic now (None when ready): /readyz's reason."""
        ...


def v2_error(err: V2Error | ApiError, headers: dict[str, str]) -> Response:
    if isinstance(err, ApiError):
        out = {**headers, **(err.headers or {})}
        if err.retry_after_ms is not None:
            out["Retry-After"] = str(max(1, math.ceil(err.retry_after_ms / 1000)))
        return Response(orjson.dumps({"error": err.message}), err.status, out, JSON)
    return Response(orjson.dumps({"error": err.message}), err.status, headers, JSON)


def find_model(rt: KServeHost, name: str, version: str | None) -> ModelSpec:
    """The model the path names: `name` (its versions split by weight, as `model` on /v1/inference) or
    `name` + `version`; 404 in v2's words when unknown."""
    spec = rt.registry.by_id.get(f"{name}@{version}") if version is not None else rt.registry.resolve(name)
    if spec is None:
        raise V2Error(
            404,
            f"unknown model '{errors.short(name)}'"
            + (f" version '{errors.short(version)}'" if version is not None else "")
            + " (see GET /v1/models)",
        )
    return spec


async def live(request: Request) -> Response:
    return Response(orjson.dumps({"live": True}), media_type=JSON)


async def ready(request: Request) -> Response:
    """200 when the server takes traffic; v2 says a false answer is a 4xx (this one: 400, with the reason)."""
    rt: KServeHost = request.app.state.rt
    reason = rt.not_ready_reason()
    if reason is None:
        return Response(orjson.dumps({"ready": True}), media_type=JSON)
    return Response(orjson.dumps({"ready": False, "reason": reason}), 400, media_type=JSON)


async def server_metadata(request: Request) -> Response:
    return Response(
        orjson.dumps({"name": "batchserve", "version": __version__, "extensions": EXTENSIONS}), media_type=JSON
    )


async def metadata(request: Request) -> Response:
    rt: KServeHost = request.app.state.rt
    try:
        spec = find_model(rt, request.path_params["model"], request.path_params.get("version"))
    except V2Error as err:
        return v2_error(err, {})
    backend = rt.backends.get(spec.id)
    kind = backend.output_kind if backend is not None else "text"
    versions = [s.version for s in rt.registry.by_name.get(spec.name, [])]
    return Response(orjson.dumps(model_metadata(spec.name, versions, spec.backend, kind)), media_type=JSON)


async def model_ready(request: Request) -> Response:
    rt: KServeHost = request.app.state.rt
    try:
        spec = find_model(rt, request.path_params["model"], request.path_params.get("version"))
    except V2Error as err:
        return v2_error(err, {})
    reason = rt.not_ready_reason() or (None if spec.id in rt.backends else "warming up")
    body = {"name": spec.name, "ready": reason is None, **({"reason": reason} if reason else {})}
    return Response(orjson.dumps(body), 200 if reason is None else 400, media_type=JSON)


V2_HEADERS = {
    b"x-request-id": "x-request-id",
    b"authorization": "authorization",
    b"content-length": "content-length",
    HEADER_LENGTH.encode(): HEADER_LENGTH,
}
MODELS_PREFIX, INFER_SUFFIX = "/v2/models/", "/infer"


def infer_path_params(path: str) -> dict[str, str] | None:
    """{"model"[, "version"]} of `/v2/models/{model}[/versions/{version}]/infer`, or None for any other path."""
    if not (path.startswith(MODELS_PREFIX) and path.endswith(INFER_SUFFIX)):
        return None
    parts = path[len(MODELS_PREFIX) : -len(INFER_SUFFIX)].split("/")
    if len(parts) == 1 and parts[0]:
        return {"model": parts[0]}
    if len(parts) == 3 and parts[0] and parts[1] == "versions" and parts[2]:
        return {"model": parts[0], "version": parts[2]}
    return None


class InferEndpoint:
    """POST /v2/models/{model}[/versions/{version}]/infer as a plain ASGI app, served ahead of Starlette's
    router and middleware as `/v1/inference` is (`app.FastPath`): the same load through v2 should cost the
    server about what it costs through v1 (bench/protocols.py)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rt: KServeHost = scope["app"].state.rt
        s = rt.settings
        guard = rt.guard
        arrived = time.monotonic()
        params = scope.get("path_params") or infer_path_params(scope["path"]) or {}
        scope["path_params"] = params  # for the request span's route name (tracing.py)
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            key = V2_HEADERS.get(name.lower())
            if key is not None and key not in headers:
                headers[key] = value.decode("latin-1")
        request_id = request_id_from(headers.get("x-request-id"))
        answer_headers = {"X-Request-ID": request_id}
        model_id = "unknown"
        inputs = 1  # the elements of its tensor, once parsed
        caller: Caller | None = None  # known once identified: a 429 or a 5xx is booked to it (the SLO ledger)
        try:
            caller = guard.identify(headers.get("authorization"), scope)
            try:
                body = await read_body_from(receive, s.max_body_bytes, headers.get("content-length"))
            except ClientDisconnect:
                return
            req = parse_infer(body, headers.get(HEADER_LENGTH), s.max_input_chars)
            inputs = len(req.texts)
            spec = find_model(rt, params.get("model", ""), params.get("version"))
            model_id = spec.id
            backend = rt.backends.get(spec.id)
            if backend is None:
                raise errors.warming_up()
            timeout_ms = s.timeout_ms if req.timeout_us is None else req.timeout_us / 1000
            if timeout_ms > s.max_timeout_ms:
                raise V2Error(
                    400,
                    f"'parameters.timeout' is over --max-timeout-ms ({s.max_timeout_ms:.0f} ms = "
                    f"{s.max_timeout_ms * 1000:.0f} microseconds)",
                )
            answer_headers.update(guard.take(caller, len(req.texts)))
            try:  # every element its own item, admitted together (as the inputs of /v1/embeddings)
                results = await rt.service.infer_many(
                    req.texts,
                    spec.id,
                    caller.tier,
                    caller.tenant,
                    timeout_ms / 1000,
                    arrived,
                    request_id,
                    disconnect_probe(receive),
                    caller.owner,
                )
            except ClientGone:
                return
            out, header_length = infer_answer(
                req, spec.name, spec.version, [r.output for r in results], backend.output_kind
            )
            guard.ok(model_id, time.monotonic() - arrived, caller, len(req.texts), costs_of(backend, req.texts))
        except ApiError as err:
            guard.refused(model_id, err, caller, inputs)
            await send_error(send, err, answer_headers)
            return
        except V2Error as err:
            code = CODES.get(err.status, "INFERENCE_FAILED")
            guard.refused(model_id, ApiError(err.status, code, err.message), caller, inputs)
            await send_error(send, err, answer_headers)
            return
        if header_length is None:
            media = b"application/json"
        else:
            media = b"application/octet-stream"
            answer_headers["Inference-Header-Content-Length"] = str(header_length)
        raw = [(b"content-type", media), *[(k.encode(), v.encode()) for k, v in answer_headers.items()]]
        send_whole = whole_answer_sender(send)
        if send_whole is not None:  # our own protocol: head and body in one write
            await send_whole(200, b"".join(b"%s: %s\r\n" % h for h in raw), out)
            return
        raw.append((b"content-length", b"%d" % len(out)))
        await send({"type": "http.response.start", "status": 200, "headers": raw})
        await send({"type": "http.response.body", "body": out})


async def send_error(send: Send, err: V2Error | ApiError, headers: dict[str, str]) -> None:
    response = v2_error(err, headers)
    await send_json(
        send,
        response.status_code,
        bytes(response.body),  # Starlette types it bytes | memoryview
        {k: v for k, v in response.headers.items() if k.lower() not in ("content-type", "content-length")},
    )


infer = InferEndpoint()


def fast_route(method: str, path: str) -> ASGIApp | None:
    """The v2 infer endpoint for a path of its shape (`app.FastPath` serves it ahead of the router), else None."""
    if method == "POST" and infer_path_params(path) is not None:
        return infer
    return None


ROUTES = [
    Route("/v2/health/live", live, methods=["GET"]),
    Route("/v2/health/ready", ready, methods=["GET"]),
    Route("/v2", server_metadata, methods=["GET"]),
    Route("/v2/models/{model}", metadata, methods=["GET"]),
    Route("/v2/models/{model}/versions/{version}", metadata, methods=["GET"]),
    Route("/v2/models/{model}/ready", model_ready, methods=["GET"]),
    Route("/v2/models/{model}/versions/{version}/ready", model_ready, methods=["GET"]),
    Route("/v2/models/{model}/infer", infer, methods=["POST"]),
    Route("/v2/models/{model}/versions/{version}/infer", infer, methods=["POST"]),
]
