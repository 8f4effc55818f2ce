"""HTTP routes (DESIGN §2). The inference handler reads top to bottom as the request path:
parse and validate → pick the model → admission → batcher queue → (worker thread runs the batch) → answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from typing import AsyncIterator, Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from batchserve import admission, errors, openai_api, openapi
from batchserve.batcher import Item
from batchserve.config import Settings
from batchserve.errors import ApiError, ClientGone
from batchserve.gpu_pool import ItemResult
from batchserve.http_io import inference_headers, json_response, parse_json_object, read_body, request_id_of
from batchserve.jobs import api as jobs_api
from batchserve.runtime import Runtime


def parse_inference(body: bytes, content_type: str, s: Settings) -> tuple[str, str | None, float]:
    """(input, model, timeout in seconds) from the body, or 400/413 with the reason."""
    data = parse_json_object(body, content_type)
    text = data.get("input")
    if not isinstance(text, str) or not text:
        raise errors.invalid('"input" must be a non-empty string')
    if len(text) > s.max_input_chars:
        raise ApiError(413, "PAYLOAD_TOO_LARGE", f'"input" is over the {s.max_input_chars}-character limit')
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


async def watch_disconnect(request: Request, item: Item) -> None:
    """Fail the item's future when the caller hangs up (for ASGI servers without a disconnect flag)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            if not item.future.done():
                item.future.set_exception(ClientGone())
            return


def expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(errors.deadline_exceeded())


def count_ok(rt: Runtime, model_id: str, latency_s: float) -> None:
    children = rt.ok_metrics.get(model_id)
    if children is None:
        children = rt.ok_metrics[model_id] = (rt.metrics.requests.labels(model_id, "200"),
                                              rt.metrics.request_duration.labels(model_id))
    children[0].inc()
    children[1].observe(latency_s)


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
            raise ApiError(404, "MODEL_NOT_FOUND", f"no model {requested_model!r} is served here (see /v1/models)")
        model_id = spec.id
        admission.admit(rt.batcher, rt.pool, model_id, s.max_queue,
                        admission.tier_bound_s(s.slo_ms, s.admission_slack, caller.tier), timeout_s,
                        caller.tier, caller.tenant, rt.admission)
        backend = rt.backends[model_id]
        record = rt.requests.add(request_id, model_id)
        loop = asyncio.get_running_loop()
        item = Item(text, model_id, backend.bucket_of(text), loop.create_future(),
                    arrived, arrived + timeout_s, record, caller.tier, caller.tenant,
                    gone=disconnect_probe(request))
        if item.gone is None:
            asyncio.ensure_future(watch_disconnect(request, item))  # ends by itself with the response
        rt.batcher.submit(item)
        rt.inflight += 1
        timer = loop.call_later(timeout_s - (time.monotonic() - arrived), expire, item.future)
        try:
            result: ItemResult = await item.future
        except ClientGone:
            record.status, record.error = "failed", "CLIENT_DISCONNECTED"
            return Response(status_code=499)
        except ApiError as err:
            record.status, record.error = "failed", err.code
            raise
        finally:
            timer.cancel()
            rt.inflight -= 1
        latency_ms = (time.monotonic() - arrived) * 1000
        queue_ms, compute_ms = result.queue_s * 1000, result.compute_s * 1000
        record.status, record.latency_ms = "completed", round(latency_ms, 1)
        record.queue_ms, record.compute_ms, record.batch_size = round(queue_ms, 1), round(compute_ms, 1), result.batch_size
        rt.answered += 1
        count_ok(rt, model_id, latency_ms / 1000)
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
        rt.metrics.requests.labels(model_id, str(err.status)).inc()
        if err.status in (401, 413, 429, 503):
            rt.metrics.rejected.labels(err.code).inc()
        if limit_headers and not err.headers:
            err.headers = limit_headers
        return errors.error_response(err, request_id)


async def request_status(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    request_id = request.path_params["request_id"]
    record = rt.requests.get(request_id)
    if record is None:
        return errors.error_response(
            ApiError(404, "REQUEST_NOT_FOUND", "no recent request has this id on this node"), request_id)
    return json_response(record.public())


async def healthz(request: Request) -> Response:
    return json_response({"status": "ok"})


async def readyz(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    healthy = rt.pool.healthy_count() if rt.pool else 0
    if rt.draining:
        reason = "draining"
    elif rt.startup_error:
        reason = f"start-up failed: {rt.startup_error}"
    elif not rt.ready:
        reason = "warming up"
    elif healthy == 0:
        reason = "no healthy worker"
    else:
        return json_response({"status": "ready", "healthy_workers": healthy})
    return json_response({"status": "not_ready", "reason": reason, "healthy_workers": healthy}, status=503)


async def internal_health(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    s = rt.settings
    now = time.monotonic()
    workers = []
    if rt.pool is not None:
        for w in rt.pool.workers:
            workers.append({
                "id": w.index, "device": w.name, "healthy": w.healthy, "busy": w.batch is not None,
                "batch_size": len(w.batch.items) if w.batch is not None else 0,
                "running_ms": round((now - w.started) * 1000) if w.batch is not None else 0,
                "batches": w.batches, "busy_ratio": round(rt.busy_ratios.get(w.name, 0.0), 3),
            })
    healthy = sum(1 for w in workers if w["healthy"])
    status = ("draining" if rt.draining else "starting" if not rt.ready else
              "ok" if healthy == len(workers) else "degraded" if healthy else "unavailable")
    return json_response({
        "status": status,
        "gpu_utilization": round(rt.gpu_utilization, 3),
        "queue_depth": rt.batcher.total_depth(),
        "requests_per_second": round(rt.requests_per_second, 1),
        "inflight": rt.inflight,
        "batch_ms": {m: round(v * 1000, 1) for m, v in rt.batcher.batch_s.items()},
        "slo_ms": s.slo_ms, "timeout_ms": s.timeout_ms,
        "gpu_timeout_ms": round(rt.pool.timeout_s() * 1000) if rt.pool else None,
        "arrivals_per_s": round(rt.admission.arrivals.current(now), 1),
        "workers": workers,
    })


async def metrics(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    return Response(generate_latest(rt.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def list_models(request: Request) -> Response:
    rt: Runtime = request.app.state.rt
    data = [{"id": spec.id, "object": "model", "owned_by": "batchserve", "name": spec.name,
             "version": spec.version, "backend": spec.backend, "weight": spec.weight}
            for spec in rt.registry.specs]
    data += openai_api.model_cards(rt)
    return json_response({"object": "list", "data": data})


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED"}.get(exc.status_code, "HTTP_ERROR")
    return errors.error_response(ApiError(exc.status_code, code, str(exc.detail)), request_id_of(request))


def create_app(settings: Settings, on_startup_failure: Callable[[str], None] | None = None) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        rt = Runtime.create(settings)
        rt.on_startup_failure = on_startup_failure
        app.state.rt = rt
        starting = asyncio.create_task(rt.start())
        try:
            yield
        finally:
            starting.cancel()
            await rt.stop()

    routes = [
        Route("/v1/inference", inference, methods=["POST"]),
        Route("/api/inference", inference, methods=["POST"]),
        Route("/v1/requests/{request_id}", request_status, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/internal/health", internal_health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi.openapi_json, methods=["GET"]),
        *jobs_api.ROUTES,
        *openai_api.routes,
    ]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
