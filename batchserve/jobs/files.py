"""OpenAI's Files, as the job store keeps them: the storage contract (`FileStore`), the file object, and the
byte accounting every store keeps.

An uploaded batch input file lives in the job store beside the jobs (SQLite: the same file; PostgreSQL: the
same database), so a node that never saw the upload can still read it, and a job's input survives a restart
with the job. Its bytes are kept in chunks (`CHUNK_BYTES` each, a `file_chunks` table), written as the upload
streams in and read back chunk by chunk, so no upload, batch creation or download holds a whole file.

Storage is accounted in bytes per tenant (`StorageLimits`): its files (uploads in progress included) and its jobs'
inputs, outputs and errors. `--tenant-storage-mb` bounds a tenant, `--storage-max-mb` the whole store; each store
checks them in the transaction that adds the bytes, so concurrent writers cannot pass them together. Files and
finished jobs expire (`expires_at`); a sweep deletes them, and deleting frees the bytes at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol
from collections.abc import AsyncIterator

CHUNK_BYTES = 1 << 20  # one stored chunk of a file: what an upload buffers, and a download reads, at once
FILE_COLUMNS = "id, tenant, filename, purpose, bytes, created_at, expires_at"  # `StoredFile`'s, in both stores


class FileLimitReached(Exception):
    """The tenant already holds the most files allowed (`--files-max-count`): nothing was stored."""


class StorageFull(Exception):
    """Storing these bytes would pass the tenant's byte quota (`server` False) or the server's total (True):
    nothing was stored. The message says which, how much is kept, and how to free it."""

    def __init__(self, message: str, server: bool) -> None:
        super().__init__(message)
        self.message = message
        self.server = server


@dataclass(frozen=True, slots=True)
class StorageLimits:
    """Byte bounds of what a store keeps (0 = none): each tenant's (`tenants` names those with their own, from
    the config file's [[keys]] storage_mb), and the store's in all."""

    tenant_bytes: int = 0
    total_bytes: int = 0
    tenants: dict[str, int] = field(default_factory=dict)

    @property
    def bounded(self) -> bool:
        return bool(self.tenant_bytes or self.total_bytes or self.tenants)

    def check(self, tenant: str, tenant_used: int, total_used: int, adding: int, what: str) -> None:
        """StorageFull when `adding` more bytes would pass a bound (`*_used`: what is kept now)."""
        if adding <= 0:
            return
        quota = self.tenants.get(tenant, self.tenant_bytes)
        if quota and tenant_used + adding > quota:
            raise StorageFull(
                f"{what} would put you over your storage quota of {mb(quota)} "
                f"({'your key' + chr(39) + 's storage_mb' if tenant in self.tenants else '--tenant-storage-mb'}): "
                f"you keep {mb(tenant_used)} in files, batch inputs and outputs; delete files "
                f"(DELETE /v1/files/{{id}}) or finished batches (DELETE /v1/batches/{{id}}) you are done with",
                server=False,
            )
        if self.total_bytes and total_used + adding > self.total_bytes:
            raise StorageFull(
                f"{what} would pass the server's storage limit of {mb(self.total_bytes)} "
                f"(--storage-max-mb); try again once older files and batches expire",
                server=True,
            )


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


@dataclass(slots=True)
class StoredFile:
    id: str
    tenant: str
    filename: str
    purpose: str
    bytes: int
    created_at: float
    expires_at: float | None = None

    def public(self) -> dict[str, Any]:
        """OpenAI's file object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": int(self.created_at),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": int(self.expires_at) if self.expires_at is not None else None,
            "status_details": None,
        }


class FileStore(Protocol):
    limits: StorageLimits

    async def begin_file(self, meta: StoredFile, max_count: int) -> None:
        """Start an upload (invisible until `finish_file`); FileLimitReached when its tenant already keeps
        `max_count` files (uploads in progress included)."""

    async def put_chunk(self, tenant: str, file_id: str, seq: int, data: bytes | bytearray) -> None:
        """Store the upload's next chunk; StorageFull when its bytes would pass a bound (the caller then
        `abort_file`s)."""

    async def finish_file(self, meta: StoredFile) -> None:
        """Make the upload a visible file (`meta.bytes`: its size)."""

    async def abort_file(self, file_id: str) -> None:
        """Drop an upload that did not finish, with its chunks."""

    async def get_file(self, tenant: str, file_id: str) -> StoredFile | None: ...

    def file_chunks(self, tenant: str, file_id: str) -> AsyncIterator[bytes]:
        """The file's bytes, chunk by chunk (nothing for an unknown file or another tenant's)."""

    async def list_files(self, tenant: str, limit: int, after: str | None, purpose: str | None) -> list[StoredFile]:
        """The tenant's files, newest first, starting after the file `after` (a cursor)."""

    async def delete_file(self, tenant: str, file_id: str) -> bool: ...

    async def usage(self, tenant: str) -> tuple[int, int]:
        """(bytes the tenant keeps, bytes the store keeps in all)."""


class LineTooLong(ValueError):
    """A line of an input file is longer than the splitter's bound (`LineSplitter.max_line`)."""


class LineSplitter:
    """A file's non-blank lines, stripped, from its chunks as they come: shared by the checking pass and the stores'
    copy into job items, so the two cannot disagree about where a line ends. A line longer than `max_line` bytes
    raises LineTooLong (it is never gathered whole)."""

    __slots__ = ("max_line", "_parts", "_held")

    def __init__(self, max_line: int = 1 << 62) -> None:
        self.max_line = max_line
        self._parts: list[bytes] = []  # the line begun in earlier chunks
        self._held = 0

    def feed(self, chunk: bytes) -> list[bytes]:
        if b"\n" not in chunk:
            self._hold(chunk)
            return []
        pieces = chunk.split(b"\n")
        if self._parts:
            self._hold(pieces[0])
            pieces[0] = b"".join(self._parts)
            self._parts, self._held = [], 0
        last = pieces.pop()
        out = []
        for p in pieces:
            if len(p) > self.max_line:
                raise LineTooLong(len(p))
            if line := p.strip():
                out.append(line)
        self._hold(last)
        return out

    def _hold(self, piece: bytes) -> None:
        if piece:
            self._held += len(piece)
            if self._held > self.max_line:
                raise LineTooLong(self._held)
            self._parts.append(piece)

    def end(self) -> list[bytes]:
        line = b"".join(self._parts).strip()
        self._parts, self._held = [], 0
        return [line] if line else []


def listing(
    table: str, columns: str, mark: str, tenant: str, limit: int, after: str | None, **equal: str | None
) -> tuple[str, list[object]]:
    """The SELECT of a tenant's rows newest first, those listed after the row `after` (a cursor), with these
    column values (one given as None: any), in a dialect's parameter mark (`%s`, `?`)."""
    where, args = f"tenant = {mark}", [tenant]
    for column, value in equal.items():
        if value is not None:
            where, args = where + f" AND {column} = {mark}", [*args, value]
    if after is not None:
        where += f" AND seq < (SELECT seq FROM {table} WHERE id = {mark} AND tenant = {mark})"
        args += [after, tenant]
    return f"SELECT {columns} FROM {table} WHERE {where} ORDER BY seq DESC LIMIT {mark}", [*args, limit]
