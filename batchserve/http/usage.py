"""`GET /v1/usage`: a tenant's own SLO ledger (`core/ledger.py`): requests and inputs by outcome, cost served and
latency percentiles, over the last `window_s` seconds and since start.

Per-tenant figures are never in /metrics (docs/contract.md#observability): a caller sees its own tenant's; a key
with `admin = true` sees every tenant's. Reading it takes no rate-limit token: it is how a caller who is being
refused finds out why. Each server process keeps its own ledger (with `--processes`, ask each process's own port)."""

from __future__ import annotations

import math

from typing import Any

from starlette.routing import Route

from batchserve import errors
from batchserve.core.ledger import DEFAULT_WINDOW_S, MAX_WINDOW_S
from batchserve.http.dialects import NATIVE
from batchserve.http.endpoint import COUNTED, Call, Endpoint, Served, as_json
from batchserve.http.shapes import USAGE


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
    return window_of(call.query().get("window_s"))


async def reports(rt: Served, call: Call, window_s: float) -> dict[str, Any]:
    book, caller = rt.guard.usage, call.who
    data = book.reports(window_s) if caller.admin else [book.report(caller.tenant, window_s)]
    return {"object": "list", "window_s": window_s, "data": data}


# Identified, but no token taken; counted as an answer, not a model's.
usage: Endpoint[Served, float, dict[str, Any]] = Endpoint(
    NATIVE, parse, reports, as_json, rate=False, book=COUNTED, body=False
)

ROUTES = [Route("/v1/usage", usage, methods=["GET"])]

OPERATIONS = USAGE  # declared with its answer shape in `http/shapes.py`
