"""Operational routes: liveness, readiness, the node's health, Prometheus metrics and the OpenAPI document,
plus the JSON rendering of the router's own 404/405."""

from __future__ import annotations

import logging
import os
import time
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from batchserve import errors
from batchserve.config import Settings
from batchserve.core.admission import Admission
from batchserve.core.batcher import Batcher
from batchserve.core.load_signal import Reading
from batchserve.core.service import InferenceService
from batchserve.gpu_pool import GpuPool
from batchserve.http.plumbing import JSON, json_response, request_id_of
from batchserve.http.dialects import error_response
from batchserve.http.guards import operational
from batchserve.logsafe import printable
from batchserve.metrics import Metrics


class OpsHost(Protocol):
    """What the operational routes read from `app.state.rt` (the runtime): the node's state, to report it."""

    settings: Settings
    metrics: Metrics
    batcher: Batcher
    admission: Admission
    service: InferenceService
    pool: GpuPool | None
    ready: bool
    gpu_utilization: float
    requests_per_second: float
    busy_ratios: dict[str, float]

    @property
    def draining(self) -> bool: ...

    def not_ready_reason(self) -> str | None: ...

    def load_reading(self) -> Reading: ...

    def batch_times(self) -> dict[str, float]: ...

    def answer_times(self) -> dict[str, float]: ...


async def healthz(request: Request) -> Response:
    return json_response({"status": "ok"})


async def readyz(request: Request) -> Response:
    rt: OpsHost = request.app.state.rt
    healthy = rt.pool.healthy_count() if rt.pool else 0
    reason = rt.not_ready_reason()
    if reason is None:
        return json_response({"status": "ready", "healthy_workers": healthy})
    return json_response({"status": "not_ready", "reason": reason, "healthy_workers": healthy}, status=503)


async def internal_health(request: Request) -> Response:
    rt: OpsHost = request.app.state.rt
    now = time.monotonic()
    workers = []
    if rt.pool is not None:
        for w in rt.pool.workers:
            workers.append(
                {
                    "id": w.index,
                    "device": w.name,
                    "healthy": w.healthy,
                    "busy": w.batch is not None,
                    "batch_size": len(w.batch.items) if w.batch is not None else 0,
                    "running_ms": round((now - w.started) * 1000) if w.batch is not None else 0,
                    "batches": w.batches,
                    "busy_ratio": round(rt.busy_ratios.get(w.name, 0.0), 3),
                }
            )
    healthy = sum(1 for w in workers if w["healthy"])
    load = rt.load_reading()
    batch_times, answer_times = rt.batch_times(), rt.answer_times()
    status = (
        "draining"
        if rt.draining
        else "starting"
        if not rt.ready
        else "ok"
        if healthy == len(workers)
        else "degraded"
        if healthy
        else "unavailable"
    )
    return json_response(
        {
            "status": status,
            "gpu_utilization": round(rt.gpu_utilization, 3),
            "queue_depth": rt.batcher.total_depth(),
            "requests_per_second": round(rt.requests_per_second, 1),
            "inflight": rt.service.inflight,
            # The batcher's models by their learned batch time; the stepper's (their /v1/inference runs on the
            # generation engine, docs/capacity.md) by their answer time, and each model by the path that answers it.
            "batch_ms": {m: round(v * 1000, 1) for m, v in batch_times.items()},
            "answer_ms": {m: round(v * 1000, 1) for m, v in answer_times.items()},
            "inference_path": {**{m: "batcher" for m in batch_times}, **{m: "stepper" for m in answer_times}},
            "slo_ms": rt.settings.slo_ms,
            "timeout_ms": rt.settings.timeout_ms,  # set, or derived from the warm-up
            "batch_ms_by_size": {
                m: {str(n): round(v * 1000, 1) for n, v in rt.batcher.batch_s.by_size(m).items()}
                for m in rt.batcher.batch_s.models()
                if m in batch_times
            },
            "gpu_timeout_ms": round(rt.pool.timeout_s() * 1000) if rt.pool else None,
            "arrivals_per_s": round(rt.admission.arrival_rate(), 1),
            "load_ratio": round(load.load_ratio(), 3),  # the autoscaling signals (core/load_signal.py)
            "predicted_wait_ratio": round(load.predicted_wait_ratio(), 3),
            "workers": workers,
            # Which process answered: with --processes the shared port reaches any of them; each one's own port
            # reaches it alone (batchserve/http/processes.py).
            "pid": os.getpid(),
            "process": (
                {"index": slot.index, "of": slot.of, "own_port": slot.own_port}
                if (slot := rt.settings.process_slot) is not None
                else None
            ),
        }
    )


async def metrics(request: Request) -> Response:
    rt: OpsHost = request.app.state.rt
    return Response(generate_latest(rt.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def openapi_json(request: Request) -> Response:
    return Response(request.app.state.openapi, media_type=JSON)


log = logging.getLogger("batchserve")


async def internal_error(request: Request, exc: Exception) -> Response:
    """Any exception no route expected: a JSON 500 that says nothing of it; the traceback goes to the log."""
    log.error("unexpected error on %s %s", request.method, printable(request.url.path), exc_info=exc)
    return error_response(errors.internal_error(), request_id_of(request))


async def http_error(request: Request, exc: Exception) -> Response:
    """The router's own 404 and 405, in the one error shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        path = request.url.path
        slash = f": paths take no trailing slash ({printable(path.rstrip('/'), 200)})" if path.endswith("/") else ""
        err = errors.not_found(f"{exc.detail}{slash}")
    elif exc.status_code == 405:
        err = errors.method_not_allowed(str(exc.detail))
    else:
        err = errors.ApiError(exc.status_code, "HTTP_ERROR", str(exc.detail))
    return error_response(err, request_id_of(request))


ROUTES = [
    Route("/healthz", healthz, methods=["GET"]),
    Route("/readyz", readyz, methods=["GET"]),
    Route("/health", readyz, methods=["GET"]),  # what clients of vLLM/TGI/TEI probe: 200 only when serving
    Route("/internal/health", operational(internal_health), methods=["GET"]),
    Route("/metrics", operational(metrics), methods=["GET"]),
    Route("/openapi.json", openapi_json, methods=["GET"]),
]
