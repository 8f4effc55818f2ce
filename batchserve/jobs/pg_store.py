"""`JobStore` on PostgreSQL: one job store shared by every node (`--jobs-db postgresql://...`).

Any node accepts a job; any node runs its items. Why each part is as it is:
- `create` is one transaction: the job row with `ON CONFLICT (tenant, idempotency_key) DO NOTHING`, then the
  items by `COPY`. A second node inserting the same key waits for the first to commit and reads its job back, so
  a key holds across nodes.
- `claim` is `UPDATE ... FROM (SELECT ... FOR UPDATE SKIP LOCKED)`, skipping rows another node is claiming at that
  instant. Lease times are the database's clock (`clock_timestamp()`), never a node's, so a node with a skewed
  clock can neither keep nor steal leases.
- `record` updates an item only while it is still `pending` (and a trigger refuses any second change of a final
  item), so an item run twice (a lease that ran out under a slow node) is recorded once.
Tables are prefixed `batchserve_` so the database can be shared with other applications; the schema is created at
open, under an advisory lock so nodes starting together do not race. How each call reaches the database is
`pg_calls.py`'s.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from collections.abc import Iterable
from typing import Any

from psycopg import AsyncConnection

from batchserve.jobs.files import LineSplitter, StorageFull, listing
from batchserve.jobs.openai_batch import Sizes
from batchserve.jobs.pg_calls import READ_BYTES, PgCalls, bound_for
from batchserve.jobs.pg_files import BIG_DELETE_S, PgFileStore
from batchserve.jobs.store import (
    JOB_COLUMNS,
    JOB_TABLE_COLUMNS,
    POSTGRES,
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
    UnstorableInput,
    whole_bytes,
)


INSERT_JOB = POSTGRES.new_job + " ON CONFLICT (tenant, idempotency_key) DO NOTHING RETURNING seq"
SCHEMA_LOCK = 0x6261746368  # pg_advisory_xact_lock key taken while the schema is created

SCHEMA = (
    """
CREATE TABLE IF NOT EXISTS batchserve_jobs (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"""
    + JOB_TABLE_COLUMNS
    + """
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
)

ABANDONED_S = 3600.0  # an upload still `uploading` this long after it began was abandoned (its node died)
LEASE = "clock_timestamp() + %(lease_s)s * interval '1 second'"
NUL_FREE = "\ufffd"  # PostgreSQL text cannot hold NUL: an output carrying one is stored with this instead


def _text(value: str | None) -> str | None:
    return value.replace("\x00", NUL_FREE) if value is not None and "\x00" in value else value


async def book_job(
    conn: AsyncConnection, job_id: str, size: Sizes, reason: str | None, openai: bool, now: float
) -> Progress | None:
    """A job's counters and bytes moved by what was just recorded of it (and, failed for its quota, the rest of
    its items ended), then its status once every item is final."""
    if reason is not None:
        size.merge(await end_pending(conn, job_id, openai, "failed", QUOTA_CODE, reason, now))
    await conn.execute(POSTGRES.book_job, (*size.grows(), reason, job_id))
    cur = await conn.execute(POSTGRES.finish_job, (now, job_id))
    row = await cur.fetchone()
    return Progress.of(Job.of_row(row)) if row is not None else None


async def end_pending(
    conn: AsyncConnection, job_id: str, openai: bool, status: str, error: str, message: str, now: float
) -> Sizes:
    """Make every pending item of the job final with this error; what that adds."""
    cur = await conn.execute(
        "UPDATE batchserve_items SET status = %s, error = %s, message = %s, finished_at = %s, lease_until = NULL "
        f"WHERE job_id = %s AND status = 'pending' RETURNING idx, {'input' if openai else 'NULL'}",
        (status, error, message, now, job_id),
    )
    rows = await cur.fetchall()
    if openai and rows:  # each line's custom_id is parsed: off the event loop
        return await asyncio.to_thread(Sizes.ended, job_id, rows, status, error, message, openai)
    return Sizes.ended(job_id, rows, status, error, message, False)


async def copy_items(conn: AsyncConnection, job_id: str, start: int, texts: Iterable[str]) -> None:
    """The job's items from index `start`, by COPY."""
    async with conn.cursor() as items:
        async with items.copy("COPY batchserve_items (job_id, idx, input) FROM STDIN") as copy:
            for i, text in enumerate(texts, start):
                await copy.write_row((job_id, i, text))


