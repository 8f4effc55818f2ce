"""The PostgreSQL job store's files and the bytes each tenant keeps: uploads stored a chunk at a time, and the
quota every write that adds bytes checks first (`PostgresStore` adds the jobs)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from psycopg import AsyncConnection

from batchserve.jobs.files import FILE_COLUMNS, FileLimitReached, StoredFile, StorageLimits, listing
from batchserve.jobs.pg_calls import PgCalls, bound_for
from batchserve.jobs.store import POSTGRES

BIG_DELETE_S = bound_for(256 << 20, 50_000)  # deletes of a whole file or job: they free what uploads and batches kept


class PgFileStore:
    """Files and quotas on PostgreSQL, over `calls`."""

    def __init__(self, calls: PgCalls) -> None:
        self.calls = calls
        self.limits = StorageLimits()

    # -- bytes kept ------------------------------------------------------------------------------------------
    async def _check(self, conn: AsyncConnection, tenant: str, adding: int, what: str) -> None:
        """StorageFull when `adding` bytes would pass a bound. A tenant's writers are serialized by an advisory lock
        (taken first in every transaction that adds bytes, so they never deadlock), so two nodes cannot both pass
        its quota; the server total is checked without one (concurrent writers may pass it by what they add)."""
        if not self.limits.bounded or adding <= 0:
            return
        await self._lock_tenant(conn, tenant)
        self.limits.check(tenant, *await self._usage(conn, tenant, bool(self.limits.total_bytes)), adding, what)

    async def _lock_tenant(self, conn: AsyncConnection, tenant: str) -> None:
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", ("batchserve-storage/" + tenant,))

    @staticmethod
    async def _usage(conn: AsyncConnection, tenant: str, with_total: bool) -> tuple[int, int]:
        """(bytes the tenant keeps, bytes the store keeps in all, or 0 unless `with_total`)."""
        cur = await conn.execute(POSTGRES.usage_total if with_total else POSTGRES.usage, (tenant, tenant))
        row = await cur.fetchone()
        assert row is not None  # sums: always one row
        return int(row[0]), int(row[1])

    async def usage(self, tenant: str) -> tuple[int, int]:
        return await self.calls.tx(lambda conn: self._usage(conn, tenant, True))

    async def begin_file(self, meta: StoredFile, max_count: int) -> None:
        async def tx(conn: AsyncConnection) -> None:
            # Serialize one tenant's uploads, so two at once cannot both pass the count.
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", ("batchserve-files/" + meta.tenant,))
            cur = await conn.execute("SELECT count(*) FROM batchserve_files WHERE tenant = %s", (meta.tenant,))
            row = await cur.fetchone()
            if row is not None and row[0] >= max_count:
                raise FileLimitReached(meta.tenant)
            await conn.execute(
                POSTGRES.new_file, (meta.id, meta.tenant, meta.filename, meta.purpose, meta.created_at, meta.expires_at)
            )

        await self.calls.tx(tx)

    async def put_chunk(self, tenant: str, file_id: str, seq: int, data: bytes | bytearray) -> None:
        async def tx(conn: AsyncConnection) -> None:
            await self._check(conn, tenant, len(data), "this upload")
            await conn.execute(
                "INSERT INTO batchserve_file_chunks (file_id, seq, data) VALUES (%s, %s, %s)", (file_id, seq, data)
            )
            await conn.execute("UPDATE batchserve_files SET bytes = bytes + %s WHERE id = %s", (len(data), file_id))

        await self.calls.tx(tx, bound_for(len(data)))

    async def finish_file(self, meta: StoredFile) -> None:
        await self.calls.change(
            POSTGRES.finish_file, (meta.filename, meta.purpose, meta.bytes, meta.expires_at, meta.id)
        )

    async def abort_file(self, file_id: str) -> None:
        # chunks: ON DELETE CASCADE (the bound: the chunks stored so far)
        await self.calls.change("DELETE FROM batchserve_files WHERE id = %s", (file_id,), BIG_DELETE_S)

    async def get_file(self, tenant: str, file_id: str) -> StoredFile | None:
        rows = await self.calls.rows(POSTGRES.get_file, (file_id, tenant))
        return StoredFile(*rows[0]) if rows else None

    async def file_chunks(self, tenant: str, file_id: str) -> AsyncIterator[bytes]:
        if await self.get_file(tenant, file_id) is None:
            return
        seq = -1
        # one chunk (1 MB) a call
        while rows := await self.calls.rows(POSTGRES.next_chunk, (file_id, seq), bound_for(2 << 20)):
            seq, data = rows[0]
            yield bytes(data)

    async def list_files(self, tenant: str, limit: int, after: str | None, purpose: str | None) -> list[StoredFile]:
        sql, args = listing(
            "batchserve_files", FILE_COLUMNS, "%s", tenant, limit, after, status="processed", purpose=purpose
        )
        return [StoredFile(*r) for r in await self.calls.rows(sql, args)]

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        deleted = await self.calls.change(
            "DELETE FROM batchserve_files WHERE id = %s AND tenant = %s AND status = 'processed'",
            (file_id, tenant),
            BIG_DELETE_S,  # a file's chunks: up to --files-max-bytes
        )
        return deleted > 0

    async def close(self) -> None:
        await self.calls.close()
