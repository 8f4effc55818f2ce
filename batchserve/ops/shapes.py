"""The declared answers of the operational routes (`ops/routes.py`): liveness, readiness, the node's health,
Prometheus metrics and the OpenAPI document itself, and their operations in /openapi.json."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from batchserve.http.openapi import DocAnswer, Operation
from batchserve.http.shapes import NATIVE, NonNegative

Ratio = Annotated[float, Meta(ge=0, le=1)]


class Liveness(Struct):
    status: Literal["ok"]


class Readiness(Struct):
    status: Literal["ready", "not_ready"]
    healthy_workers: NonNegative
    reason: Annotated[str, Meta(description="why not ready: warming up, draining, no healthy worker")] = ""


class Worker(Struct):
    id: int
    device: str
    healthy: bool
    busy: bool
    batch_size: NonNegative = 0
    running_ms: NonNegative = 0
    batches: NonNegative = 0
    busy_ratio: Ratio = 0.0


class ProcessSlot(Struct):
    """With --processes: which child answered, of how many, and the port where it alone answers (its own
    /metrics, /readyz, /internal/health)."""

    index: NonNegative
    of: Annotated[int, Meta(ge=1)]
    own_port: Annotated[int, Meta(ge=1)]


PerModel = dict[str, float]


class InternalHealth(Struct):
    status: Literal["ok", "degraded", "unavailable", "draining", "starting"]
    gpu_utilization: Ratio
    queue_depth: NonNegative
    requests_per_second: Annotated[float, Meta(ge=0)]
    workers: list[Worker]
    inflight: NonNegative = 0
    batch_ms: Annotated[
        PerModel, Meta(description="learned batch time of a full batch, per model id the batcher serves")
    ] = {}
    answer_ms: Annotated[
        PerModel,
        Meta(
            description="per model id whose /v1/inference the generation engine's stepper answers "
            "(--inference-path stepper): the time an answer takes once it has started, (--max-new-tokens + 2) "
            "decode steps at the learned step time"
        ),
    ] = {}
    inference_path: Annotated[
        dict[str, Literal["batcher", "stepper"]], Meta(description="per model id: what answers its /v1/inference")
    ] = {}
    batch_ms_by_size: Annotated[
        dict[str, PerModel],
        Meta(
            description="per model id: measured batch time by (mean) batch size, one entry per power-of-two size bucket"
        ),
    ] = {}
    slo_ms: Annotated[
        PerModel,
        Meta(
            description="per model id: its own SLO in force, the p95 latency its answers are held to (--slo-ms when "
            "set, else derived from its own warm-up batch time or stepper answer time, else the default)"
        ),
    ] = {}
    timeout_ms: Annotated[
        PerModel,
        Meta(
            description="per model id: the deadline of a request that names none (--timeout-ms when set, else "
            "derived as its SLO is, else the default)"
        ),
    ] = {}
    max_timeout_ms: Annotated[
        PerModel, Meta(description="per model id: the longest timeout_ms a request may ask for (--max-timeout-ms)")
    ] = {}
    gpu_timeout_ms: int | None = None
    arrivals_per_s: Annotated[float, Meta(ge=0, description="arrivals per second, as admission counts them")] = 0.0
    load_ratio: Annotated[
        float,
        Meta(
            ge=0,
            description="arrivals over the healthy workers' full-batch capacity, or (when larger) the generation "
            "engine's sequences over its slots (1 = the ceiling)",
        ),
    ] = 0.0
    predicted_wait_ratio: Annotated[
        float,
        Meta(
            ge=0,
            description="a new request's predicted wait for its batch over slo - batch time, or (when larger) a "
            "new sequence's predicted wait for an engine slot over slo - answer time",
        ),
    ] = 0.0
    pid: Annotated[int, Meta(description="the server process that answered")] = 0
    process: ProcessSlot | None = None


def _get(path: str, op_id: str, summary: str, *answers: DocAnswer, errors: tuple[int, ...] = ()) -> Operation:
    return Operation("GET", path, op_id, summary, answers, NATIVE, errors=errors, public=True)


_READY = DocAnswer(200, "ready", Readiness, headers=())
_NOT_READY = DocAnswer(503, "not ready (status not_ready, with the reason)", Readiness, headers=())

OPERATIONS = (
    _get("/healthz", "healthz", "Liveness: the process answers", DocAnswer(200, "alive", Liveness, headers=())),
    _get(
        "/readyz", "readyz", "Readiness: models warmed, at least one healthy worker, not draining", _READY, _NOT_READY
    ),
    _get(
        "/health",
        "health",
        "Serving: the name vLLM, TGI, TEI and Infinity use (load generators such as guidellm probe it); the same "
        "answer as /readyz",
        _READY,
        _NOT_READY,
    ),
    _get(
        "/internal/health",
        "internalHealth",
        "Workers, queue depth, utilisation and rate (with --metrics-key set, only with that key)",
        DocAnswer(200, "the node's health", InternalHealth, headers=()),
        errors=(401,),
    ),
    _get(
        "/metrics",
        "metrics",
        "Prometheus metrics, batchserve_ prefix (with --metrics-key set, only with that key)",
        DocAnswer(200, "Prometheus text exposition format", str, media="text/plain", headers=()),
        errors=(401,),
    ),
    _get("/openapi.json", "openapi", "This document", DocAnswer(200, "OpenAPI 3.1", dict[str, Any], headers=())),
)
