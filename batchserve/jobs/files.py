"""OpenAI's Files, as the job store keeps them: the storage contract (`FileStore`) and the file object.

An uploaded batch input file lives in the job store beside the jobs (SQLite: the same file; PostgreSQL: the
same database), so a node that never saw the upload can still read it, and a job's input survives a restart
with the job. Its size and each tenant's number of files are bounded (`--files-max-bytes`,
`--files-max-count`): the count is checked in the same transaction as the insert, so concurrent uploads cannot
pass it together. A job's output and error files are not stored: they are rendered from its items when read
(`openai_batch.py`), so they cannot drift from `GET /v1/batches/{id}/results` and cost no space.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class FileLimitReached(Exception):
    """The tenant already holds the most files allowed (`--files-max-count`): nothing was stored."""


@dataclass(slots=True)
class StoredFile:
    id: str
    tenant: str
    filename: str
    purpose: str
    bytes: int
    created_at: float

    def public(self) -> dict[str, Any]:
        """OpenAI's file object."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": int(self.created_at),
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": None, "status_details": None}


class FileStore(Protocol):
    async def put_file(self, meta: StoredFile, content: bytes, max_count: int) -> None:
        """Store the file; FileLimitReached when its tenant already has `max_count` files."""
        ...

    async def get_file(self, tenant: str, file_id: str) -> StoredFile | None: ...

    async def file_content(self, tenant: str, file_id: str) -> bytes | None: ...

    async def list_files(self, tenant: str, limit: int, after: str | None, purpose: str | None) -> list[StoredFile]:
        """The tenant's files, newest first, starting after the file `after` (a cursor)."""
        ...

    async def delete_file(self, tenant: str, file_id: str) -> bool: ...
