"""The job store interface: everything the API and the scheduler need from durable storage, and nothing else.

The contract every store keeps:
- `create` commits the job and *all* its items before it returns (the 202 follows it), or nothing at all;
  a repeat of the same `(tenant, idempotency_key)` returns the first job, a different body under that key
  raises `IdempotencyConflict` (across every node sharing the store).
- `claim` hands out pending items under a lease: an item leased to one holder is not handed to another until
  the lease expires or is released, so nodes sharing a store do not run the same item at once, and the items
  of a node that died are claimed again once their lease runs out (execution stays at-least-once).
- `record` writes each item's result at most once: the update is keyed by `(job_id, index)` and only applies
  to an item still `pending`, so running an item twice records it once. Job counters move in the same
  transaction, and a job whose items are all final gets its final status there.
- Reads are scoped by tenant: a job of another tenant is indistinguishable from a missing one.

`SQLiteStore` is the single-node implementation (its leases die with its process); `PostgresStore` is shared by
many nodes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol
from urllib.parse import parse_qsl, urlencode, urlsplit

import orjson

from batchserve.config import is_postgres_url as is_postgres_url
from batchserve.jobs.files import FILE_COLUMNS, FileStore

ACTIVE = ("queued", "running")
OUTPUT, ERRORS = "-output", "-errors"  # an OpenAI job's two files (`openai_batch.py`)
PAGE_BYTES = 1 << 20  # the most of its rows' outputs and inputs one page of results holds (`results`)
# A held output is read this much at a time: each read seeks from the value's start (SQLite walks its overflow
# pages, PostgreSQL decompresses it), so small pieces cost quadratic time (1 MiB pieces: ~10x a whole read).
PIECE_BYTES = 2 << 20
QUOTA_CODE = "STORAGE_QUOTA_EXCEEDED"  # the error of items failed because their outputs would pass a storage quota
CANCELLED = ("cancelled", "CANCELLED", "the job was cancelled before this item ran")  # (status, error, message)


def whole_bytes(max_bytes: int) -> int:
    """The largest output (or input) a page of `max_bytes` carries in its row: a larger one stays in the store and
    is read a piece at a time (`JobStore.output_piece`), so one huge item never makes a huge page."""
    return max_bytes // 4


def row_cost(output_bytes: int, input_bytes: int, message: str | None, max_bytes: int) -> int:
    """What a row of `results` holds: its output and input, each counted at most `whole_bytes`, and its message."""
    whole = whole_bytes(max_bytes)
    return min(output_bytes, whole) + min(input_bytes, whole) + (len(message) if message else 0)


class IdempotencyConflict(Exception):
    """The idempotency key was used before, with a different body."""


class FileGone(Exception):
    """The input file of a batch was deleted (or is another tenant's) before its lines could be copied."""


class StoreUnavailable(Exception):
    """The store could not be reached, or a transaction failed: nothing was written; retrying later may work."""


class StoreDown(StoreUnavailable):
    """Refused without trying: the store failed as unreachable a moment ago (`breaker.CircuitBreaker`)."""


class UnstorableInput(ValueError):
    """An input the store cannot hold (PostgreSQL text cannot hold a NUL character): the job is refused whole."""

    def __init__(self, index: int, why: str) -> None:
        super().__init__(f'"inputs"[{index}] {why}')
        self.index = index


def redact_url(location: str) -> str:
    """The location with any password (in the user part or a `password=` parameter) hidden, for logs."""
    if not is_postgres_url(location):
        return location
    parts = urlsplit(location)
    if parts.password is not None:
        user, host = parts.netloc.rsplit("@", 1)
        parts = parts._replace(netloc=f"{user.split(':', 1)[0]}:***@{host}")
    query = [(k, "***" if k == "password" else v) for k, v in parse_qsl(parts.query, keep_blank_values=True)]
    # Built by hand: urlunsplit drops the `//` of an empty host (postgresql:///db?host=/socket/dir).
    return f"{parts.scheme}://{parts.netloc}{parts.path}" + (f"?{urlencode(query, safe='*/')}" if query else "")


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
    openai: dict[str, Any] | None = None  # an OpenAI Batch API job: endpoint, input_file_id, completion_window
    # An OpenAI batch: its items are this file's non-blank lines (`inputs` is empty), copied in the store's own
    # transaction; `total` and `input_bytes` are what the checking pass counted.
    source_file: str | None = None
    total: int = 0
    input_bytes: int = 0
    expires_at: float | None = None  # a finished job is deleted with its items after this (None: never)

    def count(self) -> int:
        return self.total if self.source_file is not None else len(self.inputs)

    def stored_bytes(self) -> int:
        """Bytes of input the job keeps: what it adds to its tenant's storage at creation."""
        if self.source_file is not None:
            return self.input_bytes
        return sum(len(text) if text.isascii() else len(text.encode()) for text in self.inputs)

    def row(self, stored_bytes: int) -> tuple[object, ...]:
        """The new row's values in `Sql.new_job`'s order, JSON as text."""
        meta = orjson.dumps(self.metadata).decode() if self.metadata is not None else None
        openai = orjson.dumps(self.openai).decode() if self.openai is not None else None
        return (
            self.id, self.tenant, self.model, self.count(), meta, self.idempotency_key, self.request_hash,
            self.created_at, openai, stored_bytes, self.expires_at,
        )  # fmt: skip

    def repeat(self, row: Sequence[Any]) -> tuple[Job, bool]:
        """The job its idempotency key made before (`row`: `JOB_COLUMNS`, then request_hash), or a conflict."""
        if row[18] != self.request_hash:
            raise IdempotencyConflict(self.idempotency_key)
        return Job.of_row(row), False

    def queued(self, stored_bytes: int) -> Job:
        """The job as a store answers its creation: queued, nothing run yet, `stored_bytes` charged."""
        return Job(
            self.id, self.tenant, self.model, "queued", self.count(), 0, 0, 0, self.created_at, None, None,
            self.metadata, self.openai, stored_bytes, 0, 0, self.expires_at,
        )  # fmt: skip


# The jobs table's columns both stores declare alike (after its `seq`; the times, typed per database, follow).
JOB_TABLE_COLUMNS = """
    id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    model TEXT NOT NULL,
    status TEXT NOT NULL,
    total INTEGER NOT NULL,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    cancelled INTEGER NOT NULL DEFAULT 0,
    metadata TEXT,
    idempotency_key TEXT,
    request_hash TEXT NOT NULL,"""

# The columns a job row is read back from, in `Job`'s order, in both stores' tables.
JOB_COLUMNS = (
    "id, tenant, model, status, total, completed, failed, cancelled, created_at, started_at, "
    "finished_at, metadata, openai, bytes, output_bytes, error_bytes, expires_at, reason"
)


def pg(sql: str) -> str:
    """A statement from SQLite's words to PostgreSQL's: its tables prefixed `batchserve_`, `%s` for `?`."""
    return re.sub(r"\b(jobs|items|files|file_chunks)\b", r"batchserve_\1", sql).replace("?", "%s")


def _kept(where: str = "") -> str:
    return f"(SELECT COALESCE(SUM(bytes), 0) FROM files{where}) + (SELECT COALESCE(SUM(bytes), 0) FROM jobs{where})"


class Sql(NamedTuple):
    """The statements both stores run alike, in SQLite's words (`SQLITE`) and PostgreSQL's (`POSTGRES`)."""

    # (bytes the tenant keeps, 0 or bytes the store keeps in all), given the tenant twice
    usage: str = f"SELECT {_kept(' WHERE tenant = ?')}, 0"
    usage_total: str = f"SELECT {_kept(' WHERE tenant = ?')}, {_kept()}"
    new_file: str = (
        "INSERT INTO files (id, tenant, filename, purpose, bytes, created_at, status, expires_at) "
        "VALUES (?, ?, ?, ?, 0, ?, 'uploading', ?)"
    )
    finish_file: str = (
        "UPDATE files SET status = 'processed', filename = ?, purpose = ?, bytes = ?, expires_at = ? WHERE id = ?"
    )
    get_file: str = f"SELECT {FILE_COLUMNS} FROM files WHERE id = ? AND tenant = ? AND status = 'processed'"
    next_chunk: str = "SELECT seq, data FROM file_chunks WHERE file_id = ? AND seq > ? ORDER BY seq LIMIT 1"
    file_owner: str = "SELECT tenant FROM files WHERE id = ? AND status = 'processed'"
    new_job: str = (  # `NewJob.row`'s values, its status 'queued'
        "INSERT INTO jobs (id, tenant, model, status, total, metadata, idempotency_key, request_hash, created_at, "
        "openai, bytes, expires_at) VALUES (?, ?, ?, 'queued', ?, ?, ?, ?, ?, ?, ?, ?)"
    )
    get_job: str = f"SELECT {JOB_COLUMNS} FROM jobs WHERE id = ? AND tenant = ?"
    keyed_job: str = f"SELECT {JOB_COLUMNS}, request_hash FROM jobs WHERE tenant = ? AND idempotency_key = ?"
    job_state: str = "SELECT status, openai FROM jobs WHERE id = ? AND tenant = ?"
    cancel_job: str = (  # how many items it ended, the time, the bytes they add (kept, and to its error file)
        "UPDATE jobs SET status = 'cancelled', cancelled = cancelled + ?, finished_at = ?, bytes = bytes + ?, "
        "error_bytes = error_bytes + ? WHERE id = ? AND status IN ('queued', 'running')"
    )
    job_running: str = (
        "UPDATE jobs SET status = 'running', started_at = COALESCE(started_at, ?) WHERE id = ? AND status = 'queued'"
    )
    book_job: str = (  # `Sizes.grows()`, the reason a job failed for its quota (or None), its id
        "UPDATE jobs SET completed = completed + ?, failed = failed + ?, bytes = bytes + ?, "
        "output_bytes = output_bytes + ?, error_bytes = error_bytes + ?, reason = COALESCE(reason, ?) WHERE id = ?"
    )
    finish_job: str = (  # the time, its id: the job's status once every item is final; the job as it is then
        "UPDATE jobs SET status = CASE WHEN status NOT IN ('queued', 'running') THEN status "
        "WHEN completed + failed + cancelled < total THEN status WHEN reason IS NOT NULL THEN 'failed' "
        "WHEN completed > 0 THEN 'completed' ELSE 'failed' END, finished_at = CASE WHEN status IN "
        "('queued', 'running') AND completed + failed + cancelled >= total THEN ? ELSE finished_at END "
        f"WHERE id = ? RETURNING {JOB_COLUMNS}"
    )


SQLITE = Sql()
POSTGRES = Sql(*map(pg, SQLITE))


# A native job's members after its id and object, in their order on the wire (`shapes.BatchJob`).
PUBLIC_JOB = (
    "status model total completed failed cancelled pending created_at started_at finished_at metadata bytes expires_at"
).split()


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
    openai: dict[str, Any] | None = None  # set for a job made by OpenAI's Batch API (`openai_batch.py`)
    bytes: int = 0  # what it keeps: inputs, outputs, error messages (its tenant's storage)
    output_bytes: int = 0  # sizes of an OpenAI job's output and error files, kept as its lines are written
    error_bytes: int = 0
    expires_at: float | None = None
    reason: str | None = None  # why the job failed as a whole (its outputs passed a storage quota)

    @property
    def pending(self) -> int:
        return self.total - self.completed - self.failed - self.cancelled

    def public(self) -> dict[str, Any]:
        out = {"id": self.id, "object": "batch"} | {name: getattr(self, name) for name in PUBLIC_JOB}
        if self.reason is not None:
            out["reason"] = self.reason
        return out

    @classmethod
    def of_row(cls, row: Sequence[Any]) -> Job:
        """A job from a store's row whose first columns are `JOB_COLUMNS` (metadata and openai hold JSON text)."""
        values = list(row[:18])
        for i in (11, 12):  # metadata, openai
            values[i] = orjson.loads(values[i]) if values[i] is not None else None
        return cls(*values)


@dataclass(slots=True)
class ItemRow:
    index: int
    status: str
    output: str | None  # the output as JSON text (any JSON value), embedded in the answer as it is
    error: str | None  # error code
    message: str | None
    input: str | None = None  # only when asked for (`results(..., with_input=True)`), and not over whole_bytes
    output_bytes: int = 0  # the stored output's size in bytes (set by `results`)
    custom_id: str | None = None  # an OpenAI line's custom_id, read by the store where the input was too large

    @property
    def held(self) -> bool:
        """Its output was left in the store (over `whole_bytes`): read it with `JobStore.output_piece`."""
        return self.output is None and self.output_bytes > 0

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

    def stored_bytes(self) -> int:
        """Bytes of output the store keeps for this result (its tenant's storage; an error's code and short
        message are not counted, so a job failed for its quota adds nothing past it)."""
        out = self.output
        return 0 if out is None else len(out) if out.isascii() else len(out.encode())

    def over_quota(self, reason: str) -> Outcome:
        """This outcome failed for its job's storage quota: nothing of it is kept."""
        return Outcome(self.job_id, self.index, "failed", None, QUOTA_CODE, reason)


@dataclass(slots=True)
class Progress:
    """A job's counters after a `record`, for metrics and for the scheduler to forget finished jobs."""

    id: str
    model: str
    status: str
    counts: dict[str, int] = field(default_factory=dict)  # completed, failed, cancelled, pending

    @classmethod
    def of(cls, job: Job) -> Progress:
        counts = {"completed": job.completed, "failed": job.failed, "cancelled": job.cancelled, "pending": job.pending}
        return cls(job.id, job.model, job.status, counts)


class JobStore(FileStore, Protocol):
    async def create(self, job: NewJob) -> tuple[Job, bool]:
        """Commit the job and all its items; (job, True), or (the earlier job, False) on a repeat."""

    async def get(self, tenant: str, job_id: str) -> Job | None: ...

    async def list_jobs(self, tenant: str, limit: int, after: str | None) -> list[Job]:
        """The tenant's jobs, newest first, starting after the job `after` (a cursor)."""

    async def results(
        self, job_id: str, after_index: int, limit: int, with_input: bool = False, max_bytes: int = PAGE_BYTES
    ) -> list[ItemRow]:
        """Items in input order from `after_index + 1` (the caller has checked the tenant), with their inputs when
        `with_input`: at most `limit` rows and `max_bytes` of outputs, inputs and messages (one row at least). An
        output or input over `whole_bytes(max_bytes)` is left out: `output_bytes` then says the output's size
        (`ItemRow.held`), and `custom_id` stands in for the input."""

    async def output_piece(self, job_id: str, index: int, start: int, size: int) -> bytes | None:
        """Up to `size` bytes of the item's stored output (UTF-8) from byte `start`: empty past its end, None
        when the item is gone (its job was deleted)."""

    async def cancel(self, tenant: str, job_id: str, now: float) -> Job | None:
        """Mark pending items cancelled and the job cancelled (a finished job is left as it is)."""

    async def active(self, models: list[str]) -> list[Job]:
        """Unfinished jobs on these models, oldest first (resumed at start-up, polled for other nodes' jobs)."""

    async def claim(self, job_id: str, limit: int, lease_s: float, now: float) -> list[tuple[int, str]]:
        """Up to `limit` pending (index, input) that no one holds a live lease on, lowest index first, leased
        to this store for `lease_s` seconds; marks the job running (`now` is its start time)."""

    async def renew(self, job_id: str, indexes: list[int], lease_s: float) -> int:
        """Extend this store's leases on these items (still pending) by `lease_s` from now; how many it still
        held (fewer: a lease ran out and another holder took the item, which is then run twice, recorded once)."""

    async def release(self, job_id: str, indexes: list[int]) -> None:
        """Give back leases on items this holder will not run (stopping), so another can claim them at once."""

    async def record(self, outcomes: list[Outcome], now: float) -> list[Progress]:
        """Write these results (each at most once, in one transaction); the touched jobs' progress."""

    async def delete_job(self, tenant: str, job_id: str) -> Job | None:
        """Delete a finished job with its items (frees its bytes); the job as it was, None when the tenant has
        no such job. An unfinished job is returned unchanged and kept (cancel it first)."""

    async def sweep(self, now: float) -> tuple[int, int]:
        """Delete expired files, expired finished jobs and abandoned uploads; (files, jobs) deleted."""

    async def close(self) -> None: ...
