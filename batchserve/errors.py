"""Every error the API answers, as one exception type with a factory per code (docs/contract.md#errors).

`ApiError` is raised anywhere on the request path and rendered once, in the route's dialect (`http/dialects.py`).
Building errors only through these factories keeps each code's status, wording and retry hint the same everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

RETRY_SOON_MS = 1000  # retry hint where another node (or this one in a moment) can serve


@dataclass
class ApiError(Exception):
    """An answer other than 200."""

    status: int
    code: str
    message: str
    retry_after_ms: int | None = None
    headers: dict[str, str] | None = None
    hung: str = ""  # for the server's own policy, never shown: "once" (its batch hung), "again" (its re-run too)
    costly: bool = False  # for the server's own policy, never shown: a failure found by failing batches (re-runs)
    param: str | None = None  # the request field at fault, where a dialect names it (OpenAI's `param`)
    reason: str | None = None  # a finer code where a dialect names one (OpenAI's `code`: "invalid_value")

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}"


class ClientGone(Exception):
    """The caller disconnected before its answer was ready; nobody reads this answer."""

    code = "CLIENT_DISCONNECTED"  # what the request's record says of it, as an ApiError's code would


# -- 4xx: the caller's request -----------------------------------------------------------------------------
def _worded(status: int, code: str) -> Callable[[str], ApiError]:
    """The factory of a code whose every error its caller words."""
    return lambda message: ApiError(status, code, message)


invalid = _worded(400, "INVALID_REQUEST")
not_found = _worded(404, "NOT_FOUND")
method_not_allowed = _worded(405, "METHOD_NOT_ALLOWED")
request_timeout = _worded(408, "REQUEST_TIMEOUT")
conflict = _worded(409, "CONFLICT")
payload_too_large = _worded(413, "PAYLOAD_TOO_LARGE")
headers_too_large = _worded(431, "HEADERS_TOO_LARGE")


def unauthorized(message: str) -> ApiError:
    return ApiError(401, "UNAUTHORIZED", message, headers={"WWW-Authenticate": "Bearer"})


def model_not_found(requested: str | None) -> ApiError:
    return ApiError(404, "MODEL_NOT_FOUND", f"no model {short(requested)!r} is served here (see /v1/models)")


def request_not_found() -> ApiError:
    return ApiError(404, "REQUEST_NOT_FOUND", "no recent request of yours has this id on this node")


def batch_not_found(job_id: str) -> ApiError:
    return ApiError(404, "BATCH_NOT_FOUND", f"no batch job {short(job_id)!r} belongs to this caller")


def rate_limited(message: str, retry_after_ms: float, headers: dict[str, str]) -> ApiError:
    return ApiError(429, "RATE_LIMITED", message, retry_after_ms=max(1, int(retry_after_ms)), headers=headers)


# -- 5xx: the server's state ------------------------------------------------------------------------------
not_implemented = _worded(501, "NOT_IMPLEMENTED")


def internal_error() -> ApiError:
    """An exception nobody expected: the answer says nothing of it (the log has the traceback)."""
    return ApiError(500, "INTERNAL_ERROR", "the server failed on this request; it is logged")


CLIENT_DETAIL_CHARS = 1000  # most characters of a backend's failure shown to the caller (the log keeps more)


def inference_failed(detail: str) -> ApiError:
    return ApiError(500, "INFERENCE_FAILED", f"the backend failed on this input: {short(detail, CLIENT_DETAIL_CHARS)}")


def overloaded(message: str, retry_after_ms: float) -> ApiError:
    return ApiError(503, "SERVICE_OVERLOADED", message, retry_after_ms=max(1, int(retry_after_ms)))


def draining(message: str = "the server is shutting down; retry on another node") -> ApiError:
    return ApiError(503, "DRAINING", message, retry_after_ms=RETRY_SOON_MS)


def no_healthy_worker(message: str = "no healthy worker can take this request now") -> ApiError:
    return ApiError(503, "NO_HEALTHY_WORKER", message, retry_after_ms=RETRY_SOON_MS)


def warming_up() -> ApiError:
    return no_healthy_worker("the server is warming up")


def jobs_unavailable(message: str, retry_after_ms: int = 5000) -> ApiError:
    return ApiError(503, "JOBS_UNAVAILABLE", message, retry_after_ms=retry_after_ms)


def deadline_exceeded(message: str = "the request's deadline passed before it could be answered") -> ApiError:
    return ApiError(504, "DEADLINE_EXCEEDED", message)


def worker_hung(again: bool) -> ApiError:
    """A 504 because the item's batch hung a worker; `again`: it had been re-run once after a hang already (each
    try of a hanging input costs a worker, so the job scheduler retries only after the first)."""
    return ApiError(
        504, "DEADLINE_EXCEEDED", "the batch holding this request hung its worker", hung="again" if again else "once"
    )


def timeout_too_short(least_ms: float) -> ApiError:
    """The request's timeout is shorter than one batch of its model: no answer could come in time whatever the
    load, so it is the request's fault, a 400 naming the least timeout to ask for (not in the SLO ledger)."""
    least = max(1, math.ceil(round(least_ms, 3)))
    return ApiError(
        400,
        "TIMEOUT_TOO_SHORT",
        f"the timeout is shorter than one batch of this model: it cannot be met; ask for at least {least} ms",
    )


def deadline_unmeetable(batch_ms: float) -> ApiError:
    """No timeout a caller may ask for is as long as one batch of the model: a 504 with no retry hint."""
    return ApiError(
        504,
        "DEADLINE_EXCEEDED",
        f"timeout_ms is shorter than one batch of this model (about {batch_ms:.0f} ms): it cannot be met",
    )


def short(value: object, limit: int = 80) -> str:
    """A caller-supplied value as quoted in a message: never more than `limit` characters of it."""
    text = "" if value is None else str(value)
    return text if len(text) <= limit else text[:limit] + "…"
