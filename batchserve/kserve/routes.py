"""KServe Open Inference Protocol v2 over HTTP (`/v2/...`), the protocol of Triton's clients and KServe.

Every route is a declaration on the one request path (`http/endpoint.py`) in the KServe dialect. `infer` sends each
element through the door as its own item, so v2 clients share batches with every other route, and is served ahead of
Starlette's router (`app.FastPath`) as `/v1/inference` is, so the same load costs about what it costs through v1.
"""

from __future__ import annotations

from dataclasses import dataclass
import orjson
from starlette.routing import Route
from starlette.types import ASGIApp

from batchserve import __version__, errors
from batchserve.backends import Backend
from batchserve.config import ModelSpec
from batchserve.core.fairqueue import ItemResult
from batchserve.http.dialects import KSERVE
from batchserve.http.endpoint import Answer, Call, Endpoint, public
from batchserve.kserve.host import KServeHost, find_model
from batchserve.kserve.parse import InferRequest, parse_infer
from batchserve.kserve.render import infer_answer, metadata_of
from batchserve.kserve.shapes import EXTENSIONS, HEADER_LENGTH


def model_named(rt: KServeHost, name: str, version: str | None) -> ModelSpec:
    """The model a v2 path names (`find_model`), a 404 pointing at the model list."""
    return find_model(rt, name, version, " (see GET /v1/models)")


async def live(rt: KServeHost, call: Call, req: None) -> dict[str, object]:
    return {"live": True}


async def server_metadata(rt: KServeHost, call: Call, req: None) -> dict[str, object]:
    return {"name": "batchserve", "version": __version__, "extensions": EXTENSIONS}


def ready_body(reason: str | None) -> dict[str, object]:
    return {"ready": True} if reason is None else {"ready": False, "reason": reason}


async def readiness(rt: KServeHost, call: Call, req: None) -> dict[str, object]:
    return ready_body(rt.not_ready_reason())


def render_ready(rt: KServeHost, call: Call, req: None, body: dict[str, object]) -> Answer:
    """200 when the server (or the model) takes traffic; v2 says a false answer is a 4xx: 400, with the reason."""
    return Answer(orjson.dumps(body), status=200 if body["ready"] else 400)


def path_spec(rt: KServeHost, call: Call) -> ModelSpec:
    params = call.scope["path_params"]
    return model_named(rt, params["model"], params.get("version"))


async def metadata(rt: KServeHost, call: Call, req: None) -> dict[str, object]:
    return metadata_of(rt, path_spec(rt, call))


async def model_readiness(rt: KServeHost, call: Call, req: None) -> dict[str, object]:
    spec = path_spec(rt, call)
    reason = rt.not_ready_reason() or (None if spec.id in rt.backends else "warming up")
    return {"name": spec.name, **ready_body(reason)}


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


@dataclass(slots=True)
class Infer:
    """A parsed v2 request, the model version it names and its backend."""

    req: InferRequest
    spec: ModelSpec
    backend: Backend


def parse_request(rt: KServeHost, call: Call, body: bytes) -> Infer:
    """The v2 tensor → the model by the path's name (and version) → its timeout."""
    s = rt.settings
    scope = call.scope
    params = scope.get("path_params") or infer_path_params(scope["path"]) or {}
    scope["path_params"] = params  # for the request span's route name (tracing.py)
    req = parse_infer(body, call.headers.get(HEADER_LENGTH), s.max_input_chars)
    spec = model_named(rt, params.get("model", ""), params.get("version"))
    call.work.model = spec.id
    backend = rt.backends.get(spec.id)
    if backend is None:
        raise errors.warming_up()
    # none named: the model's own default
    timeout_ms = rt.registry.deadlines[spec.id].timeout_s * 1000 if req.timeout_us is None else req.timeout_us / 1000
    if timeout_ms > s.max_timeout_ms:
        raise errors.invalid(
            f"'parameters.timeout' is over --max-timeout-ms ({s.max_timeout_ms:.0f} ms = "
            f"{s.max_timeout_ms * 1000:.0f} microseconds)"
        )
    call.work.due_in(timeout_ms / 1000)
    call.run_at(req.priority, "parameters.priority")
    return Infer(req, spec, backend)


async def infer_many(rt: KServeHost, call: Call, x: Infer) -> list[ItemResult]:
    """Every element its own item, admitted together (as the inputs of /v1/embeddings)."""
    return await rt.service.infer_many(call.work, x.req.texts)


def render(rt: KServeHost, call: Call, x: Infer, results: list[ItemResult]) -> Answer:
    out, header_length = infer_answer(
        x.req, x.spec.name, x.spec.version, [r.output for r in results], x.backend.output_kind
    )
    if header_length is None:
        return Answer(out)
    return Answer(out, b"application/octet-stream", ((b"inference-header-content-length", b"%d" % header_length),))


infer: Endpoint[KServeHost, Infer, list[ItemResult]] = Endpoint(
    KSERVE, parse_request, infer_many, render, tokens=lambda x: len(x.req.texts), headers=(HEADER_LENGTH.encode(),)
)
live_route: Endpoint[KServeHost, None, dict[str, object]] = public(KSERVE, live)
ready_route: Endpoint[KServeHost, None, dict[str, object]] = public(KSERVE, readiness, render_ready)
server_route: Endpoint[KServeHost, None, dict[str, object]] = public(KSERVE, server_metadata)
metadata_route: Endpoint[KServeHost, None, dict[str, object]] = public(KSERVE, metadata)
model_ready_route: Endpoint[KServeHost, None, dict[str, object]] = public(KSERVE, model_readiness, render_ready)


def fast_route(method: str, path: str) -> ASGIApp | None:
    """The v2 infer endpoint for a path of its shape, else None."""
    if method == "POST" and infer_path_params(path) is not None:
        return infer
    return None


ROUTES = [
    Route("/v2/health/live", live_route, methods=["GET"]),
    Route("/v2/health/ready", ready_route, methods=["GET"]),
    Route("/v2", server_route, methods=["GET"]),
    Route("/v2/models/{model}", metadata_route, methods=["GET"]),
    Route("/v2/models/{model}/versions/{version}", metadata_route, methods=["GET"]),
    Route("/v2/models/{model}/ready", model_ready_route, methods=["GET"]),
    Route("/v2/models/{model}/versions/{version}/ready", model_ready_route, methods=["GET"]),
    Route("/v2/models/{model}/infer", infer, methods=["POST"]),
    Route("/v2/models/{model}/versions/{version}/infer", infer, methods=["POST"]),
]
