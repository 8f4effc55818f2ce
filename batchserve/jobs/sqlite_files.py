"""One SQLite job store's thread and transactions, its files and the bytes each tenant keeps (`SQLiteStore`
adds the schema, the file's lock and the jobs; its module docstring says why one thread)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import sqlite3
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Concatenate, ParamSpec, TypeVar

from batchserve.jobs.files import FILE_COLUMNS, FileLimitReached, StorageLimits, StoredFile, listing
from batchserve.jobs.store import SQLITE

T = TypeVar("T")
P = ParamSpec("P")
S = TypeVar("S", bound="SQLiteFileStore")


def on_store_thread(
    fn: Callable[Concatenate[S, P], T],
) -> Callable[Concatenate[S, P], Coroutine[Any, Any, T]]:
    """A `JobStore` method from the event loop: `fn` runs on the store's one thread (see the module docstring)."""

    async def on_loop(store: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await store._run(functools.partial(fn, store, *args, **kwargs))

    return on_loop


class SQLiteFileStore:
    """Files and quotas on the store's one thread; build the whole store with `await SQLiteStore.open(path)`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._exec = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jobs-db")
        self._conn: sqlite3.Connection | None = None
        self._lock_fd: int | None = None
        self.limits = StorageLimits()

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._exec, fn, *args)

    @property
    def _db(self) -> sqlite3.Connection:
        assert self._conn is not None, "the store is closed"
        return self._conn

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        conn = self._db
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    @staticmethod
    def _usage(c: sqlite3.Connection, tenant: str, with_total: bool) -> tuple[int, int]:
        """(bytes the tenant keeps, bytes the store keeps in all, or 0 unless `with_total`)."""
        mine, total = c.execute(SQLITE.usage_total if with_total else SQLITE.usage, (tenant, tenant)).fetchone()
        return mine, total

    def _check(self, c: sqlite3.Connection, tenant: str, adding: int, what: str) -> None:
        if self.limits.bounded:
            self.limits.check(tenant, *self._usage(c, tenant, bool(self.limits.total_bytes)), adding, what)

    @on_store_thread
    def usage(self, tenant: str) -> tuple[int, int]:
        return self._usage(self._db, tenant, True)

    @on_store_thread
    def begin_file(self, meta: StoredFile, max_count: int) -> None:
        with self._tx() as c:
            held = c.execute("SELECT count(*) FROM files WHERE tenant = ?", (meta.tenant,)).fetchone()[0]
            if held >= max_count:
                raise FileLimitReached(meta.tenant)
            c.execute(
                SQLITE.new_file, (meta.id, meta.tenant, meta.filename, meta.purpose, meta.created_at, meta.expires_at)
            )

    @on_store_thread
    def put_chunk(self, tenant: str, file_id: str, seq: int, data: bytes | bytearray) -> None:
        with self._tx() as c:
            self._check(c, tenant, len(data), "this upload")
            c.execute("INSERT INTO file_chunks (file_id, seq, data) VALUES (?, ?, ?)", (file_id, seq, data))
            c.execute("UPDATE files SET bytes = bytes + ? WHERE id = ?", (len(data), file_id))

    @on_store_thread
    def finish_file(self, meta: StoredFile) -> None:
        with self._tx() as c:
            c.execute(SQLITE.finish_file, (meta.filename, meta.purpose, meta.bytes, meta.expires_at, meta.id))

    @on_store_thread
    def abort_file(self, file_id: str) -> None:
        with self._tx() as c:
            self._drop_file(c, file_id)
        self._vacuum()  # the chunks stored so far give their pages back, as a delete's do

    @staticmethod
    def _drop_file(c: sqlite3.Connection, file_id: str) -> None:
        c.execute("DELETE FROM file_chunks WHERE file_id = ?", (file_id,))
        c.execute("DELETE FROM files WHERE id = ?", (file_id,))

    @on_store_thread
    def get_file(self, tenant: str, file_id: str) -> StoredFile | None:
        row = self._db.execute(SQLITE.get_file, (file_id, tenant)).fetchone()
        return StoredFile(*row) if row is not None else None

    def _chunk(self, file_id: str, after: int) -> tuple[int, bytes] | None:
        row = self._db.execute(SQLITE.next_chunk, (file_id, after)).fetchone()
        return (row[0], bytes(row[1])) if row is not None else None

    @on_store_thread
    def list_files(self, tenant: str, limit: int, after: str | None, purpose: str | None) -> list[StoredFile]:
        sql, args = listing("files", FILE_COLUMNS, "?", tenant, limit, after, status="processed", purpose=purpose)
        return [StoredFile(*r) for r in self._db.execute(sql, args)]

    @on_store_thread
    def delete_file(self, tenant: str, file_id: str) -> bool:
        with self._tx() as c:
            found = c.execute(SQLITE.get_file, (file_id, tenant)).fetchone()
            if found is not None:
                self._drop_file(c, file_id)
        if found is not None:
            self._vacuum()
        return found is not None

    def _vacuum(self) -> None:
        """Give freed pages back to the file system (a file made with auto_vacuum; else a no-op) and fold the
        write-ahead log back, so deleting shrinks what is on disk, not only what is counted."""
        # executescript steps the pragma to its end (one `execute` step frees a single page)
        self._db.executescript("PRAGMA incremental_vacuum;")
        self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def file_chunks(self, tenant: str, file_id: str) -> AsyncIterator[bytes]:
        if await self.get_file(tenant, file_id) is None:
            return
        seq = -1
        while (found := await self._run(self._chunk, file_id, seq)) is not None:
            seq, data = found
            yield data

    async def close(self) -> None:
        await self._run(self._close)
        self._exec.shutdown(wait=True)
