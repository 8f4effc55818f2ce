"""`JobStore` on one SQLite file in WAL mode: the default, for a single node.

Every call runs on one dedicated thread that owns the connection, never on the event loop: SQLite calls block,
and one thread means one writer, so transactions never wait on each other inside the process. The file is also
`flock`ed, so a second server process pointed at the same file refuses it instead of running the same items twice.
`synchronous=FULL`: a committed job survives a power cut, not only a killed process.

A trigger refuses any second write of an item's result, and `writes` counts the result writes per item, so tests
can prove "recorded exactly once" from the file itself.

Leases are kept in memory, not in the file: the `flock` already makes this process the only one running the
file's items, and a process that dies takes its leases with it, so a restart resumes every pending item at once.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import time
from itertools import chain

from batchserve.jobs.files import LineSplitter, StorageFull, listing
from batchserve.jobs.openai_batch import Sizes
from batchserve.jobs.sqlite_files import SQLiteFileStore, on_store_thread
from batchserve.jobs.store import (
    JOB_COLUMNS,
    JOB_TABLE_COLUMNS,
    SQLITE,
    ACTIVE,
    CANCELLED,
    PAGE_BYTES,
    QUOTA_CODE,
    FileGone,
    ItemRow,
    Job,
    NewJob,
    Outcome,
    Progress,
    row_cost,
    whole_bytes,
)

SCHEMA_VERSION = 2  # PRAGMA user_version; see SQLiteStore._migrate
SCHEMA = (
    """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,"""
    + JOB_TABLE_COLUMNS
    + """
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
);  -- a rowid table (it was WITHOUT ROWID): a line of over ~1 kB then spilled into an overflow page of its own
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
    status TEXT NOT NULL DEFAULT 'processed',
    expires_at REAL
);
CREATE INDEX IF NOT EXISTS files_by_tenant ON files (tenant, seq);
CREATE TABLE IF NOT EXISTS file_chunks (
    file_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    data BLOB NOT NULL,
    UNIQUE (file_id, seq)
);
"""
)
# Columns added since the first schema, by table (a file from before gets them at open).
EXTRA = {
    "jobs": {
        "openai": "TEXT",
        "bytes": "INTEGER NOT NULL DEFAULT 0",
        "output_bytes": "INTEGER NOT NULL DEFAULT 0",
        "error_bytes": "INTEGER NOT NULL DEFAULT 0",
        "expires_at": "REAL",
        "reason": "TEXT",
    },
    "files": {"status": "TEXT NOT NULL DEFAULT 'processed'", "expires_at": "REAL"},
    # An output's size in bytes, kept as it is recorded since length() reads a whole TEXT value (60 ms for 16 MB).
    # NULL: recorded before the column; its size is read from the value.
    "items": {"output_bytes": "INTEGER"},
}


class StoreBusy(Exception):
    """Another process holds the jobs file."""


def end_pending(
    c: sqlite3.Connection, job_id: str, openai: bool, status: str, error: str, message: str, now: float
) -> Sizes:
    """Make every pending item of the job final with this error; what that adds."""
    rows = c.execute(
        "UPDATE items SET status = ?, error = ?, message = ?, finished_at = ? "
        f"WHERE job_id = ? AND status = 'pending' RETURNING idx, {'input' if openai else 'NULL'}",
        (status, error, message, now, job_id),
    ).fetchall()
    return Sizes.ended(job_id, rows, status, error, message, openai)


class SQLiteStore(SQLiteFileStore):
    """See the module docstring; build it with `await SQLiteStore.open(path)`."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._leases: dict[str, dict[int, float]] = {}  # job id -> index -> lease end (monotonic clock)

    @classmethod
    async def open(cls, path: str) -> SQLiteStore:
        store = cls(path)
        try:
            await store._run(store._open)
        except BaseException:
            store._exec.shutdown(wait=False)
            raise
        return store

    # -- on the store thread ---------------------------------------------------------------------------------
    def _open(self) -> None:
        """Lock and open the file; on any failure (a corrupt file, a refused WAL) release both the lock and the
        connection, so the next try (after a repair) starts clean instead of finding its own lock."""
        try:
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
            # A new file gives deleted pages back to the file system (`_vacuum`), so deleting and expiring shrink
            # it; a file from before keeps reusing its free pages instead. Set before anything else writes the file.
            conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise RuntimeError(f"{self.path}: SQLite refused WAL mode (journal_mode={mode})")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA busy_timeout=5000")
            conn.executescript(SCHEMA)
            for table, columns in EXTRA.items():
                have = {r["name"] for r in conn.execute(f"PRAGMA table_info({table})")}
                for name, decl in columns.items():
                    if name not in have:
                        conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")
            self._migrate()
            with self._tx() as c:  # uploads cut short by the process's death (one process holds the file)
                for (file_id,) in c.execute("SELECT id FROM files WHERE status = 'uploading'").fetchall():
                    self._drop_file(c, file_id)
        except BaseException:
            self._close()
            raise

    def _migrate(self) -> None:
        """Version 1: outputs are JSON text; an older file's string outputs are quoted so the API answers the same.
        Version 2: a file's bytes live in `file_chunks`, and each job counts the bytes it keeps (storage quotas)."""
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version >= SCHEMA_VERSION:
            return
        with self._tx() as c:
            if version < 1:
                c.execute("UPDATE items SET output = json_quote(output) WHERE output IS NOT NULL")
            if "content" in {r["name"] for r in c.execute("PRAGMA table_info(files)")}:
                c.execute("INSERT INTO file_chunks (file_id, seq, data) SELECT id, 0, content FROM files")
                c.execute("ALTER TABLE files DROP COLUMN content")
            c.execute(
                "UPDATE jobs SET bytes = (SELECT COALESCE(SUM(length(CAST(input AS BLOB)) + "
                "COALESCE(length(CAST(output AS BLOB)), 0)), 0) "
                "FROM items WHERE items.job_id = jobs.id)"
            )
            c.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    # -- jobs ------------------------------------------------------------------------------------------------
    @on_store_thread
    def create(self, job: NewJob) -> tuple[Job, bool]:
        adding = job.stored_bytes()
        with self._tx() as c:
            if job.idempotency_key is not None:
                row = c.execute(SQLITE.keyed_job, (job.tenant, job.idempotency_key)).fetchone()
                if row is not None:
                    return job.repeat(row)
            self._check(c, job.tenant, adding, "this batch's inputs")
            c.execute(SQLITE.new_job, job.row(adding))
            if job.source_file is None:
                c.executemany(
                    "INSERT INTO items (job_id, idx, input) VALUES (?, ?, ?)",
                    ((job.id, i, text) for i, text in enumerate(job.inputs)),
                )
            else:
                self._copy_lines(c, job)
        return job.queued(adding), True

    def _copy_lines(self, c: sqlite3.Connection, job: NewJob) -> None:
        """The file's lines become the job's items, one stored chunk at a time (never the whole file)."""
        owner = c.execute(SQLITE.file_owner, (job.source_file,)).fetchone()
        if owner is None or owner[0] != job.tenant:
            raise FileGone(job.source_file or "")
        split = LineSplitter()
        index = 0
        chunks = c.execute("SELECT data FROM file_chunks WHERE file_id = ? ORDER BY seq", (job.source_file,))
        for data in chain((bytes(d) for (d,) in chunks), [None]):  # None: the file's end
            lines = split.end() if data is None else split.feed(data)
            c.executemany(
                "INSERT INTO items (job_id, idx, input) VALUES (?, ?, ?)",
                ((job.id, index + k, line.decode()) for k, line in enumerate(lines)),
            )
            index += len(lines)
        if index != job.total:
            raise FileGone(job.source_file or "")  # not the file that was checked (it cannot change: never)

    def _get(self, tenant: str, job_id: str) -> Job | None:
        row = self._db.execute(SQLITE.get_job, (job_id, tenant)).fetchone()
        return Job.of_row(row) if row is not None else None

    @on_store_thread
    def list_jobs(self, tenant: str, limit: int, after: str | None) -> list[Job]:
        return [Job.of_row(r) for r in self._db.execute(*listing("jobs", JOB_COLUMNS, "?", tenant, limit, after))]

    @on_store_thread
    def results(
        self, job_id: str, after_index: int, limit: int, with_input: bool = False, max_bytes: int = PAGE_BYTES
    ) -> list[ItemRow]:
        """Rows are taken from the cursor one at a time (SQLite computes each value's size, Python holds only
        what is kept), until the next would pass `max_bytes`."""
        # A value's bytes: length() of TEXT counts characters, of a BLOB bytes. An input's size is read from the
        # value: a large one is rare (a line of thousands of inputs), a large output is not (their embeddings).
        extra = (
            ", CASE WHEN ib <= :whole THEN input END, ib, "
            "CASE WHEN ib > :whole THEN json_extract(input, '$.custom_id') END"
            if with_input
            else ", NULL, 0, NULL"
        )
        rows = self._db.execute(
            f"SELECT idx, status, CASE WHEN ob <= :whole THEN output END, ob, error, message{extra} "
            "FROM (SELECT idx, status, output, error, message, input, "
            "COALESCE(output_bytes, length(CAST(output AS BLOB)), 0) AS ob, length(CAST(input AS BLOB)) AS ib "
            "FROM items WHERE job_id = :job AND idx > :after ORDER BY idx LIMIT :limit)",
            {"job": job_id, "after": after_index, "limit": limit, "whole": whole_bytes(max_bytes)},
        )
        page: list[ItemRow] = []
        held = 0
        for index, status, output, size, error, message, line, line_bytes, custom_id in rows:
            held += row_cost(size, line_bytes, message, max_bytes)
            if page and held > max_bytes:
                break
            page.append(ItemRow(index, status, output, error, message, line, size, custom_id))
        rows.close()
        return page

    @on_store_thread
    def output_piece(self, job_id: str, index: int, start: int, size: int) -> bytes | None:
        """Read with SQLite's incremental I/O, which reads only the pages that hold the piece (substr would load
        the whole value for each piece); a file from before items had rowids reads it with substr."""
        try:
            found = self._db.execute(
                "SELECT rowid, output IS NULL FROM items WHERE job_id = ? AND idx = ?", (job_id, index)
            ).fetchone()
        except sqlite3.OperationalError:  # a WITHOUT ROWID table
            row = self._db.execute(
                "SELECT substr(CAST(COALESCE(output, '') AS BLOB), ?, ?) FROM items WHERE job_id = ? AND idx = ?",
                (start + 1, size, job_id, index),
            ).fetchone()
            return None if row is None else bytes(row[0])
        if found is None:
            return None
        if found[1]:
            return b""
        with self._db.blobopen("items", "output", found[0], readonly=True) as blob:
            blob.seek(min(start, len(blob)))
            return blob.read(size)

    # -- cancel, delete, expire ------------------------------------------------------------------------------
    @on_store_thread
    def cancel(self, tenant: str, job_id: str, now: float) -> Job | None:
        with self._tx() as c:
            row = c.execute(SQLITE.job_state, (job_id, tenant)).fetchone()
            if row is None:
                return None
            if row["status"] in ACTIVE:
                sizes = end_pending(c, job_id, row["openai"] is not None, *CANCELLED, now)
                c.execute(SQLITE.cancel_job, (sizes.counts["cancelled"], now, sizes.stored, sizes.errors, job_id))
                self._leases.pop(job_id, None)
        return self._get(tenant, job_id)

    @on_store_thread
    def delete_job(self, tenant: str, job_id: str) -> Job | None:
        with self._tx() as c:
            job = self._get(tenant, job_id)
            if job is None:
                return None
            if job.status not in ACTIVE:
                self._drop_job(c, job_id)
        self._vacuum()
        return job

    @staticmethod
    def _drop_job(c: sqlite3.Connection, job_id: str) -> None:
        c.execute("DELETE FROM items WHERE job_id = ?", (job_id,))
        c.execute("DELETE FROM jobs WHERE id = ?", (job_id,))

    @on_store_thread
    def sweep(self, now: float) -> tuple[int, int]:
        files = self._db.execute(
            "SELECT id FROM files WHERE status = 'processed' AND expires_at IS NOT NULL AND expires_at <= ?", (now,)
        ).fetchall()
        jobs = self._db.execute(
            "SELECT id FROM jobs WHERE status NOT IN ('queued', 'running') AND expires_at IS NOT NULL "
            "AND expires_at <= ?",
            (now,),
        ).fetchall()
        for drop, ids in ((self._drop_file, files), (self._drop_job, jobs)):
            for (one,) in ids:  # one short transaction each: other store calls go between them
                with self._tx() as c:
                    drop(c, one)
        if files or jobs:
            self._vacuum()
        return len(files), len(jobs)

    @on_store_thread
    def active(self, models: list[str]) -> list[Job]:
        marks = ", ".join("?" * len(models))
        rows = self._db.execute(
            f"SELECT {JOB_COLUMNS} FROM jobs WHERE status IN ('queued', 'running') AND model IN ({marks}) ORDER BY seq",
            models,
        )
        return [Job.of_row(r) for r in rows]

    @on_store_thread
    def claim(self, job_id: str, limit: int, lease_s: float, now: float) -> list[tuple[int, str]]:
        clock = time.monotonic()
        leases = self._leases.setdefault(job_id, {})
        for index in [i for i, until in leases.items() if until <= clock]:
            del leases[index]  # expired: claimable again
        rows = self._db.execute(
            "SELECT idx, input FROM items WHERE job_id = ? AND status = 'pending' ORDER BY idx LIMIT ?",
            (job_id, limit + len(leases)),
        )
        claimed = [(r[0], r[1]) for r in rows if r[0] not in leases][:limit]
        for index, _ in claimed:
            leases[index] = clock + lease_s
        if claimed:
            self._db.execute(SQLITE.job_running, (now, job_id))
        return claimed

    @on_store_thread
    def renew(self, job_id: str, indexes: list[int], lease_s: float) -> int:
        leases = self._leases.get(job_id, {})
        until = time.monotonic() + lease_s
        held = [i for i in indexes if i in leases]
        for index in held:
            leases[index] = until
        return len(held)

    @on_store_thread
    def release(self, job_id: str, indexes: list[int]) -> None:
        leases = self._leases.get(job_id, {})
        for index in indexes:
            leases.pop(index, None)

    @on_store_thread
    def record(self, outcomes: list[Outcome], now: float) -> list[Progress]:
        if not outcomes:
            return []
        by_job = {j: [o for o in outcomes if o.job_id == j] for j in dict.fromkeys(o.job_id for o in outcomes)}
        progress: list[Progress] = []
        with self._tx() as c:
            marks = ", ".join("?" * len(by_job))
            owners = {
                r[0]: (r[1], r[2] is not None)
                for r in c.execute(f"SELECT id, tenant, openai FROM jobs WHERE id IN ({marks})", list(by_job))
            }
            for job_id, outs in by_job.items():
                tenant, openai = owners.get(job_id, ("", False))
                reason = None
                try:
                    self._check(c, tenant, sum(o.stored_bytes() for o in outs), f"the outputs of batch {job_id}")
                except StorageFull as full:  # the job fails whole, saying why; nothing more of it is kept
                    reason = full.message
                    outs = [o.over_quota(reason) for o in outs]
                sizes = Sizes()
                leases = self._leases.get(job_id, {})
                for o in outs:
                    stored = o.stored_bytes()
                    row = c.execute(  # the input only where its custom_id sizes a file line
                        "UPDATE items SET status = ?, output = ?, output_bytes = ?, error = ?, message = ?, "
                        "writes = writes + 1, finished_at = ? WHERE job_id = ? AND idx = ? AND status = 'pending' "
                        f"RETURNING {'input' if openai else 'NULL'}",
                        (o.status, o.output, stored, o.error, o.message, now, o.job_id, o.index),
                    ).fetchone()
                    leases.pop(o.index, None)
                    if row is not None:
                        sizes.add(o, stored, row[0])
                if reason is not None:
                    sizes.merge(end_pending(c, job_id, openai, "failed", QUOTA_CODE, reason, now))
                    self._leases.pop(job_id, None)
                elif not self._leases.get(job_id, True):
                    del self._leases[job_id]
                c.execute(SQLITE.book_job, (*sizes.grows(), reason, job_id))
                for row in c.execute(SQLITE.finish_job, (now, job_id)).fetchall():
                    progress.append(Progress.of(Job.of_row(row)))
        return progress

    get = on_store_thread(_get)
