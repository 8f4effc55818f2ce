"""`JobStore` on PostgreSQL: one job store shared by every node (`--jobs-db postgresql://...`).

Any node accepts a job; any node runs its items. Why each part is as it is:
- `create` is one transaction: the job row with `ON CONFLICT (tenant, idempotency_key) DO NOTHING`, then the
  items by `COPY`. Two nodes that receive the same key at once: the second insert waits for the first to commit,
  does nothing, and reads the first job back, so a key holds across nodes.
- `claim` is `UPDATE ... FROM (SELECT ... FOR UPDATE SKIP LOCKED)`: pending items whose lease is absent or past
  are leased to this store (`holder`, `lease_until`), skipping rows another node is claiming at that instant.
  Lease times are the database's clock (`clock_timestamp()`), never a node's, so a node with a skewed clock can
  neither keep nor steal leases. The holder renews its leases while the items are in flight; a node that dies
  stops renewing, and once the lease is past another node claims the items again.
- `record` updates each item only while it is still `pending` (`writes = writes + 1`, and a trigger refuses any
  second change of a final item), so an item run twice — a lease that ran out under a slow node — is recorded
  once; the job's counters move in the same transaction.
Tables are prefixed `batchserve_` so the database can be shared with other applications; the schema is
created at open, under an advisory lock so nodes starting together do not race.
- Outages (issue 28, item 5; issue 34, item 4): every call is bounded on the client, whatever the server does:
  the whole call (waiting for a pooled connection, connecting, every statement, the commit) runs as a task
  given `CALL_BOUND_S` (2 s; a call that moves many rows or bytes more, `bound_for`), and when the bound passes the
  socket
  of the connection it holds is shut down, so the call fails at once instead of waiting for a server that
  may never answer (a stopped or black-holed server answers nothing and refuses nothing: the server's own
  `statement_timeout` never fires, and TCP keepalives never fire on a unix socket or while the peer's kernel
  still acknowledges). A failure that says the database is unreachable, the bound passing among them, opens a
  circuit breaker (`breaker.py`) that refuses every call at once (503) while one probe per second tries a
  fresh connection, inside the same bound. When the probe gets through, a fresh pool replaces the old one
  (whose connections are dead, and whose reconnection backoff can grow to minutes), so the store is in use
  again about a second after the database returns. The outage is logged once as it begins and once as it
  ends (`job store down` / `job store back up`); the calls it fails raise `StoreDown`, which the callers
  answer (503) or retry without a line each.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import secrets
import socket
import time
from collections import Counter
from typing import Any, TypeVar
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
import psycopg
from psycopg import AsyncConnection, errors
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from batchserve.jobs.breaker import CircuitBreaker
from batchserve.jobs.files import FileLimitReached, LineSplitter, StorageFull, StorageLimits, StoredFile
from batchserve.jobs.openai_batch import line_size
from batchserve.jobs.store import (
    ACTIVE,
    PAGE_BYTES,
    FileGone,
    IdempotencyConflict,
    ItemRow,
    Job,
    NewJob,
    Outcome,
    Progress,
    Sizes,
    StoreDown,
    StoreUnavailable,
    UnstorableInput,
    whole_bytes,
)

T = TypeVar("T")
log = logging.getLogger("batchserve")
# The pool warns once per discarded connection and per failed reconnection, a line every second or two for as
# long as an outage lasts: the store's own two lines (down, back up) say it once.
logging.getLogger("psycopg.pool").setLevel(logging.ERROR)

POOL_MAX = 4  # connections per node: the feeder, the writer, the lease keeper and the API rarely all at once
OPEN_TIMEOUT_S = 10  # the first pool's connections at start-up
CONNECT_TIMEOUT_S = 2  # libpq's connect_timeout (its least): an unreachable host fails in 2 s, not the OS's minutes
STATEMENT_TIMEOUT_MS = 5000  # the server's own bound on a statement (a 50,000-item COPY takes well under a second)
CALL_BOUND_S = 2.0  # the longest a store call touching a few rows takes on the client, pool wait included
BODY_BYTES_PER_S = 20 << 20  # a call that moves many bytes gets 1 s more per 20 MiB of them (`bound_for`)
ROWS_PER_S = 10_000  # and 1 s more per 10,000 rows it writes or reads (a 50,000-item COPY took 2.1 s on a
# loaded 2-core machine, a cancel of as many 1.9 s: one bound for every call would take those for outages)
# A read whose size is not known before it runs (a file's content, a page of results, claimed items' inputs):
# as for the default --files-max-bytes (60 MiB): 5 s, and its rows.
READ_BYTES = 60 << 20
CUT_GRACE_S = 0.5  # after its socket is shut down, how long a call is given to fail before it is left behind
KEEPALIVES = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 3}
TX_ATTEMPTS = 3  # a deadlock or serialization failure is retried this many times before the caller sees it
SCHEMA_LOCK = 0x6261746368  # pg_advisory_xact_lock key taken while the schema is created

SCHEMA = """
CREATE TABLE IF NOT EXISTS batchserve_jobs (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
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
    created_at DOUBLE PRECISION NOT NULL,
    started_at DOUBLE PRECISION,
    finished_at DOUBLE PRECISION,
    UNIQUE (tenant, idempotency_key)
);
CREATE INDEX IF NOT EXISTS batchserve_jobs_by_tenant ON batchserve_jobs (tenant, seq);
CREATE INDEX IF NOT EXISTS batchserve_jobs_active ON batchserve_jobs (seq) WHERE status IN ('queued', 'running');
CREATE TABLE IF NOT EXISTS batchserve_items (
    job_id TEXT NOT NULL REFERENCES batchserve_jobs (id) ON DELETE CASCADE,
    idx INTEGER NOT NULL,
    input TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'pending',
    output TEXT,
    error TEXT,
    message TEXT,
    writes INTEGER NOT NULL DEFAULT 0,
    finished_at DOUBLE PRECISION,
    holder TEXT,
    lease_until TIMESTAMPTZ,
    PRIMARY KEY (job_id, idx)
);
CREATE INDEX IF NOT EXISTS batchserve_items_pending ON batchserve_items (job_id, idx) WHERE status = 'pending';
CREATE OR REPLACE FUNCTION batchserve_items_final_once() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'job item %/% left pending twice', OLD.job_id, OLD.idx;
END $$;
CREATE OR REPLACE TRIGGER batchserve_items_final_once BEFORE UPDATE OF status ON batchserve_items
FOR EACH ROW WHEN (OLD.status <> 'pending') EXECUTE FUNCTION batchserve_items_final_once();
ALTER TABLE batchserve_jobs ADD COLUMN IF NOT EXISTS openai TEXT;
CREATE TABLE IF NOT EXISTS batchserve_files (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes BIGINT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS batchserve_files_by_tenant ON batchserve_files (tenant, seq);
ALTER TABLE batchserve_files ADD COLUMN IF NOT EXISTS status TEXT NOT NULL DEFAULT 'processed';
ALTER TABLE batchserve_files ADD COLUMN IF NOT EXISTS expires_at DOUBLE PRECISION;
CREATE TABLE IF NOT EXISTS batchserve_file_chunks (
    file_id TEXT NOT NULL REFERENCES batchserve_files (id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    data BYTEA NOT NULL,
    PRIMARY KEY (file_id, seq)
);
DO $$ BEGIN
    IF EXISTS (SELECT 1 FROM information_schema.columns WHERE table_name = 'batchserve_files'
               AND column_name = 'content' AND table_schema = current_schema()) THEN
        INSERT INTO batchserve_file_chunks (file_id, seq, data) SELECT id, 0, content FROM batchserve_files;
        ALTER TABLE batchserve_files DROP COLUMN content;
    END IF;
END $$;
ALTER TABLE batchserve_jobs ADD COLUMN IF NOT EXISTS bytes BIGINT NOT NULL DEFAULT 0;
ALTER TABLE batchserve_jobs ADD COLUMN IF NOT EXISTS output_bytes BIGINT NOT NULL DEFAULT 0;
ALTER TABLE batchserve_jobs ADD COLUMN IF NOT EXISTS error_bytes BIGINT NOT NULL DEFAULT 0;
ALTER TABLE batchserve_jobs ADD COLUMN IF NOT EXISTS expires_at DOUBLE PRECISION;
ALTER TABLE batchserve_jobs ADD COLUMN IF NOT EXISTS reason TEXT;
"""

JOB_COLUMNS = (
    "id, tenant, model, status, total, completed, failed, cancelled, created_at, started_at, "
    "finished_at, metadata, openai, bytes, output_bytes, error_bytes, expires_at, reason"
)
FILE_COLUMNS = "id, tenant, filename, purpose, bytes, created_at, expires_at"
ABANDONED_S = 3600.0  # an upload still `uploading` this long after it began was abandoned (its node died)
QUOTA_CODE = "STORAGE_QUOTA_EXCEEDED"
USAGE = (
    "SELECT (SELECT COALESCE(SUM(bytes), 0) FROM batchserve_files WHERE tenant = %(t)s) + "
    "(SELECT COALESCE(SUM(bytes), 0) FROM batchserve_jobs WHERE tenant = %(t)s)"
)
TOTAL = (
    "SELECT (SELECT COALESCE(SUM(bytes), 0) FROM batchserve_files) + "
    "(SELECT COALESCE(SUM(bytes), 0) FROM batchserve_jobs)"
)
LEASE = "clock_timestamp() + %(lease_s)s * interval '1 second'"
NUL_FREE = "\ufffd"  # PostgreSQL text cannot hold NUL: an output carrying one is stored with this instead


def _job(row: tuple[Any, ...]) -> Job:
    meta = row[11]
    return Job(
        row[0],
        row[1],
        row[2],
        row[3],
        row[4],
        row[5],
        row[6],
        row[7],
        row[8],
        row[9],
        row[10],
        orjson.loads(meta) if meta is not None else None,
        orjson.loads(row[12]) if row[12] is not None else None,
        row[13],
        row[14],
        row[15],
        row[16],
        row[17],
    )


def _file(row: tuple[Any, ...]) -> StoredFile:
    return StoredFile(*row)


def _text(value: str | None) -> str | None:
    return value.replace("\x00", NUL_FREE) if value is not None and "\x00" in value else value


def with_timeouts(url: str) -> str:
    """The connection string with the short connect and statement timeouts and keepalives added (options the
    URL already sets, such as a search_path, are kept)."""
    options = conninfo_to_dict(url).get("options") or ""
    return make_conninfo(
        url,
        connect_timeout=CONNECT_TIMEOUT_S,
        options=f"{options} -c statement_timeout={STATEMENT_TIMEOUT_MS}".strip(),
        **KEEPALIVES,
    )


def bound_for(nbytes: int = 0, rows: int = 0) -> float:
    """The client-side bound of a call that moves `nbytes` (a job's inputs, an uploaded file, results) in
    `rows` rows: `CALL_BOUND_S`, and more for a large call, so a healthy one is never taken for an outage."""
    return CALL_BOUND_S + nbytes / BODY_BYTES_PER_S + rows / ROWS_PER_S


BIG_DELETE_S = bound_for(256 << 20, 50_000)  # deletes of a whole file or job: they free what uploads and batches kept


def cut(conn: AsyncConnection) -> None:
    """Shut the connection's socket down under whatever is waiting on it: the wait sees end-of-file and fails
    at once (psycopg's own cancellation would ask the server, which does not answer, for up to 10 s more)."""
    try:
        sock = socket.socket(fileno=os.dup(conn.pgconn.socket))
    except (OSError, psycopg.Error):  # already closed
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()  # the duplicate only: the connection's own descriptor is closed by psycopg


class NoAnswer(Exception):
    """A bounded call passed its bound (`within`)."""


_LEFT_BEHIND: set[asyncio.Future] = set()  # calls still ending after their bound passed and their socket was cut


async def within(bound_s: float, run: Callable[[list[AsyncConnection]], Awaitable[T]]) -> T:
    """`run(held)` as a task given `bound_s`; `run` keeps the connection it uses in `held`. Past the bound, that
    connection is cut (the call then fails in a moment) or, while it holds none (waiting for the pool, or
    connecting: nothing waits on the server), the task is cancelled; `NoAnswer` is raised either way. A call
    that still has not ended `CUT_GRACE_S` later is left to end in the background. The caller's own
    cancellation cuts and cancels the same way."""
    held: list[AsyncConnection] = []
    task = asyncio.ensure_future(run(held))
    try:
        done, _ = await asyncio.wait({task}, timeout=bound_s)
    except asyncio.CancelledError:
        for conn in held:
            cut(conn)
        task.cancel()
        raise
    if done:
        return task.result()
    if held:
        for conn in held:
            cut(conn)
    else:
        task.cancel()
    await asyncio.wait({task}, timeout=CUT_GRACE_S)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its error is seen, never "unretrieved"
    if not task.done():
        task.cancel()
        _LEFT_BEHIND.add(task)
        task.add_done_callback(_LEFT_BEHIND.discard)
    raise NoAnswer(f"no answer within {bound_s:g} s")


class PostgresStore:
    """See the module docstring; build it with `await PostgresStore.open(url)`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conninfo = with_timeouts(url)
        # Who holds a lease: readable in the table, so an operator can tell which node runs (or ran) an item.
        self.holder = f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(3)}"
        self.breaker = CircuitBreaker()
        self.limits = StorageLimits()
        self._pool = self._new_pool()
        self._closing: set[asyncio.Task] = set()  # old pools being closed after a recovery
        self._down_since, self._refused = 0.0, 0  # when the outage being logged began (0: up), calls refused in it

    def _new_pool(self) -> AsyncConnectionPool:
        return AsyncConnectionPool(
            self.conninfo, min_size=1, max_size=POOL_MAX, open=False, timeout=CALL_BOUND_S, name="batchserve-jobs"
        )

    @classmethod
    async def open(cls, url: str) -> PostgresStore:
        # One plain connection first: a database that is down or refuses us fails at once with the server's
        # own words, where the pool would retry quietly until its timeout.
        async def first(held: list[AsyncConnection]) -> None:
            async with await AsyncConnection.connect(with_timeouts(url)) as conn:
                held.append(conn)
                async with conn.transaction():
                    await cls._create_schema(conn)

        try:
            await within(OPEN_TIMEOUT_S, first)
        except psycopg.Error as exc:
            raise StoreUnavailable(str(exc).strip() or type(exc).__name__) from None
        except NoAnswer as exc:
            raise StoreUnavailable(f"the PostgreSQL job store: {exc}") from None
        store = cls(url)
        try:
            await store._pool.open(wait=True, timeout=OPEN_TIMEOUT_S)
        except PoolTimeout as exc:
            await store._pool.close()
            raise StoreUnavailable(str(exc)) from None
        return store

    async def _tx(self, fn: Callable[[AsyncConnection], Awaitable[T]], bound_s: float = CALL_BOUND_S) -> T:
        """Run `fn` in one transaction within `bound_s` on the client; a deadlock or serialization failure runs
        it again (it wrote nothing). Refused at once (`StoreDown`) while the breaker is open; an unreachable
        database, or no answer within the bound, opens it (`StoreDown` too: the outage is logged once)."""
        try:
            probe = self.breaker.before()
        except StoreDown:
            self._refused += 1
            raise
        deadline = time.monotonic() + bound_s
        try:
            try:
                result = await within(bound_s, lambda held: self._attempts(fn, probe, held, deadline))
            except NoAnswer as exc:
                raise self._unreachable(str(exc)) from None
            except (PoolTimeout, psycopg.OperationalError, psycopg.InterfaceError) as exc:
                raise self._unreachable(_first_line(exc)) from None
            except psycopg.Error as exc:  # the database answered (a constraint, a trigger): it is up
                self._reachable()
                raise StoreUnavailable(f"the PostgreSQL job store failed: {exc}") from None
            except (StoreUnavailable, IdempotencyConflict, FileLimitReached):
                self._reachable()  # it answered (a conflict, a limit, a deadlock three times)
                raise
            self._reachable()
            return result
        finally:
            if probe:
                self.breaker.abandon_probe()  # no-op once a verdict was given

    async def _attempts(
        self, fn: Callable[[AsyncConnection], Awaitable[T]], probe: bool, held: list[AsyncConnection], deadline: float
    ) -> T:
        if probe:
            await self._reopen(deadline)
        for attempt in range(TX_ATTEMPTS):
            conn = await self._pool.getconn(timeout=max(0.001, deadline - time.monotonic()))
            held.append(conn)
            try:
                async with conn.transaction():
                    return await fn(conn)
            except (errors.DeadlockDetected, errors.SerializationFailure):
                if attempt == TX_ATTEMPTS - 1:
                    raise StoreUnavailable("the job store kept deadlocking; try again") from None
                await asyncio.sleep(random.uniform(0.005, 0.05) * (attempt + 1))
            finally:  # out of `held` first: `within` must never cut a connection the pool may hand to another call
                held.clear()
                await self._pool.putconn(conn)
        raise AssertionError("unreachable")

    def _unreachable(self, reason: str) -> StoreDown:
        """Open the breaker (one log line as the outage begins, none for the calls that fail during it)."""
        was_up = self.breaker.closed
        self.breaker.failure(reason)
        if was_up:
            self._down_since, self._refused = time.monotonic(), 0
            log.warning(
                "job store down: %s; /v1/batches answers 503 JOBS_UNAVAILABLE and a fresh connection is "
                "tried once a second",
                reason,
            )
        return StoreDown(f"the job store is unreachable ({reason}); tried again every {self.breaker.open_s:g} s")

    def _reachable(self) -> None:
        was_down = not self.breaker.closed
        self.breaker.success()
        if was_down and self._down_since:
            log.warning(
                "job store back up after %.1f s down (%d store calls refused meanwhile)",
                time.monotonic() - self._down_since,
                self._refused,
            )
            self._down_since = 0.0

    async def _reopen(self, deadline: float) -> None:
        """The probe after an outage: one fresh connection (fails in milliseconds while the server refuses, in
        `CONNECT_TIMEOUT_S` at most, and within the call's bound), then a fresh pool in place of the old, whose
        connections died with the server and whose reconnection backoff may have grown long. Failures raise
        psycopg's errors, which `_tx` turns into a verdict."""
        conn = await AsyncConnection.connect(self.conninfo)
        await conn.close()
        pool = self._new_pool()
        try:
            await pool.open(wait=True, timeout=max(0.001, deadline - time.monotonic()))
        except BaseException:
            await pool.close(timeout=0)
            raise
        old, self._pool = self._pool, pool
        task = asyncio.create_task(old.close(timeout=1.0))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    @staticmethod
    async def _create_schema(conn: AsyncConnection) -> None:
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
        await conn.execute(SCHEMA)

    # -- the JobStore interface ------------------------------------------------------------------------------
    # -- bytes kept ------------------------------------------------------------------------------------------
    async def _check(self, conn: AsyncConnection, tenant: str, adding: int, what: str) -> None:
        """StorageFull when `adding` bytes would pass a bound. The tenant's own writers are serialized by an
        advisory lock (taken first in every transaction that adds bytes, so they never deadlock), so two
        nodes cannot both pass its quota; the server total is checked without one (it may pass by what
        concurrent writers add at the same instant)."""
        if not self.limits.bounded or adding <= 0:
            return
        await self._lock_tenant(conn, tenant)
        mine, total = await self._usage(conn, tenant)
        self.limits.check(tenant, mine, total, adding, what)

    async def _lock_tenant(self, conn: AsyncConnection, tenant: str) -> None:
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", ("batchserve-storage/" + tenant,))

    async def _usage(self, conn: AsyncConnection, tenant: str) -> tuple[int, int]:
        cur = await conn.execute(USAGE, {"t": tenant})
        row = await cur.fetchone()
        mine = int(row[0]) if row is not None else 0
        if not self.limits.total_bytes:
            return mine, 0
        cur = await conn.execute(TOTAL)
        row = await cur.fetchone()
        return mine, int(row[0]) if row is not None else 0

    async def usage(self, tenant: str) -> tuple[int, int]:
        async def tx(conn: AsyncConnection) -> tuple[int, int]:
            cur = await conn.execute(USAGE, {"t": tenant})
            mine = await cur.fetchone()
            cur = await conn.execute(TOTAL)
            total = await cur.fetchone()
            return int(mine[0]) if mine else 0, int(total[0]) if total else 0

        return await self._tx(tx)

    # -- the JobStore interface ------------------------------------------------------------------------------
    async def create(self, job: NewJob) -> tuple[Job, bool]:
        for i, text in enumerate(job.inputs):
            if "\x00" in text:
                raise UnstorableInput(i, "contains a NUL character (\\u0000), which the job store cannot hold")
        meta = orjson.dumps(job.metadata).decode() if job.metadata is not None else None
        openai = orjson.dumps(job.openai).decode() if job.openai is not None else None
        adding = job.stored_bytes()

        async def tx(conn: AsyncConnection) -> tuple[Job, bool]:
            if self.limits.bounded:
                await self._lock_tenant(conn, job.tenant)
            cur = await conn.execute(
                "INSERT INTO batchserve_jobs (id, tenant, model, status, total, metadata, idempotency_key, "
                "request_hash, created_at, openai, bytes, expires_at) "
                "VALUES (%s, %s, %s, 'queued', %s, %s, %s, %s, %s, %s, 0, %s) "
                "ON CONFLICT (tenant, idempotency_key) DO NOTHING RETURNING seq",
                (
                    job.id,
                    job.tenant,
                    job.model,
                    job.count(),
                    meta,
                    job.idempotency_key,
                    job.request_hash,
                    job.created_at,
                    openai,
                    job.expires_at,
                ),
            )
            if await cur.fetchone() is None:  # the key was used before (perhaps on another node just now)
                cur = await conn.execute(
                    f"SELECT {JOB_COLUMNS}, request_hash FROM batchserve_jobs "
                    f"WHERE tenant = %s AND idempotency_key = %s",
                    (job.tenant, job.idempotency_key),
                )
                row = await cur.fetchone()
                assert row is not None
                if row[18] != job.request_hash:
                    raise IdempotencyConflict(job.idempotency_key)
                return _job(row), False
            await self._check(conn, job.tenant, adding, "this batch's inputs")
            await conn.execute("UPDATE batchserve_jobs SET bytes = %s WHERE id = %s", (adding, job.id))
            if job.source_file is None:
                async with conn.cursor() as items:
                    async with items.copy("COPY batchserve_items (job_id, idx, input) FROM STDIN") as copy:
                        for i, text in enumerate(job.inputs):
                            await copy.write_row((job.id, i, text))
            else:
                await self._copy_lines(conn, job)
            return job.queued(adding), True

        return await self._tx(tx, bound_for(adding, job.count()))  # a file's copy: its bytes and lines

    async def _copy_lines(self, conn: AsyncConnection, job: NewJob) -> None:
        """The file's lines become the job's items, one stored chunk at a time (never the whole file): each
        chunk read, split on a worker thread, and its lines copied in, in the job's transaction."""
        cur = await conn.execute(
            "SELECT tenant FROM batchserve_files WHERE id = %s AND status = 'processed'", (job.source_file,)
        )
        owner = await cur.fetchone()
        if owner is None or owner[0] != job.tenant:
            raise FileGone(job.source_file or "")
        split = LineSplitter()
        index, seq = 0, -1
        while True:
            cur = await conn.execute(
                "SELECT seq, data FROM batchserve_file_chunks WHERE file_id = %s AND seq > %s ORDER BY seq LIMIT 1",
                (job.source_file, seq),
            )
            row = await cur.fetchone()
            lines = split.end() if row is None else await asyncio.to_thread(split.feed, bytes(row[1]))
            if lines:
                async with conn.cursor() as items:
                    async with items.copy("COPY batchserve_items (job_id, idx, input) FROM STDIN") as copy:
                        for line in lines:
                            await copy.write_row((job.id, index, line.decode()))
                            index += 1
            if row is None:
                break
            seq = row[0]
        if index != job.total:
            raise FileGone(job.source_file or "")

    async def get(self, tenant: str, job_id: str) -> Job | None:
        async def tx(conn: AsyncConnection) -> Job | None:
            cur = await conn.execute(
                f"SELECT {JOB_COLUMNS} FROM batchserve_jobs WHERE id = %s AND tenant = %s", (job_id, tenant)
            )
            row = await cur.fetchone()
            return _job(row) if row is not None else None

        return await self._tx(tx)

    async def list_jobs(self, tenant: str, limit: int, after: str | None) -> list[Job]:
        async def tx(conn: AsyncConnection) -> list[Job]:
            if after is None:
                cur = await conn.execute(
                    f"SELECT {JOB_COLUMNS} FROM batchserve_jobs WHERE tenant = %s ORDER BY seq DESC LIMIT %s",
                    (tenant, limit),
                )
            else:
                cur = await conn.execute(
                    f"SELECT {JOB_COLUMNS} FROM batchserve_jobs WHERE tenant = %s AND seq < "
                    f"(SELECT seq FROM batchserve_jobs WHERE id = %s AND tenant = %s) ORDER BY seq DESC LIMIT %s",
                    (tenant, after, tenant, limit),
                )
            return [_job(r) for r in await cur.fetchall()]

        return await self._tx(tx)

    async def results(
        self, job_id: str, after_index: int, limit: int, with_input: bool = False, max_bytes: int = PAGE_BYTES
    ) -> list[ItemRow]:
        """The rows that fit in `max_bytes` are chosen by their values' sizes first (octet_length reads a
        TOASTed value's header, not the value), then read."""
        in_bytes = "octet_length(input)" if with_input else "0"
        line = "CASE WHEN octet_length(i.input) <= %(whole)s THEN i.input END" if with_input else "NULL"
        custom_id = (
            "CASE WHEN octet_length(i.input) > %(whole)s THEN i.input::json ->> 'custom_id' END"
            if with_input
            else "NULL"
        )

        async def tx(conn: AsyncConnection) -> list[ItemRow]:
            cur = await conn.execute(
                "SELECT i.idx, i.status, CASE WHEN octet_length(i.output) <= %(whole)s THEN i.output END, "
                f"i.error, i.message, {line}, COALESCE(octet_length(i.output), 0), "
                f"{custom_id} "
                "FROM (SELECT idx, row_number() OVER w AS n, SUM(cost) OVER w AS upto "
                "FROM (SELECT idx, LEAST(COALESCE(octet_length(output), 0), %(whole)s) "
                f"+ LEAST({in_bytes}, %(whole)s) + COALESCE(length(message), 0) AS cost "
                "FROM batchserve_items WHERE job_id = %(job)s AND idx > %(after)s ORDER BY idx LIMIT %(limit)s) s "
                "WINDOW w AS (ORDER BY idx)) c "
                "JOIN batchserve_items i ON i.job_id = %(job)s AND i.idx = c.idx "
                "WHERE c.n = 1 OR c.upto <= %(max)s ORDER BY i.idx",
                {
                    "job": job_id,
                    "after": after_index,
                    "limit": limit,
                    "whole": whole_bytes(max_bytes),
                    "max": max_bytes,
                },
            )
            return [ItemRow(*r) for r in await cur.fetchall()]

        return await self._tx(tx, bound_for(READ_BYTES, limit))  # a held input's custom_id is parsed there

    async def output_piece(self, job_id: str, index: int, start: int, size: int) -> bytes | None:
        async def tx(conn: AsyncConnection) -> bytes | None:
            cur = await conn.execute(
                "SELECT substring(convert_to(COALESCE(output, ''), 'UTF8') FROM %s FOR %s) FROM batchserve_items "
                "WHERE job_id = %s AND idx = %s",
                (start + 1, size, job_id, index),
            )
            row = await cur.fetchone()
            return None if row is None else bytes(row[0])

        return await self._tx(tx, bound_for(READ_BYTES))  # the whole output is decompressed for each piece

    async def begin_file(self, meta: StoredFile, max_count: int) -> None:
        async def tx(conn: AsyncConnection) -> None:
            # Serialize one tenant's uploads, so two at once cannot both pass the count.
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", ("batchserve-files/" + meta.tenant,))
            cur = await conn.execute("SELECT count(*) FROM batchserve_files WHERE tenant = %s", (meta.tenant,))
            row = await cur.fetchone()
            if row is not None and row[0] >= max_count:
                raise FileLimitReached(meta.tenant)
            await conn.execute(
                "INSERT INTO batchserve_files (id, tenant, filename, purpose, bytes, created_at, "
                "status, expires_at) VALUES (%s, %s, %s, %s, 0, %s, 'uploading', %s)",
                (meta.id, meta.tenant, meta.filename, meta.purpose, meta.created_at, meta.expires_at),
            )

        await self._tx(tx)

    async def put_chunk(self, tenant: str, file_id: str, seq: int, data: bytes | bytearray) -> None:
        async def tx(conn: AsyncConnection) -> None:
            await self._check(conn, tenant, len(data), "this upload")
            await conn.execute(
                "INSERT INTO batchserve_file_chunks (file_id, seq, data) VALUES (%s, %s, %s)", (file_id, seq, data)
            )
            await conn.execute("UPDATE batchserve_files SET bytes = bytes + %s WHERE id = %s", (len(data), file_id))

        await self._tx(tx, bound_for(len(data)))

    async def finish_file(self, meta: StoredFile) -> None:
        async def tx(conn: AsyncConnection) -> None:
            await conn.execute(
                "UPDATE batchserve_files SET status = 'processed', filename = %s, purpose = %s, "
                "bytes = %s, expires_at = %s WHERE id = %s",
                (meta.filename, meta.purpose, meta.bytes, meta.expires_at, meta.id),
            )

        await self._tx(tx)

    async def abort_file(self, file_id: str) -> None:
        async def tx(conn: AsyncConnection) -> None:
            await conn.execute("DELETE FROM batchserve_files WHERE id = %s", (file_id,))  # chunks: ON DELETE CASCADE

        await self._tx(tx, BIG_DELETE_S)  # the chunks stored so far

    async def get_file(self, tenant: str, file_id: str) -> StoredFile | None:
        async def tx(conn: AsyncConnection) -> StoredFile | None:
            cur = await conn.execute(
                f"SELECT {FILE_COLUMNS} FROM batchserve_files WHERE id = %s AND tenant = %s AND status = 'processed'",
                (file_id, tenant),
            )
            row = await cur.fetchone()
            return _file(row) if row is not None else None

        return await self._tx(tx)

    async def file_chunks(self, tenant: str, file_id: str) -> AsyncIterator[bytes]:
        if await self.get_file(tenant, file_id) is None:
            return
        seq = -1
        while True:

            async def tx(conn: AsyncConnection, after: int = seq) -> tuple[int, bytes] | None:
                cur = await conn.execute(
                    "SELECT seq, data FROM batchserve_file_chunks WHERE file_id = %s AND seq > %s ORDER BY seq LIMIT 1",
                    (file_id, after),
                )
                row = await cur.fetchone()
                return (row[0], bytes(row[1])) if row is not None else None

            found = await self._tx(tx, bound_for(2 << 20))  # one chunk (1 MB) a call
            if found is None:
                return
            seq, data = found
            yield data

    async def list_files(self, tenant: str, limit: int, after: str | None, purpose: str | None) -> list[StoredFile]:
        where, args = "tenant = %s AND status = 'processed'", [tenant]
        if purpose is not None:
            where, args = where + " AND purpose = %s", args + [purpose]
        if after is not None:
            where += " AND seq < (SELECT seq FROM batchserve_files WHERE id = %s AND tenant = %s)"
            args += [after, tenant]

        async def tx(conn: AsyncConnection) -> list[StoredFile]:
            cur = await conn.execute(
                f"SELECT {FILE_COLUMNS} FROM batchserve_files WHERE {where} ORDER BY seq DESC LIMIT %s", (*args, limit)
            )
            return [_file(r) for r in await cur.fetchall()]

        return await self._tx(tx)

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        async def tx(conn: AsyncConnection) -> bool:
            cur = await conn.execute(
                "DELETE FROM batchserve_files WHERE id = %s AND tenant = %s AND status = 'processed'", (file_id, tenant)
            )
            return cur.rowcount > 0

        return await self._tx(tx, BIG_DELETE_S)  # a file's chunks: up to --files-max-bytes

    async def _end_pending(
        self, conn: AsyncConnection, job_id: str, openai: bool, status: str, error: str, message: str, now: float
    ) -> Sizes:
        """Make every pending item of the job final with this error; the bytes that adds."""
        cur = await conn.execute(
            "UPDATE batchserve_items SET status = %s, error = %s, message = %s, finished_at = %s, lease_until = NULL "
            f"WHERE job_id = %s AND status = 'pending' RETURNING idx, {'input' if openai else 'NULL'}",
            (status, error, message, now, job_id),
        )
        rows = await cur.fetchall()
        sizes = Sizes(count=len(rows))
        if openai and rows:

            def measure() -> Sizes:
                for idx, text in rows:
                    sizes.add(line_size(job_id, ItemRow(idx, status, None, error, message, text)))
                return sizes

            await asyncio.to_thread(measure)
        return sizes

    async def delete_job(self, tenant: str, job_id: str) -> Job | None:
        async def tx(conn: AsyncConnection) -> Job | None:
            cur = await conn.execute(
                f"SELECT {JOB_COLUMNS} FROM batchserve_jobs WHERE id = %s AND tenant = %s", (job_id, tenant)
            )
            row = await cur.fetchone()
            if row is None:
                return None
            job = _job(row)
            if job.status not in ACTIVE:
                await conn.execute("DELETE FROM batchserve_jobs WHERE id = %s", (job_id,))  # items: ON DELETE CASCADE
            return job

        return await self._tx(tx, BIG_DELETE_S)  # a job's items and results

    async def sweep(self, now: float) -> tuple[int, int]:
        async def tx(conn: AsyncConnection) -> tuple[int, int]:
            files = await conn.execute(
                "DELETE FROM batchserve_files WHERE (status = 'processed' AND expires_at IS NOT NULL "
                "AND expires_at <= %s) OR (status = 'uploading' AND created_at <= %s)",
                (now, now - ABANDONED_S),
            )
            jobs = await conn.execute(
                "DELETE FROM batchserve_jobs WHERE status NOT IN ('queued', 'running') AND expires_at IS NOT NULL "
                "AND expires_at <= %s",
                (now,),
            )
            return files.rowcount, jobs.rowcount

        return await self._tx(tx, BIG_DELETE_S)  # whatever expired since the last sweep

    async def cancel(self, tenant: str, job_id: str, now: float) -> Job | None:
        # Items first, then the job row: the order `record` takes its locks in, so the two never deadlock.
        async def tx(conn: AsyncConnection) -> Job | None:
            cur = await conn.execute(
                "SELECT status, openai FROM batchserve_jobs WHERE id = %s AND tenant = %s", (job_id, tenant)
            )
            row = await cur.fetchone()
            if row is None:
                return None
            if row[0] in ACTIVE:
                sizes = await self._end_pending(
                    conn,
                    job_id,
                    row[1] is not None,
                    "cancelled",
                    "CANCELLED",
                    "the job was cancelled before this item ran",
                    now,
                )
                await conn.execute(
                    "UPDATE batchserve_jobs SET status = 'cancelled', cancelled = cancelled + %s, finished_at = %s, "
                    "bytes = bytes + %s, error_bytes = error_bytes + %s "
                    "WHERE id = %s AND status IN ('queued', 'running')",
                    (sizes.count, now, sizes.stored, sizes.errors, job_id),
                )
            cur = await conn.execute(f"SELECT {JOB_COLUMNS} FROM batchserve_jobs WHERE id = %s", (job_id,))
            found = await cur.fetchone()
            return _job(found) if found is not None else None

        job = await self.get(tenant, job_id)  # how many items it may mark, for its bound (fewer by then, never more)
        if job is None:
            return None
        return await self._tx(tx, bound_for(rows=job.pending))

    async def active(self, models: list[str]) -> list[Job]:
        async def tx(conn: AsyncConnection) -> list[Job]:
            cur = await conn.execute(
                f"SELECT {JOB_COLUMNS} FROM batchserve_jobs WHERE status IN "
                f"('queued', 'running') AND model = ANY(%s) ORDER BY seq",
                (models,),
            )
            return [_job(r) for r in await cur.fetchall()]

        return await self._tx(tx)

    async def claim(self, job_id: str, limit: int, lease_s: float, now: float) -> list[tuple[int, str]]:
        async def tx(conn: AsyncConnection) -> list[tuple[int, str]]:
            # FOR UPDATE re-checks the lease on the newest row version, so an item another node leased and
            # committed while this statement ran is skipped, not leased twice. MATERIALIZED: the pick runs
            # once; as a subquery the planner may rescan it, and each rescan would lease `limit` more.
            cur = await conn.execute(
                f"WITH c AS MATERIALIZED (SELECT idx FROM batchserve_items WHERE job_id = %(job)s "
                f"    AND status = 'pending' AND (lease_until IS NULL OR lease_until <= clock_timestamp()) "
                f"    ORDER BY idx LIMIT %(limit)s FOR UPDATE SKIP LOCKED) "
                f"UPDATE batchserve_items AS i SET holder = %(holder)s, lease_until = {LEASE} "
                f"FROM c WHERE i.job_id = %(job)s AND i.idx = c.idx RETURNING i.idx, i.input",
                {"holder": self.holder, "lease_s": lease_s, "job": job_id, "limit": limit},
            )
            claimed = sorted((r[0], r[1]) for r in await cur.fetchall())
            if claimed:
                await conn.execute(
                    "UPDATE batchserve_jobs SET status = 'running', "
                    "started_at = COALESCE(started_at, %s) WHERE id = %s AND status = 'queued'",
                    (now, job_id),
                )
            return claimed

        return await self._tx(tx, bound_for(READ_BYTES, limit))  # the claimed items' inputs come back with it

    async def renew(self, job_id: str, indexes: list[int], lease_s: float) -> int:
        async def tx(conn: AsyncConnection) -> int:
            cur = await conn.execute(
                f"UPDATE batchserve_items SET lease_until = {LEASE} WHERE job_id = %(job)s AND idx = ANY(%(idx)s) "
                f"AND status = 'pending' AND holder = %(holder)s",
                {"lease_s": lease_s, "job": job_id, "idx": indexes, "holder": self.holder},
            )
            return cur.rowcount

        return await self._tx(tx, bound_for(rows=len(indexes)))

    async def release(self, job_id: str, indexes: list[int]) -> None:
        async def tx(conn: AsyncConnection) -> None:
            await conn.execute(
                "UPDATE batchserve_items SET lease_until = NULL WHERE job_id = %s "
                "AND idx = ANY(%s) AND status = 'pending' AND holder = %s",
                (job_id, indexes, self.holder),
            )

        await self._tx(tx, bound_for(rows=len(indexes)))

    async def record(self, outcomes: list[Outcome], now: float) -> list[Progress]:
        if not outcomes:
            return []
        by_job: dict[str, list[Outcome]] = {}
        for o in outcomes:
            by_job.setdefault(o.job_id, []).append(o)
        job_ids = sorted(by_job)  # job rows locked in one order on every node
        quota = self.limits.bounded

        async def tx(conn: AsyncConnection) -> list[Progress]:
            cur = await conn.execute("SELECT id, tenant, openai FROM batchserve_jobs WHERE id = ANY(%s)", (job_ids,))
            owners = {r[0]: (r[1], r[2] is not None) for r in await cur.fetchall()}
            any_openai = any(openai for _, openai in owners.values())  # only then are inputs read back
            if quota:  # tenant locks before any row lock, in one order: the order every writer takes them in
                for tenant in sorted({t for t, _ in owners.values()}):
                    await self._lock_tenant(conn, tenant)
            reasons: dict[str, str] = {}
            columns: tuple[list[Any], ...] = ([], [], [], [], [], [])
            for job_id in job_ids:
                tenant, _ = owners.get(job_id, ("", False))
                outs = by_job[job_id]
                try:
                    await self._check(
                        conn, tenant, sum(o.stored_bytes() for o in outs), f"the outputs of batch {job_id}"
                    )
                except StorageFull as full:  # the job fails whole, saying why; nothing more of it is kept
                    reasons[job_id] = full.message
                    outs = [Outcome(o.job_id, o.index, "failed", None, QUOTA_CODE, full.message) for o in outs]
                by_job[job_id] = outs
                for o in outs:
                    for column, value in zip(
                        columns, (o.job_id, o.index, o.status, _text(o.output), _text(o.error), _text(o.message))
                    ):
                        column.append(value)
            cur = await conn.execute(
                "UPDATE batchserve_items AS i SET status = o.status, output = o.output, error = o.error, "
                "message = o.message, writes = i.writes + 1, finished_at = %s, holder = %s, lease_until = NULL "
                "FROM unnest(%s::text[], %s::int[], %s::text[], %s::text[], %s::text[], %s::text[]) "
                "AS o(job_id, idx, status, output, error, message) "
                "WHERE i.job_id = o.job_id AND i.idx = o.idx AND i.status = 'pending' "
                f"RETURNING i.job_id, i.idx, i.status, {'i.input' if any_openai else 'NULL'}",
                (now, self.holder, *columns),
            )
            changed = await cur.fetchall()
            written: dict[str, Counter[str]] = {job_id: Counter() for job_id in job_ids}
            sizes = {job_id: Sizes() for job_id in job_ids}
            found = {(o.job_id, o.index): o for outs in by_job.values() for o in outs}

            def measure() -> None:
                for job_id, idx, status, text in changed:
                    written[job_id][status] += 1
                    o = found[(job_id, idx)]
                    sizes[job_id].stored += o.stored_bytes()
                    if owners.get(job_id, ("", False))[1]:
                        sizes[job_id].add(line_size(job_id, ItemRow(idx, status, o.output, o.error, o.message, text)))

            await asyncio.to_thread(measure)  # parses each line's custom_id: off the event loop
            progress = []
            for job_id in job_ids:
                counts, size, reason = written[job_id], sizes[job_id], reasons.get(job_id)
                if reason is not None:
                    rest = await self._end_pending(
                        conn, job_id, owners.get(job_id, ("", False))[1], "failed", QUOTA_CODE, reason, now
                    )
                    counts["failed"] += rest.count
                    size.merge(rest)
                await conn.execute(
                    "UPDATE batchserve_jobs SET completed = completed + %s, failed = failed + %s, "
                    "bytes = bytes + %s, output_bytes = output_bytes + %s, "
                    "error_bytes = error_bytes + %s, reason = COALESCE(reason, %s) WHERE id = %s",
                    (counts["completed"], counts["failed"], size.stored, size.output, size.errors, reason, job_id),
                )
                cur = await conn.execute(
                    f"UPDATE batchserve_jobs SET status = CASE WHEN status NOT IN ('queued', 'running') "
                    f"THEN status WHEN completed + failed + cancelled < total THEN status "
                    f"WHEN reason IS NOT NULL THEN 'failed' "
                    f"WHEN completed > 0 THEN 'completed' ELSE 'failed' END, "
                    f"finished_at = CASE WHEN status IN ('queued', 'running') AND completed + failed + cancelled "
                    f">= total THEN %s ELSE finished_at END WHERE id = %s RETURNING {JOB_COLUMNS}",
                    (now, job_id),
                )
                row = await cur.fetchone()
                if row is not None:
                    progress.append(Progress.of(_job(row)))
            return progress

        written = sum(len(o.output or "") + len(o.error or "") + len(o.message or "") for o in outcomes)
        return await self._tx(tx, bound_for(written, len(outcomes)))

    async def close(self) -> None:
        await self._pool.close()
        if self._closing:  # an old pool closing under a stopped server gives up on its own, in a second
            await asyncio.gather(*self._closing, return_exceptions=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
