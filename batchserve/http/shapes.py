"""The shapes the HTTP face itself answers: the error body of each dialect as `dialects.py` renders it,
`/v1/usage`'s answer, and the operations of the routes this package serves (`/v1/usage`, `/docs`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from batchserve.core.ledger import DEFAULT_WINDOW_S, MAX_WINDOW_S
from batchserve.http.openapi import DocAnswer, DocDialect, Operation, Param

NonNegative = Annotated[int, Meta(ge=0)]
Text = Annotated[str, Meta(min_length=1)]  # an empty text has nothing to encode, score or classify: 400
Timeout = Annotated[float, Meta(gt=0, description="extension: the request's deadline, as on /v1/inference")]
# A request's own priority (`priority` on the native and v2 routes, `service_tier` on OpenAI's): core/tiers.ASKABLE.
Priority = Annotated[
    Literal["auto", "default", "priority", "flex", "enterprise", "paid", "free", "batch"],
    Meta(
        description="the tier this request runs at: a tier name, or OpenAI's service_tier (auto and default: the "
        "key's tier; priority: the best the key allows, its `best_tier`; flex: the batch tier). Above what the key "
        "allows it is capped; the answer's `x-service-tier` header names the tier it ran at"
    ),
]


class Error(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The one error body of batchserve's own routes (docs/contract.md#errors)."""

    error: Annotated[str, Meta(pattern="^[A-Z][A-Z0-9_]*$", description="machine-readable code")]
    message: Annotated[str, Meta(description="a human sentence")]
    request_id: str
    retry_after_ms: (
        Annotated[int, Meta(ge=0, description="present where retrying later can help (with a Retry-After header)")]
        | UnsetType
    ) = UNSET


class OpenAIErrorDetail(Struct, forbid_unknown_fields=True):
    message: str
    type: Annotated[str, Meta(description="invalid_request_error, authentication_error, rate_limit_error, ...")]
    param: Annotated[str | None, Meta(description="the request member at fault, when one is")]
    code: str | None


class OpenAIError(Struct, forbid_unknown_fields=True):
    """OpenAI's error shape, on the OpenAI-compatible routes only."""

    error: OpenAIErrorDetail


NATIVE = DocDialect("native", Error, per_status=True)
OPENAI = DocDialect("OpenAI", OpenAIError)


# -- /v1/usage ------------------------------------------------------------------------------------------------
class ByOutcome(Struct, forbid_unknown_fields=True):
    met: NonNegative
    slow: NonNegative
    refused: NonNegative
    expired: NonNegative
    failed: NonNegative


_REQUESTS = (
    "answers by SLO outcome: met (2xx within the SLO), slow (2xx past it), refused (429/503), expired (504), "
    "failed (other 5xx)"
)
_COST = (
    "cost units served in 2xx answers: tokens where the model costs by tokens (generation: prompt + completion "
    "tokens), else inputs"
)


class Counts(Struct, forbid_unknown_fields=True):
    requests: Annotated[ByOutcome, Meta(description=_REQUESTS)]
    inputs: Annotated[ByOutcome, Meta(description="the inputs those requests held, by outcome")]
    cost_served: Annotated[float, Meta(ge=0, description=_COST)]


class ModelLatency(Struct, forbid_unknown_fields=True):
    """One model's served answers in the window (the latest `sample_max` of them at most)."""

    count: NonNegative
    p50: float | None
    p95: float | None


class Latency(ModelLatency, forbid_unknown_fields=True):
    """Arrival to answer of the served (2xx) answers in the window; on the generation routes, arrival to the
    first token. The tenant's figures mix its models; `by_model` has each model's apart."""

    sample_max: Annotated[
        NonNegative,
        Meta(
            description="the latest answers kept, for the tenant and for each model: the percentiles are over "
            "the window's answers among them"
        ),
    ]
    by_model: Annotated[dict[str, ModelLatency], Meta(description="per model id (name@version) served in the window")]


class TenantUsage(Counts, forbid_unknown_fields=True):
    tenant: str
    tier: Annotated[str | None, Meta(description="the tier of its latest request")]
    window_s: float
    latency_ms: Latency
    since_start: Counts


class UsageList(Struct, forbid_unknown_fields=True):
    object: Literal["list"]
    window_s: float
    data: list[TenantUsage]


_USAGE_DESCRIPTION = (
    "The caller's own tenant (from its API key; all anonymous callers are the tenant 'anonymous'); a key with "
    "`admin = true` sees every tenant. Counts are over the last `window_s` seconds, rounded out to whole 5-second "
    "buckets, and since the process started; latency percentiles are over the served answers of the window (the "
    "latest 2,048 at most, `sample_max`), of all the tenant's models and of each (`by_model`). Other 4xx "
    "answers than 429, and callers who hung up, are not counted."
)

USAGE = (
    Operation(
        "GET",
        "/v1/usage",
        "usage",
        "Your tenant's SLO ledger: requests by outcome, cost served, latency",
        (DocAnswer(200, "the figures", UsageList),),
        NATIVE,
        errors=(400, 401),
        description=_USAGE_DESCRIPTION,
        params=(
            Param(
                "window_s",
                "query",
                Annotated[float, Meta(gt=0, le=MAX_WINDOW_S)],
                f"seconds back from now (default {DEFAULT_WINDOW_S:g}, at most {MAX_WINDOW_S:g})",
            ),
        ),
    ),
)


def docs_operations(assets: list[str], media_types: list[str]) -> tuple[Operation, ...]:
    """`/docs`: Swagger UI's page, its initializer and its files (named by `docs_page.ASSETS`)."""

    def get(path: str, op_id: str, summary: str, what: str, media: list[str], **more: Any) -> Operation:
        answer = DocAnswer(200, what, str, media=media[0], also=tuple((m, str) for m in media[1:]), headers=())
        return Operation("GET", path, op_id, summary, (answer,), NATIVE, **more)

    return (
        get("/docs", "docs", "Swagger UI over /openapi.json (assets served locally)", "the page", ["text/html"]),
        get("/docs/init.js", "docsInit", "the page's Swagger UI initializer", "JavaScript", ["text/javascript"]),
        get(
            "/docs/assets/{name}",
            "docsAsset",
            "Swagger UI's files, from the swagger-ui-py package",
            "the file",
            media_types,
            errors=(404,),
            params=(Param("name", "path", Literal[tuple(assets)]),),
        ),
    )
