"""The declared shapes of `POST /v1/inference` (the request `parse.py` decodes, the answer `routes.py` writes),
`GET /v1/requests/{id}` and `GET /v1/models`, and their operations in /openapi.json."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from batchserve.http.openapi import REQUEST_ID, DocAnswer, Header, Operation, model_post, Param
from batchserve.http.shapes import NATIVE, NonNegative, Priority


class InferenceRequest(Struct):
    """What `POST /v1/inference` takes; members it does not know are ignored."""

    input: Annotated[
        str, Meta(min_length=1, description="the input text; longer than --max-input-chars (default 16384) gets 413")
    ]
    model: (
        Annotated[
            str,
            Meta(
                min_length=1, description="`name` (versions split by weight) or `name@version`; default model if absent"
            ),
        ]
        | None
    ) = None
    timeout_ms: (
        Annotated[
            float,
            Meta(
                gt=0,
                description="the request's deadline in ms, at most the model's max_timeout_ms (GET /v1/models; "
                "--max-timeout-ms, default 60000); default the model's own timeout_ms (GET /v1/models: --timeout-ms "
                "when set, else derived from its warm-up, else 2000)",
            ),
        ]
        | UnsetType
    ) = UNSET
    priority: Priority | None = None


class InferenceResponse(Struct):
    request_id: str
    output: Annotated[
        Any,
        Meta(
            description="the backend's output for this input, any JSON value: a string for text models (sim, "
            "smollm2), 384 numbers for minilm, what a plugin returns"
        ),
    ]
    model: Annotated[str, Meta(description="name@version that served it")]
    latency_ms: NonNegative
    queue_ms: NonNegative
    compute_ms: NonNegative
    batch_size: Annotated[int, Meta(ge=1)]


class RequestStatus(Struct):
    request_id: str
    model: str
    status: Literal["queued", "processing", "completed", "failed"]
    created_at: Annotated[float, Meta(description="seconds since the epoch")]
    latency_ms: float | None = None
    queue_ms: float | None = None
    compute_ms: float | None = None
    batch_size: int | None = None
    error: Annotated[str | None, Meta(description="the error code when failed")] = None


class Model(Struct):
    id: Annotated[str, Meta(description="name@version")]
    object: Literal["model"]
    owned_by: str | UnsetType = UNSET
    name: str | UnsetType = UNSET
    version: str | UnsetType = UNSET
    backend: str | UnsetType = UNSET
    weight: float | UnsetType = UNSET
    created: Annotated[int, Meta(description="the generation model's entry")] | UnsetType = UNSET
    max_tokens: Annotated[int, Meta(description="the generation model's cap on new tokens")] | UnsetType = UNSET
    output_kind: Annotated[
        Literal["text", "json", "embedding", None],
        Meta(
            description="what the backend's outputs are; embedding models also serve POST /v1/embeddings "
            "(null while the backends load)"
        ),
    ] = None
    slo_ms: (
        Annotated[
            float,
            Meta(
                gt=0,
                description="this model's own SLO: the p95 latency its answers are held to (--slo-ms when set, else "
                "derived from its own warm-up batch time, or answer time on the generation engine's stepper, else "
                "the default)",
            ),
        ]
        | UnsetType
    ) = UNSET
    timeout_ms: (
        Annotated[
            float,
            Meta(gt=0, description="the deadline of a request to this model that names no timeout_ms (as slo_ms)"),
        ]
        | UnsetType
    ) = UNSET
    max_timeout_ms: (
        Annotated[float, Meta(gt=0, description="the longest timeout_ms a request to this model may ask for")]
        | UnsetType
    ) = UNSET


class ModelList(Struct):
    object: Literal["list"]
    data: list[Model]


_REQUEST_ID_PARAM = Param("X-Request-ID", "header", str, "echoed back when it matches ^[A-Za-z0-9._:-]{1,128}$")
_SERVER_TIMING = Header("Server-Timing", "queue;dur=<ms>, compute;dur=<ms>")


def _inference(path: str, operation_id: str, summary: str) -> Operation:
    return model_post(
        path,
        operation_id,
        summary,
        DocAnswer(200, "the input's output", InferenceResponse, headers=(REQUEST_ID, _SERVER_TIMING)),
        NATIVE,
        Annotated[InferenceRequest, Meta(examples=[{"input": "hello", "model": "sim"}])],
        params=(_REQUEST_ID_PARAM,),
    )


OPERATIONS = (
    _inference("/v1/inference", "inference", "One input, one synchronous answer"),
    _inference("/api/inference", "inferenceAlias", "Same as POST /v1/inference"),
    Operation(
        "GET",
        "/v1/requests/{request_id}",
        "requestStatus",
        "Status of a recent request on this node, with timings",
        (DocAnswer(200, "the request's status", RequestStatus),),
        NATIVE,
        errors=(401, 404, 429),
        params=(Param("request_id", "path"),),
    ),
    Operation(
        "GET",
        "/v1/models",
        "listModels",
        "The models and versions served here (OpenAI list shape)",
        (DocAnswer(200, "the served models", ModelList),),
        NATIVE,
        errors=(401, 429),
    ),
)
