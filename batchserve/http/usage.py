"""`GET /v1/usage`: a tenant's own SLO ledger (issue 33 item 5): its requests and inputs by outcome (met, slow,
refused, expired, failed: `core/ledger.py`), the cost units it was served (tokens, or inputs where a model costs 1
an input) and the p50 / p95 latency of its served answers, over the last `window_s` seconds and since start.

The figures are per tenant and so never in /metrics (DESIGN §6): here a caller sees its own tenant's only, found
from its key as every route finds it (`guard.identify`); a key with `admin = true` in the config file sees every
tenant's. Anonymous callers are one tenant, "anonymous", as they are one lane of the fair queue. Reading it takes
no rate-limit token: it is how a caller who is being refused finds out why. Each server process keeps its own
ledger (with `--processes`, ask each process's own port, as for /metrics)."""

from __future__ import annotations

import math

from typing import Any

import orjson
from starlette.datastructures import QueryParams
from starlette.routing import Route

from batchserve import errors
from batchserve.core.ledger import DEFAULT_WINDOW_S, MAX_WINDOW_S, OUTCOMES
from batchserve.http.dialects import NATIVE
from batchserve.http.endpoint import COUNTED, Answer, Call, Endpoint, Served
from batchserve.http.openapi import Contribution, error_responses, json_content, ref


def window_of(given: str | None) -> float:
    """The `window_s` query parameter: seconds, more than 0 and at most MAX_WINDOW_S (400 otherwise)."""
    if given is None:
        return DEFAULT_WINDOW_S
    try:
        window_s = float(given)
    except ValueError:
        window_s = math.nan
    if not 0 < window_s <= MAX_WINDOW_S:  # NaN fails too
        raise errors.invalid(
            f"window_s must be a number of seconds, more than 0 and at most {MAX_WINDOW_S:g} "
            f"(got {errors.short(given)!r})"
        )
    return window_s


def parse(rt: Served, call: Call, body: bytes) -> float:
    return window_of(QueryParams(call.scope["query_string"]).get("window_s"))


async def reports(rt: Served, call: Call, window_s: float) -> list[dict[str, Any]]:
    book, caller = rt.guard.usage, call.who
    return book.reports(window_s) if caller.admin else [book.report(caller.tenant, window_s)]


def render(rt: Served, call: Call, window_s: float, data: list[dict[str, Any]]) -> Answer:
    return Answer(orjson.dumps({"object": "list", "window_s": window_s, "data": data}))


# The caller identified as on every route, but no token taken; counted as an answer, not a model's.
usage: Endpoint[Served, float, list[dict[str, Any]]] = Endpoint(
    NATIVE, parse, reports, render, rate=False, book=COUNTED, body=False
)

ROUTES = [Route("/v1/usage", usage, methods=["GET"])]

_BY_OUTCOME = {
    "type": "object",
    "required": list(OUTCOMES),
    "additionalProperties": False,
    "properties": {o: {"type": "integer", "minimum": 0} for o in OUTCOMES},
}
_COUNTS = {
    "requests": {
        **_BY_OUTCOME,
        "description": "answers by SLO outcome: met (2xx within the SLO), slow (2xx past "
        "it), refused (429/503), expired (504), failed (other 5xx)",
    },
    "inputs": {**_BY_OUTCOME, "description": "the inputs those requests held, by outcome"},
    "cost_served": {
        "type": "number",
        "minimum": 0,
        "description": "cost units served in 2xx answers: tokens where the model costs by tokens "
        "(generation: prompt + completion tokens), else inputs",
    },
}

OPENAPI = Contribution(
    paths={
        "/v1/usage": {
            "get": {
                "summary": "Your tenant's SLO ledger: requests by outcome, cost served, latency",
                "description": "The caller's own tenant (from its API key; all anonymous callers are the tenant "
                "'anonymous'); a key with `admin = true` sees every tenant. Counts are over the last "
                "`window_s` seconds, rounded out to whole 5-second buckets, and since the process "
                "started; latency percentiles are over the served answers of the window (the latest "
                "2,048 at most). Other 4xx answers than 429, and callers who hung up, are not counted.",
                "parameters": [
                    {
                        "name": "window_s",
                        "in": "query",
                        "required": False,
                        "description": f"seconds back from now (default {DEFAULT_WINDOW_S:g}, at most "
                        f"{MAX_WINDOW_S:g})",
                        "schema": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_WINDOW_S},
                    }
                ],
                "responses": {
                    "200": {"description": "the figures", "content": json_content(ref("UsageList"))},
                    **error_responses(400, 401),
                },
            }
        }
    },
    schemas={
        "UsageList": {
            "type": "object",
            "required": ["object", "window_s", "data"],
            "additionalProperties": False,
            "properties": {
                "object": {"const": "list"},
                "window_s": {"type": "number"},
                "data": {"type": "array", "items": ref("TenantUsage")},
            },
        },
        "TenantUsage": {
            "type": "object",
            "additionalProperties": False,
            "required": [
                "tenant",
                "tier",
                "window_s",
                "requests",
                "inputs",
                "cost_served",
                "latency_ms",
                "since_start",
            ],
            "properties": {
                "tenant": {"type": "string"},
                "tier": {"type": ["string", "null"], "description": "the tier of its latest request"},
                "window_s": {"type": "number"},
                **_COUNTS,
                "latency_ms": {
                    "type": "object",
                    "required": ["count", "p50", "p95"],
                    "additionalProperties": False,
                    "description": "arrival to answer of the served (2xx) answers in the window; on the "
                    "generation routes, arrival to the first token",
                    "properties": {
                        "count": {"type": "integer", "minimum": 0},
                        "p50": {"type": ["number", "null"]},
                        "p95": {"type": ["number", "null"]},
                    },
                },
                "since_start": {
                    "type": "object",
                    "required": list(_COUNTS),
                    "additionalProperties": False,
                    "properties": _COUNTS,
                },
            },
        },
    },
)
