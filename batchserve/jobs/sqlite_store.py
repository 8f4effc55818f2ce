"""`JobStore` on one SQLite file in WAL mode: the default, for a single node.

Every call runs on one dedicated thread that owns the connection, never on the event loop: SQLite calls
block, and one thread means one writer, so transactions never wait on each other inside the process. The file
is also `flock`ed, so a second server process pointed at the same file refuses it instead of running the
same items twice. `synchronous=FULL`: a committed job survives a power cut, not only a killed process.

A trigger refuses any second write of an item's result (an item leaves `pending` once), and `writes` counts
the result writes per item, so tests can prove "recorded exactly once" from the file itself.

Leases are kept in memory, not in the file: the `flock` already makes this process the only one running the
file's items, and a process that dies takes its leases with it, so a restart resumes every pending item at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import sqlite3
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, TypeVar

import orjson

from batchserve.jobs.files import FileLimitReached, StoredFile
from batchserve.jobs.store import ACTIVE, IdempotencyConflict, ItemRow, Job, NewJob, Outcome, Progress

T = TypeVar("T")

SCHEMA_VERSION = 1  # PRAGMA user_version; see SQLiteStore._migrate
SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
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
    request_hash TEXT NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    UNIQUE (tenant, idempotency_key)
);
CREATE INDEX IF NOT EXISTS jobs_by_tenant ON jobs (tenant, seq);
CREATE INDEX IF NOT EXISTS jobs_active ON jobs (status) WHERE status IN ('queued', 'running');
CREATE TABLE IF NOT EXISTS items (
    job_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    input TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'pending',
    output TEXT,  -- JSON text (since schema version 1)
    error TEXT,
    message TEXT,
    writes INTEGER NOT NULL DEFAULT 0,
    finished_at REAL,
    PRIMARY KEY (job_id, idx)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS items_pending ON items (job_id, idx) WHERE status = 'pending';
CREATE TRIGGER IF NOT EXISTS items_final_once BEFORE UPDATE OF status ON items
WHEN OLD.status != 'pending'
BEGIN
    SELECT RAISE(ABORT, 'a job item left pending twice');
END;
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at REAL NOT NULL,
    content BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS files_by_tenant ON files (tenant, seq);
"""

JOB_COLUMNS = ("id, tenant, model, status, total, completed, failed, cancelled, created_at, started_at, "
               "finished_at, metadata, openai")
FILE_COLUMNS = "id, tenant, filename, purpose, bytes, created_at"


class StoreBusy(Exception):
    """Another process holds the jobs file."""


def _job(row: sqlite3.Row) -> Job:
    meta = row["metadata"]
    return Job(row["id"], row["tenant"], row["model"], row["status"], row["total"], row["completed"],
               row["failed"], row["cancelled"], row["created_at"], row["started_at"], row["finished_at"],
               orjson.loads(meta) if meta is not None else None,
               orjson.loads(row["openai"]) if row["openai"] is not None else None)


def _file(row: sqlite3.Row) -> StoredFile:
    return StoredFile(row["id"], row["tenant"], row["filename"], row["purpose"], row["bytes"], row["created_at"])


