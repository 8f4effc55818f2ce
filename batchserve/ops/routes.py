"""Operational routes: liveness, readiness, the node's health and Prometheus metrics (these two only with
`--metrics-key` when one is set) and the OpenAPI document."""

from __future__ import annotations

import os
import time
from typing import Protocol

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.routing import Route

from batchserve.http.model_choice import ModelRegistry
from batchserve.core.admission import Admission
from batchserve.core.batcher import Batcher
from batchserve.core.load_signal import Reading
from batchserve.core.service import InferenceService
from batchserve.gpu_pool import GpuPool
from batchserve.http.dialects import NATIVE
from batchserve.http.endpoint import Answer, Call, Endpoint, Served, operational, public
from batchserve.metrics import Metrics


class OpsHost(Served, Protocol):
    """What the operational routes read from `app.state.rt`."""

    metrics: Metrics
    registry: ModelRegistry
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


async def healthz(rt: OpsHost, call: Call, req: None) -> dict[str, object]:
    return {"status": "ok"}


async def readiness(rt: OpsHost, call: Call, req: None) -> dict[str, object]:
    healthy = rt.pool.healthy_count() if rt.pool else 0
    reason = rt.not_ready_reason()
    if reason is None:
        return {"status": "ready", "healthy_workers": healthy}
    return {"status": "not_ready", "reason": reason, "healthy_workers": healthy}


def render_ready(rt: OpsHost, call: Call, req: None, body: dict[str, object]) -> Answer:
    return Answer(orjson.dumps(body), status=200 if body["status"] == "ready" else 503)


def worker_states(rt: OpsHost) -> list[dict[str, object]]:
    """Each device worker as /internal/health shows it: health, the batch it runs now, its busy share."""
    if rt.pool is None:
        return []
    now = time.monotonic()
    return [
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
        for w in rt.pool.workers
    ]


async def internal_health(rt: OpsHost, call: Call, req: None) -> dict[str, object]:
    workers = worker_states(rt)
    healthy = sum(1 for w in workers if w["healthy"])
    load = rt.load_reading()
    batch_times, answer_times = rt.batch_times(), rt.answer_times()
    deadlines = {m: d.public() for m, d in rt.registry.deadlines.items()}
    if rt.draining:
        status = "draining"
    elif not rt.ready:
        status = "starting"
    else:
        status = "ok" if healthy == len(workers) else "degraded" if healthy else "unavailable"
    return {
        "status": status,
        "gpu_utilization": round(rt.gpu_utilization, 3),
        "queue_depth": rt.batcher.total_depth(),
        "requests_per_second": round(rt.requests_per_second, 1),
        "inflight": rt.service.inflight,
        # The batcher's models by learned batch time, the stepper's by answer time (docs/capacity.md).
        "batch_ms": {m: round(v * 1000, 1) for m, v in batch_times.items()},
        "answer_ms": {m: round(v * 1000, 1) for m, v in answer_times.items()},
        "inference_path": {**{m: "batcher" for m in batch_times}, **{m: "stepper" for m in answer_times}},
        # Each model's own SLO and timeouts (set, or derived)
        **{key: {m: d[key] for m, d in deadlines.items()} for key in ("slo_ms", "timeout_ms", "max_timeout_ms")},
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
        # Which process answered: with --processes the shared port reaches any of them.
        "pid": os.getpid(),
        "process": (
            {"index": slot.index, "of": slot.of, "own_port": slot.own_port}
            if (slot := rt.settings.process_slot) is not None
            else None
        ),
    }


async def metrics(rt: OpsHost, call: Call, req: None) -> bytes:
    return generate_latest(rt.metrics.registry)


def render_metrics(rt: OpsHost, call: Call, req: None, text: bytes) -> Answer:
    return Answer(text, CONTENT_TYPE_LATEST.encode())


async def openapi_json(rt: OpsHost, call: Call, req: None) -> bytes:
    return call.scope["app"].state.openapi


def render_document(rt: OpsHost, call: Call, req: None, document: bytes) -> Answer:
    return Answer(document)


liveness: Endpoint[OpsHost, None, dict[str, object]] = public(NATIVE, healthz)
ready: Endpoint[OpsHost, None, dict[str, object]] = public(NATIVE, readiness, render_ready)
health: Endpoint[OpsHost, None, dict[str, object]] = operational(NATIVE, internal_health)
scrape: Endpoint[OpsHost, None, bytes] = operational(NATIVE, metrics, render_metrics)
document: Endpoint[OpsHost, None, bytes] = public(NATIVE, openapi_json, render_document)

ROUTES = [
    Route("/healthz", liveness, methods=["GET"]),
    Route("/readyz", ready, methods=["GET"]),
    Route("/health", ready, methods=["GET"]),  # what clients of vLLM/TGI/TEI probe: 200 only when serving
    Route("/internal/health", health, methods=["GET"]),
    Route("/metrics", scrape, methods=["GET"]),
    Route("/openapi.json", document, methods=["GET"]),
]
