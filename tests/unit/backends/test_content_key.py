"""A file's content key (`backends/content_key.py`): the SHA-256 of its bytes, hashed once per (path, size,
mtime) and read from the sidecar afterwards; a copy elsewhere or touched has the same key, other bytes another."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from batchserve.backends import content_key
from batchserve.backends.content_key import DIGESTS, file_digest


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths actually read and hashed."""
    seen: list[str] = []
    real = content_key.sha256_of

    def counted(path: str) -> str:
        seen.append(path)
        return real(path)

    monkeypatch.setattr(content_key, "sha256_of", counted)
    return seen


def test_the_digest_is_the_bytes_sha256_hashed_once(tmp_path: Path, hashed: list[str]) -> None:
    weights = tmp_path / "w.bin"
    weights.write_bytes(os.urandom(3 << 20))
    memo = tmp_path / "cache"
    want = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert file_digest(str(weights), str(memo)) == want
    assert (memo / DIGESTS).exists()
    assert file_digest(str(weights), str(memo)) == want  # a later start: from the sidecar
    assert hashed == [str(weights)]


def test_same_bytes_elsewhere_or_touched_same_key_other_bytes_another(tmp_path: Path, hashed: list[str]) -> None:
    memo = str(tmp_path / "cache")
    first = tmp_path / "venv1" / "w.bin"
    first.parent.mkdir()
    first.write_bytes(b"weights" * 1000)
    key = file_digest(str(first), memo)
    again = tmp_path / "venv2" / "w.bin"  # the same package installed in a fresh virtualenv
    again.parent.mkdir()
    again.write_bytes(first.read_bytes())
    os.utime(again, ns=(1, 1))
    assert file_digest(str(again), memo) == key
    first.write_bytes(b"Weights" * 1000)  # rewritten in place, same size: its mtime changed
    os.utime(first, ns=(2, 2))
    assert file_digest(str(first), memo) != key
    assert len(hashed) == 3


def test_an_unusable_sidecar_costs_only_the_hash(tmp_path: Path) -> None:
    weights = tmp_path / "w.bin"
    weights.write_bytes(b"x" * 10)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    want = hashlib.sha256(b"x" * 10).hexdigest()
    assert file_digest(str(weights), str(blocker / "cache")) == want
    memo = tmp_path / "cache"
    memo.mkdir()
    (memo / DIGESTS).write_text("{not json")
    assert file_digest(str(weights), str(memo)) == want
    assert file_digest(str(weights), str(memo)) == want