class SQLiteStore:
    """See the module docstring; build it with `await SQLiteStore.open(path)`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._exec = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jobs-db")
        self._conn: sqlite3.Connection | None = None
        self._lock_fd: int | None = None
        self._leases: dict[str, dict[int, float]] = {}  # job id -> index -> lease end (monotonic clock)

    @classmethod
    async def open(cls, path: str) -> "SQLiteStore":
        store = cls(path)
        try:
            await store._run(store._open)
        except BaseException:
            store._exec.shutdown(wait=False)
            raise
        return store

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._exec, fn, *args)

    # -- on the store thread ---------------------------------------------------------------------------------
    def _open(self) -> None:
        """Lock and open the file; on any failure (a corrupt file, a refused WAL) release both the lock and the
        connection, so the next try (after a repair) starts clean instead of finding its own lock."""
        try:
            self._open_locked()
        except BaseException:
            self._close()
            raise

    def _open_locked(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreBusy(f"{self.path} is in use by another batchserve process") from None
        # The fd stays open while the connection lives: closing any fd of the file drops SQLite's POSIX locks.
        self._lock_fd = fd
        conn = self._conn = sqlite3.connect(self.path, isolation_level=None)
        conn.row_factory = sqlite3.Row
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise RuntimeError(f"{self.path}: SQLite refused WAL mode (journal_mode={mode})")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA busy_timeout=5000")
        conn.executescript(SCHEMA)
        self._migrate()
        if "openai" not in {r["name"] for r in conn.execute("PRAGMA table_info(jobs)")}:
            conn.execute("ALTER TABLE jobs ADD COLUMN openai TEXT")  # OpenAI Batch API jobs (a file from before)

    def _migrate(self) -> None:
        """Version 1: outputs are stored as JSON text (any JSON value). A file from before held the string
        output itself; quoting it as a JSON string keeps what the API answers for those items the same."""
        assert self._conn is not None
        if self._conn.execute("PRAGMA user_version").fetchone()[0] >= SCHEMA_VERSION:
            return
        with self._tx() as c:
            c.execute("UPDATE items SET output = json_quote(output) WHERE output IS NOT NULL")
            c.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        conn = self._conn
        assert conn is not None, "the store is closed"
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def _create(self, job: NewJob) -> tuple[Job, bool]:
        with self._tx() as c:
            if job.idempotency_key is not None:
                row = c.execute(f"SELECT {JOB_COLUMNS}, request_hash FROM jobs WHERE tenant = ? "
                                f"AND idempotency_key = ?", (job.tenant, job.idempotency_key)).fetchone()
                if row is not None:
                    if row["request_hash"] != job.request_hash:
                        raise IdempotencyConflict(job.idempotency_key)
                    return _job(row), False
            meta = orjson.dumps(job.metadata).decode() if job.metadata is not None else None
            openai = orjson.dumps(job.openai).decode() if job.openai is not None else None
            c.execute("INSERT INTO jobs (id, tenant, model, status, total, metadata, idempotency_key, "
                      "request_hash, created_at, openai) VALUES (?, ?, ?, 'queued', ?, ?, ?, ?, ?, ?)",
                      (job.id, job.tenant, job.model, len(job.inputs), meta, job.idempotency_key,
                       job.request_hash, job.created_at, openai))
            c.executemany("INSERT INTO items (job_id, idx, input) VALUES (?, ?, ?)",
                          ((job.id, i, text) for i, text in enumerate(job.inputs)))
        return Job(job.id, job.tenant, job.model, "queued", len(job.inputs), 0, 0, 0, job.created_at, None,
                   None, job.metadata, job.openai), True

    def _get(self, tenant: str, job_id: str) -> Job | None:
        assert self._conn is not None
        row = self._conn.execute(f"SELECT {JOB_COLUMNS} FROM jobs WHERE id = ? AND tenant = ?",
                                 (job_id, tenant)).fetchone()
        return _job(row) if row is not None else None

    def _list(self, tenant: str, limit: int, after: str | None) -> list[Job]:
        assert self._conn is not None
        if after is None:
            rows = self._conn.execute(f"SELECT {JOB_COLUMNS} FROM jobs WHERE tenant = ? ORDER BY seq DESC LIMIT ?",
                                      (tenant, limit))
        else:
            rows = self._conn.execute(
                f"SELECT {JOB_COLUMNS} FROM jobs WHERE tenant = ? AND seq < "
                f"(SELECT seq FROM jobs WHERE id = ? AND tenant = ?) ORDER BY seq DESC LIMIT ?",
                (tenant, after, tenant, limit))
        return [_job(r) for r in rows]

    def _results(self, job_id: str, after_index: int, limit: int, with_input: bool) -> list[ItemRow]:
        assert self._conn is not None
        extra = ", input" if with_input else ""
        rows = self._conn.execute(f"SELECT idx, status, output, error, message{extra} FROM items WHERE job_id = ? "
                                  "AND idx > ? ORDER BY idx LIMIT ?", (job_id, after_index, limit))
        return [ItemRow(*r) for r in rows]

    def _put_file(self, meta: StoredFile, content: bytes, max_count: int) -> None:
        with self._tx() as c:
            held = c.execute("SELECT count(*) FROM files WHERE tenant = ?", (meta.tenant,)).fetchone()[0]
            if held >= max_count:
                raise FileLimitReached(meta.tenant)
            c.execute("INSERT INTO files (id, tenant, filename, purpose, bytes, created_at, content) "
                      "VALUES (?, ?, ?, ?, ?, ?, ?)", (meta.id, meta.tenant, meta.filename, meta.purpose,
                                                       meta.bytes, meta.created_at, content))

    def _get_file(self, tenant: str, file_id: str) -> StoredFile | None:
        assert self._conn is not None
        row = self._conn.execute(f"SELECT {FILE_COLUMNS} FROM files WHERE id = ? AND tenant = ?",
                                 (file_id, tenant)).fetchone()
        return _file(row) if row is not None else None

    def _file_content(self, tenant: str, file_id: str) -> bytes | None:
        assert self._conn is not None
        row = self._conn.execute("SELECT content FROM files WHERE id = ? AND tenant = ?", (file_id, tenant)).fetchone()
        return bytes(row[0]) if row is not None else None

    def _list_files(self, tenant: str, limit: int, after: str | None, purpose: str | None) -> list[StoredFile]:
        assert self._conn is not None
        where, args = "tenant = ?", [tenant]
        if purpose is not None:
            where, args = where + " AND purpose = ?", args + [purpose]
        if after is not None:
            where += " AND seq < (SELECT seq FROM files WHERE id = ? AND tenant = ?)"
            args += [after, tenant]
        rows = self._conn.execute(f"SELECT {FILE_COLUMNS} FROM files WHERE {where} ORDER BY seq DESC LIMIT ?",
                                  (*args, limit))
        return [_file(r) for r in rows]

    def _delete_file(self, tenant: str, file_id: str) -> bool:
        with self._tx() as c:
            return c.execute("DELETE FROM files WHERE id = ? AND tenant = ?", (file_id, tenant)).rowcount > 0

    def _cancel(self, tenant: str, job_id: str, now: float) -> Job | None:
        with self._tx() as c:
            row = c.execute("SELECT status FROM jobs WHERE id = ? AND tenant = ?", (job_id, tenant)).fetchone()
            if row is None:
                return None
            if row["status"] in ACTIVE:
                n = c.execute("UPDATE items SET status = 'cancelled', error = 'CANCELLED', "
                              "message = 'the job was cancelled before this item ran', finished_at = ? "
                              "WHERE job_id = ? AND status = 'pending'", (now, job_id)).rowcount
                c.execute("UPDATE jobs SET status = 'cancelled', cancelled = cancelled + ?, finished_at = ? "
                          "WHERE id = ?", (n, now, job_id))
                self._leases.pop(job_id, None)
        return self._get(tenant, job_id)

    def _active(self, models: list[str]) -> list[Job]:
        assert self._conn is not None
        marks = ", ".join("?" * len(models))
        rows = self._conn.execute(f"SELECT {JOB_COLUMNS} FROM jobs WHERE status IN ('queued', 'running') "
                                  f"AND model IN ({marks}) ORDER BY seq", models)
        return [_job(r) for r in rows]

    def _claim(self, job_id: str, limit: int, lease_s: float, now: float) -> list[tuple[int, str]]:
        assert self._conn is not None
        clock = time.monotonic()
        leases = self._leases.setdefault(job_id, {})
        for index in [i for i, until in leases.items() if until <= clock]:
            del leases[index]  # expired: claimable again
        rows = self._conn.execute("SELECT idx, input FROM items WHERE job_id = ? AND status = 'pending' "
                                  "ORDER BY idx LIMIT ?", (job_id, limit + len(leases)))
        claimed = [(r[0], r[1]) for r in rows if r[0] not in leases][:limit]
        for index, _ in claimed:
            leases[index] = clock + lease_s
        if claimed:
            self._conn.execute("UPDATE jobs SET status = 'running', started_at = COALESCE(started_at, ?) "
                               "WHERE id = ? AND status = 'queued'", (now, job_id))
        return claimed

    def _renew(self, job_id: str, indexes: list[int], lease_s: float) -> int:
        leases = self._leases.get(job_id, {})
        until = time.monotonic() + lease_s
        held = [i for i in indexes if i in leases]
        for index in held:
            leases[index] = until
        return len(held)

    def _release(self, job_id: str, indexes: list[int]) -> None:
        leases = self._leases.get(job_id, {})
        for index in indexes:
            leases.pop(index, None)

    def _record(self, outcomes: list[Outcome], now: float) -> list[Progress]:
        written: dict[str, Counter[str]] = {}
        with self._tx() as c:
            for o in outcomes:
                changed = c.execute(
                    "UPDATE items SET status = ?, output = ?, error = ?, message = ?, writes = writes + 1, "
                    "finished_at = ? WHERE job_id = ? AND idx = ? AND status = 'pending'",
                    (o.status, o.output, o.error, o.message, now, o.job_id, o.index)).rowcount
                counts = written.setdefault(o.job_id, Counter())
                self._leases.get(o.job_id, {}).pop(o.index, None)
                if changed:
                    counts[o.status] += 1
            for job_id, counts in written.items():
                if not self._leases.get(job_id, True):
                    del self._leases[job_id]
                c.execute("UPDATE jobs SET completed = completed + ?, failed = failed + ? WHERE id = ?",
                          (counts["completed"], counts["failed"], job_id))
                c.execute("UPDATE jobs SET status = CASE WHEN completed > 0 THEN 'completed' ELSE 'failed' END, "
                          "finished_at = ? WHERE id = ? AND status IN ('queued', 'running') "
                          "AND completed + failed + cancelled >= total", (now, job_id))
            marks = ", ".join("?" * len(written))
            rows = c.execute(f"SELECT {JOB_COLUMNS} FROM jobs WHERE id IN ({marks})", list(written)).fetchall()
        progress = []
        for r in rows:
            job = _job(r)
            progress.append(Progress(job.id, job.model, job.status, {
                "completed": job.completed, "failed": job.failed, "cancelled": job.cancelled,
                "pending": job.pending}))
        return progress

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- the JobStore interface, from the event loop ---------------------------------------------------------
    async def create(self, job: NewJob) -> tuple[Job, bool]:
        return await self._run(self._create, job)

    async def get(self, tenant: str, job_id: str) -> Job | None:
        return await self._run(self._get, tenant, job_id)

    async def list_jobs(self, tenant: str, limit: int, after: str | None) -> list[Job]:
        return await self._run(self._list, tenant, limit, after)

    async def results(self, job_id: str, after_index: int, limit: int, with_input: bool = False) -> list[ItemRow]:
        return await self._run(self._results, job_id, after_index, limit, with_input)

    async def put_file(self, meta: StoredFile, content: bytes, max_count: int) -> None:
        await self._run(self._put_file, meta, content, max_count)

    async def get_file(self, tenant: str, file_id: str) -> StoredFile | None:
        return await self._run(self._get_file, tenant, file_id)

    async def file_content(self, tenant: str, file_id: str) -> bytes | None:
        return await self._run(self._file_content, tenant, file_id)

    async def list_files(self, tenant: str, limit: int, after: str | None, purpose: str | None) -> list[StoredFile]:
        return await self._run(self._list_files, tenant, limit, after, purpose)

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        return await self._run(self._delete_file, tenant, file_id)

    async def cancel(self, tenant: str, job_id: str, now: float) -> Job | None:
        return await self._run(self._cancel, tenant, job_id, now)

    async def active(self, models: list[str]) -> list[Job]:
        return await self._run(self._active, models)

    async def claim(self, job_id: str, limit: int, lease_s: float, now: float) -> list[tuple[int, str]]:
        return await self._run(self._claim, job_id, limit, lease_s, now)

    async def renew(self, job_id: str, indexes: list[int], lease_s: float) -> int:
        return await self._run(self._renew, job_id, indexes, lease_s)

    async def release(self, job_id: str, indexes: list[int]) -> None:
        await self._run(self._release, job_id, indexes)

    async def record(self, outcomes: list[Outcome], now: float) -> list[Progress]:
        if not outcomes:
            return []
        return await self._run(self._record, outcomes, now)

    async def close(self) -> None:
        await self._run(self._close)
        self._exec.shutdown(wait=True)