class PostgresStore(PgFileStore):
    """See the module docstring; build it with `await PostgresStore.open(url)`."""

    def __init__(self, calls: PgCalls) -> None:
        super().__init__(calls)
        # Who holds a lease: readable in the table, so an operator can tell which node runs (or ran) an item.
        self.holder = f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(3)}"

    @classmethod
    async def open(cls, url: str) -> PostgresStore:
        return cls(await PgCalls.open(url, cls._create_schema))

    @staticmethod
    async def _create_schema(conn: AsyncConnection) -> None:
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
        await conn.execute(SCHEMA)

    # -- the JobStore interface ------------------------------------------------------------------------------
    async def create(self, job: NewJob) -> tuple[Job, bool]:
        for i, text in enumerate(job.inputs):
            if "\x00" in text:
                raise UnstorableInput(i, "contains a NUL character (\\u0000), which the job store cannot hold")
        adding = job.stored_bytes()

        async def tx(conn: AsyncConnection) -> tuple[Job, bool]:
            if self.limits.bounded:
                await self._lock_tenant(conn, job.tenant)
            cur = await conn.execute(INSERT_JOB, job.row(0))
            if await cur.fetchone() is None:  # the key was used before (perhaps on another node just now)
                cur = await conn.execute(POSTGRES.keyed_job, (job.tenant, job.idempotency_key))
                row = await cur.fetchone()
                assert row is not None
                return job.repeat(row)
            await self._check(conn, job.tenant, adding, "this batch's inputs")
            await conn.execute("UPDATE batchserve_jobs SET bytes = %s WHERE id = %s", (adding, job.id))
            if job.source_file is None:
                await copy_items(conn, job.id, 0, job.inputs)
            else:
                await self._copy_lines(conn, job)
            return job.queued(adding), True

        return await self.calls.tx(tx, bound_for(adding, job.count()))  # a file's copy: its bytes and lines

    async def _copy_lines(self, conn: AsyncConnection, job: NewJob) -> None:
        """The file's lines become the job's items, one stored chunk at a time (never the whole file): each
        chunk read, split on a worker thread, and its lines copied in, in the job's transaction."""
        cur = await conn.execute(POSTGRES.file_owner, (job.source_file,))
        owner = await cur.fetchone()
        if owner is None or owner[0] != job.tenant:
            raise FileGone(job.source_file or "")
        split = LineSplitter()
        index = 0
        row: tuple[Any, ...] | None = (-1, b"")  # the last chunk read (seq, data); None past the file's end
        while row is not None:
            cur = await conn.execute(POSTGRES.next_chunk, (job.source_file, row[0]))
            row = await cur.fetchone()
            lines = split.end() if row is None else await asyncio.to_thread(split.feed, bytes(row[1]))
            if lines:
                await copy_items(conn, job.id, index, (line.decode() for line in lines))
                index += len(lines)
        if index != job.total:
            raise FileGone(job.source_file or "")

    async def get(self, tenant: str, job_id: str) -> Job | None:
        rows = await self.calls.rows(POSTGRES.get_job, (job_id, tenant))
        return Job.of_row(rows[0]) if rows else None

    async def list_jobs(self, tenant: str, limit: int, after: str | None) -> list[Job]:
        rows = await self.calls.rows(*listing("batchserve_jobs", JOB_COLUMNS, "%s", tenant, limit, after))
        return [Job.of_row(r) for r in rows]

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
        rows = await self.calls.rows(
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
            {"job": job_id, "after": after_index, "limit": limit, "whole": whole_bytes(max_bytes), "max": max_bytes},
            bound_for(READ_BYTES, limit),  # a held input's custom_id is parsed there
        )
        return [ItemRow(*r) for r in rows]

    async def output_piece(self, job_id: str, index: int, start: int, size: int) -> bytes | None:
        rows = await self.calls.rows(
            "SELECT substring(convert_to(COALESCE(output, ''), 'UTF8') FROM %s FOR %s) FROM batchserve_items "
            "WHERE job_id = %s AND idx = %s",
            (start + 1, size, job_id, index),
            bound_for(READ_BYTES),  # the whole output is decompressed for each piece
        )
        return bytes(rows[0][0]) if rows else None

    async def delete_job(self, tenant: str, job_id: str) -> Job | None:
        async def tx(conn: AsyncConnection) -> Job | None:
            cur = await conn.execute(POSTGRES.get_job, (job_id, tenant))
            row = await cur.fetchone()
            if row is None:
                return None
            job = Job.of_row(row)
            if job.status not in ACTIVE:
                await conn.execute("DELETE FROM batchserve_jobs WHERE id = %s", (job_id,))  # items: ON DELETE CASCADE
            return job

        return await self.calls.tx(tx, BIG_DELETE_S)  # a job's items and results

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

        return await self.calls.tx(tx, BIG_DELETE_S)  # whatever expired since the last sweep

    async def cancel(self, tenant: str, job_id: str, now: float) -> Job | None:
        # Items first, then the job row: the order `record` takes its locks in, so the two never deadlock.
        async def tx(conn: AsyncConnection) -> Job | None:
            cur = await conn.execute(POSTGRES.job_state, (job_id, tenant))
            row = await cur.fetchone()
            if row is None:
                return None
            if row[0] in ACTIVE:
                sizes = await end_pending(conn, job_id, row[1] is not None, *CANCELLED, now)
                await conn.execute(
                    POSTGRES.cancel_job, (sizes.counts["cancelled"], now, sizes.stored, sizes.errors, job_id)
                )
            cur = await conn.execute(POSTGRES.get_job, (job_id, tenant))
            found = await cur.fetchone()
            return Job.of_row(found) if found is not None else None

        job = await self.get(tenant, job_id)  # how many items it may mark, for its bound (fewer by then, never more)
        if job is None:
            return None
        return await self.calls.tx(tx, bound_for(rows=job.pending))

    async def active(self, models: list[str]) -> list[Job]:
        rows = await self.calls.rows(
            f"SELECT {JOB_COLUMNS} FROM batchserve_jobs WHERE status IN "
            f"('queued', 'running') AND model = ANY(%s) ORDER BY seq",
            (models,),
        )
        return [Job.of_row(r) for r in rows]

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
                await conn.execute(POSTGRES.job_running, (now, job_id))
            return claimed

        return await self.calls.tx(tx, bound_for(READ_BYTES, limit))  # the claimed items' inputs come back with it

    async def renew(self, job_id: str, indexes: list[int], lease_s: float) -> int:
        return await self.calls.change(
            f"UPDATE batchserve_items SET lease_until = {LEASE} WHERE job_id = %(job)s AND idx = ANY(%(idx)s) "
            f"AND status = 'pending' AND holder = %(holder)s",
            {"lease_s": lease_s, "job": job_id, "idx": indexes, "holder": self.holder},
            bound_for(rows=len(indexes)),
        )

    async def release(self, job_id: str, indexes: list[int]) -> None:
        await self.calls.change(
            "UPDATE batchserve_items SET lease_until = NULL WHERE job_id = %s "
            "AND idx = ANY(%s) AND status = 'pending' AND holder = %s",
            (job_id, indexes, self.holder),
            bound_for(rows=len(indexes)),
        )

    async def record(self, outcomes: list[Outcome], now: float) -> list[Progress]:
        if not outcomes:
            return []
        by_job: dict[str, list[Outcome]] = {}
        for o in outcomes:
            by_job.setdefault(o.job_id, []).append(o)
        job_ids = sorted(by_job)  # job rows locked in one order on every node

        async def tx(conn: AsyncConnection) -> list[Progress]:
            cur = await conn.execute("SELECT id, tenant, openai FROM batchserve_jobs WHERE id = ANY(%s)", (job_ids,))
            owners = {r[0]: (r[1], r[2] is not None) for r in await cur.fetchall()}
            openai = {job_id: owners.get(job_id, ("", False))[1] for job_id in job_ids}  # only then are inputs read
            # Tenant locks before any row lock, in one order: the order every writer takes them in.
            if self.limits.bounded:
                for tenant in sorted({t for t, _ in owners.values()}):
                    await self._lock_tenant(conn, tenant)
            reasons: dict[str, str] = {}
            for job_id in job_ids:
                outs, (tenant, _) = by_job[job_id], owners.get(job_id, ("", False))
                try:
                    await self._check(
                        conn, tenant, sum(o.stored_bytes() for o in outs), f"the outputs of batch {job_id}"
                    )
                except StorageFull as full:  # the job fails whole, saying why; nothing more of it is kept
                    reasons[job_id] = full.message
                    by_job[job_id] = [o.over_quota(full.message) for o in outs]
            rows = [
                (o.job_id, o.index, o.status, _text(o.output), _text(o.error), _text(o.message))
                for job_id in job_ids
                for o in by_job[job_id]
            ]
            columns = [list(column) for column in zip(*rows)]  # one array per column
            cur = await conn.execute(
                "UPDATE batchserve_items AS i SET status = o.status, output = o.output, error = o.error, "
                "message = o.message, writes = i.writes + 1, finished_at = %s, holder = %s, lease_until = NULL "
                "FROM unnest(%s::text[], %s::int[], %s::text[], %s::text[], %s::text[], %s::text[]) "
                "AS o(job_id, idx, status, output, error, message) "
                "WHERE i.job_id = o.job_id AND i.idx = o.idx AND i.status = 'pending' "
                f"RETURNING i.job_id, i.idx, i.status, {'i.input' if any(openai.values()) else 'NULL'}",
                (now, self.holder, *columns),
            )
            changed = await cur.fetchall()
            sizes = {job_id: Sizes() for job_id in job_ids}
            found = {(o.job_id, o.index): o for outs in by_job.values() for o in outs}

            def measure() -> None:
                for job_id, idx, _, text in changed:
                    o = found[(job_id, idx)]
                    sizes[job_id].add(o, o.stored_bytes(), text if openai[job_id] else None)

            await asyncio.to_thread(measure)  # parses each line's custom_id: off the event loop
            progress = []
            for job_id in job_ids:
                done = await book_job(conn, job_id, sizes[job_id], reasons.get(job_id), openai[job_id], now)
                if done is not None:
                    progress.append(done)
            return progress

        written = sum(len(o.output or "") + len(o.error or "") + len(o.message or "") for o in outcomes)
        return await self.calls.tx(tx, bound_for(written, len(outcomes)))
