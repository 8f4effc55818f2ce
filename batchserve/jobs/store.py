"""The job store interface: everything the API and the scheduler need from durable storage, and nothing else.

The contract every store keeps:
- `create` commits the job and *all* its items before it returns (the 202 follows it), or nothing at all;
  a repeat of the same `(tenant, idempotency_key)` returns the first job, a different body under that key
  raises `IdempotencyConflict`.
- `record` writes each item's result at most once: the update is keyed by `(job_id, index)` and only applies
  to an item still `pending`, so running an item twice (execution is at-least-once) records it once. Job
  counters move in the same transaction, and a job whose items are all final gets its final status there.
- Reads are scoped by tenant: a job of another tenant is indistinguishable from a missing one.

`SQLiteStore` is the single-node implementation. A shared PostgreSQL store for many nodes fits the same
methods: `create` in one transaction with `ON CONFLICT (tenant, idempotency_key)`, `claim` as
`UPDATE ... SET lease_until = now() + lease WHERE ... FOR UPDATE SKIP LOCKED RETURNING`, so two nodes never
run an item at the same time and an item whose node died is leased again after its lease expires (still
at-least-once), and `record` exactly as here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

JOB_STATUSES = ("queued", "running", "completed", "failed", "cancelled")
ACTIVE = ("queued", "running")
ITEM_STATUSES = ("pending", "completed", "failed", "cancelled")


class IdempotencyConflict(Exception):
    """The idempotency key was used before, with a different body."""


@dataclass(slots=True)
class NewJob:
    id: str
    tenant: str
    model: str  # the resolved name@version: a job runs on one version from start to end
    inputs: list[str]
    metadata: dict[str, Any] | None
    idempotency_key: str | None
    request_hash: str  # of the canonical body, to tell a repeat from a conflicting reuse of the key
    created_at: float  # seconds since the epoch


@dataclass(slots=True)
class Job:
    id: str
    tenant: str
    model: str
    status: str
    total: int
    completed: int
    failed: int
    cancelled: int
    created_at: float
    started_at: float | None
    finished_at: float | None
    metadata: dict[str, Any] | None = None

    @property
    def pending(self) -> int:
        return self.total - self.completed - self.failed - self.cancelled

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "object": "batch", "status": self.status, "model": self.model,
                "total": self.total, "completed": self.completed, "failed": self.failed,
                "cancelled": self.cancelled, "pending": self.pending, "created_at": self.created_at,
                "started_at": self.started_at, "finished_at": self.finished_at, "metadata": self.metadata}


@dataclass(slots=True)
class ItemRow:
    index: int
    status: str
    output: str | None  # the output as JSON text (any JSON value), embedded in the answer as it is
    error: str | None  # error code
    message: str | None

    def public(self) -> dict[str, Any]:
        line: dict[str, Any] = {"index": self.index, "status": self.status}
        if self.status == "completed" and self.output is not None:
            line["output"] = orjson.Fragment(self.output)
        elif self.status in ("failed", "cancelled"):
            line["error"] = {"error": self.error, "message": self.message}
        return line


@dataclass(slots=True)
class Outcome:
    """A final result for one item, waiting to be recorded."""

    job_id: str
    index: int
    status: str  # completed | failed
    output: str | None = None  # JSON text: the backend's output, JSON-encoded
    error: str | None = None
    message: str | None = None


@dataclass(slots=True)
class Progress:
    """A job's counters after a `record`, for metrics and for the scheduler to forget finished jobs."""

    id: str
    model: str
    status: str
    counts: dict[str, int] = field(default_factory=dict)  # completed, failed, cancelled, pending


class JobStore(Protocol):
    async def create(self, job: NewJob) -> tuple[Job, bool]:
        """Commit the job and all its items; (job, True), or (the earlier job, False) on a repeat."""
        ...

    async def get(self, tenant: str, job_id: str) -> Job | None: ...

    async def list_jobs(self, tenant: str, limit: int, after: str | None) -> list[Job]:
        """The tenant's jobs, newest first, starting after the job `after` (a cursor)."""
        ...

    async def results(self, job_id: str, after_index: int, limit: int) -> list[ItemRow]:
        """Items in input order, from `after_index + 1` (the caller has checked the tenant)."""
        ...

    async def cancel(self, tenant: str, job_id: str, now: float) -> Job | None:
        """Mark pending items cancelled and the job cancelled (a finished job is left as it is)."""
        ...

    async def active(self, models: list[str]) -> list[Job]:
        """Unfinished jobs on these models, oldest first (what a node resumes on start-up)."""
        ...

    async def claim(self, job_id: str, after_index: int, limit: int, now: float) -> list[tuple[int, str]]:
        """Up to `limit` pending (index, input) after `after_index`, in order; marks the job running."""
        ...

    async def record(self, outcomes: list[Outcome], now: float) -> list[Progress]:
        """Write these results (each at most once, in one transaction); the touched jobs' progress."""
        ...

    async def close(self) -> None: ...
