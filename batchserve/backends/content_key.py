"""A file's content key: the SHA-256 of its bytes, so a cache keyed by it survives what changes a file's path
and mtime but not its bytes (a fresh virtualenv installs the same weights again, with a new mtime). Hashing a
weights file costs a second or so of a start; the digest is kept in a small sidecar (`DIGESTS`, in the cache
folder that uses it) keyed by the file's real path, size and mtime, so later starts read it instead. A file
rewritten in place keeps its path but not its (size, mtime): it is hashed again."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile

log = logging.getLogger("batchserve.content_key")

DIGESTS = ".content-digests.json"  # in the memo folder: {real path: {"size", "mtime_ns", "sha256"}}


def sha256_of(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_digest(path: str, memo_dir: str) -> str:
    """The hex SHA-256 of the file's bytes: from the sidecar in `memo_dir` when it has this file at its size
    and mtime, else hashed now and kept there (a sidecar that cannot be read or written only costs the hash)."""
    real = os.path.realpath(path)
    stat = os.stat(real)
    memo_path = os.path.join(memo_dir, DIGESTS)
    memo = _read(memo_path)
    seen = memo.get(real)
    if isinstance(seen, dict) and seen.get("size") == stat.st_size and seen.get("mtime_ns") == stat.st_mtime_ns:
        known = seen.get("sha256")
        if isinstance(known, str) and len(known) == 64:
            return known
    digest = sha256_of(real)
    memo[real] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
    _write(memo_path, memo)
    return digest


def _read(memo_path: str) -> dict[str, object]:
    try:
        with open(memo_path, "rb") as f:
            memo = json.load(f)
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def _write(memo_path: str, memo: dict[str, object]) -> None:
    """Atomically (another process reading it sees the old sidecar or the new); two writers at once may lose
    one's entry, which is then hashed again."""
    folder = os.path.dirname(memo_path)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, staging = tempfile.mkstemp(dir=folder, prefix=".digests-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(memo, f)
            os.replace(staging, memo_path)
        except OSError:
            os.unlink(staging)
            raise
    except OSError as err:
        log.debug("could not keep file digests in %s (%s)", memo_path, err)
