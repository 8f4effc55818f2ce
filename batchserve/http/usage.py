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

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from batchserve import errors
from batchserve.core.ledger import DEFAULT_WINDOW_S, MAX_WINDOW_S
from batchserve.http.plumbing import error_response, json_response, request_id_of
from batchserve.http.guards import guard_of
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


async def usage(request: Request) -> Response:
    guard = guard_of(request)
    guard.counted()
    try:
        caller = guard.identify(request.headers.get("authorization"), request.scope)
        window_s = window_of(request.query_params.get("window_s"))
    except errors.ApiError as err:
        return error_response(err, request_id_of(request))
    book = guard.usage
    data = book.reports(window_s) if caller.admin else [book.report(caller.tenant, window_s)]
    return json_response({"object": "list", "window_s": window_s, "data": data})


ROUTES = [Route("/v1/usage", usage, methods=["GET"])]

OPERATIONS = USAGE  # declared with its answer shape in `http/shapes.py`
