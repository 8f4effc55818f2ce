"""Slow and doomed uploads over a real server (SQLite store): upload places are shared per tenant (callers
without a key, from any address, are one tenant), an upload slower than the floor is ended with 408 and frees
its place, an aborted upload gives its pages back to the file system, and uploads declared past the caller's
quota are refused before they store (and hold) anything that would refuse another caller at the server total.
Small numbers throughout (4 places, a floor of 1 KB/s after 0.5 s), so each test takes seconds."""

from __future__ import annotations

import os
import socket
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.conftest import LiveServer, add_key, start_server
from tests.integration.jobs.test_openai_batch import launch
from tests.integration.jobs.test_storage import lines, upload, wait_for

FILE_HEAD = b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'


def open_upload(
    url: str, declared: int, first: bytes = b"", source: str = "127.0.0.1", headers: bytes = b""
) -> socket.socket:
    """An upload with a declared Content-Length, its head and `first` bytes of its file part sent (from the
    loopback address `source`: another anonymous caller per address); the rest is up to the test."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10, source_address=(source, 0))
    sock.sendall(
        b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
        + headers
        + b"Content-Length: %d\r\n\r\n" % declared
        + FILE_HEAD
        + first
    )
    return sock


def answer(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the answer on `sock` (read until the server closes or the body is whole)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), orjson.loads(body[: length(data)])


def length(data: bytes) -> int:
    for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 1 << 30


@pytest.fixture
def serve(tmp_path: Path) -> Iterator:
    """Start a server on a SQLite store; `key=True` first adds a key of the tenant `keyed` to its config (the
    key's token is the server's `key`)."""
    started: list[LiveServer] = []

    def start(*args: str, key: bool = False) -> LiveServer:
        s = launch(tmp_path, "--jobs-db", str(tmp_path / "jobs.db"), *args)
        token = ""
        if key:  # launch wrote the config afresh: add the key and start again on it
            s.stop()
            token = add_key(tmp_path / "bs.toml", "keyed", "paid")
            env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
            s = start_server(
                "--config",
                str(tmp_path / "bs.toml"),
                "--slo-ms",
                "2000",
                "--jobs-db",
                str(tmp_path / "jobs.db"),
                "--files-max-bytes",
                "100000",
                *args,
                env=env,
            )
        s.key = token  # type: ignore[attr-defined]
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def test_anonymous_callers_are_one_tenant_and_cannot_take_every_place(tmp_path, serve):
    """Four anonymous callers on four addresses, each holding a slow upload, get two of the four places (the
    anonymous share); a keyed tenant still uploads."""
    s = serve(
        "--allow-anonymous",
        "--files-max-uploads",
        "4",
        "--files-max-uploads-per-tenant",
        "2",
        "--files-upload-min-kbps",
        "0",
        key=True,
    )
    key = s.key
    held, refused = [], []
    try:
        for n in range(2, 6):
            sock = open_upload(s.url, 5000, b"z" * 100, source=f"127.0.0.{n}")
            sock.settimeout(1.0)
            try:
                refused.append(answer(sock))
                sock.close()
            except TimeoutError:
                held.append(sock)  # no answer within a second: it holds a place
        assert len(held) == 2, refused
        assert all(status == 429 and "without a key" in body["message"] for status, body in refused), refused
        with s.client(headers={"Authorization": f"Bearer {key}"}) as h:
            ok = upload(h, lines(2))
            assert ok.status_code == 200, ok.text
    finally:
        for sock in held:
            sock.close()


def test_a_tenant_holding_places_leaves_the_last_ones_to_others(tmp_path, serve):
    """5 places, 3 per tenant: the anonymous tenant holds 3, a keyed one takes a 4th, and the last place is
    kept for a tenant holding none: the keyed tenant's second upload is refused though a place is free."""
    s = serve(
        "--allow-anonymous",
        "--files-max-uploads",
        "5",
        "--files-max-uploads-per-tenant",
        "3",
        "--files-upload-min-kbps",
        "0",
        key=True,
    )
    auth = b"Authorization: Bearer " + s.key.encode() + b"\r\n"
    held = [open_upload(s.url, 5000, b"z" * 100, source=f"127.0.0.{n}") for n in (2, 3, 4)]
    held.append(open_upload(s.url, 5000, b"z" * 100, headers=auth))
    try:
        for sock in held:
            sock.settimeout(0.5)
            with pytest.raises(TimeoutError):  # each holds a place
                answer(sock)
        second = open_upload(s.url, 5000, b"z" * 100, headers=auth)
        held.append(second)
        second.settimeout(5)
        status, body = answer(second)
        assert status == 429 and "kept for tenants with none" in body["message"], body
    finally:
        for sock in held:
            sock.close()


def test_a_too_slow_upload_is_ended_with_408_and_frees_its_place(serve):
    s = serve("--files-max-uploads", "1", "--files-upload-min-kbps", "1", "--files-upload-grace-s", "0.5")
    sock = open_upload(s.url, 50_000, b"z" * 100)
    began = time.monotonic()
    try:
        for _ in range(40):  # 20 bytes every 0.1 s: 200 B/s, under the 1 KB/s floor
            sock.sendall(b"z" * 20)
            time.sleep(0.1)
            sock.settimeout(0.01)
            try:
                status, body = answer(sock)
                break
            except (TimeoutError, BlockingIOError):
                continue
        else:
            pytest.fail("the slow upload was never ended")
    finally:
        sock.close()
    assert status == 408 and body["error"] == "REQUEST_TIMEOUT" and "--files-upload-min-kbps" in body["message"]
    assert time.monotonic() - began < 3.5
    with s.client() as h:
        assert wait_for(lambda: upload(h, lines(2)).status_code == 200, timeout=5)  # its place is free again
        assert h.get("/v1/files").json()["data"][0]["bytes"] > 0 and len(h.get("/v1/files").json()["data"]) == 1


def test_an_aborted_upload_gives_its_pages_back(serve, tmp_path):
    s = serve("--files-max-bytes", "8000000", "--files-upload-min-kbps", "0")
    db = tmp_path / "jobs.db"
    with s.client() as h:
        assert upload(h, lines(2)).status_code == 200  # the store exists
    sock = open_upload(s.url, 6_000_000, b"z" * 4_500_000)  # three 1 MB chunks stored, then the caller goes

    def chunks() -> int:
        conn = sqlite3.connect(db)
        try:
            return conn.execute("SELECT count(*) FROM file_chunks").fetchone()[0]
        finally:
            conn.close()

    wait_for(lambda: chunks() >= 4)  # the finished small file's one chunk, and three of the upload's
    size = db.stat().st_size + (tmp_path / "jobs.db-wal").stat().st_size
    sock.close()
    wait_for(lambda: chunks() == 1)

    def freed() -> bool:
        conn = sqlite3.connect(db)
        try:
            return conn.execute("PRAGMA freelist_count").fetchone()[0] == 0
        finally:
            conn.close()

    assert wait_for(freed, timeout=3)  # the vacuum is in the write-ahead log ...
    # ... and the file shrinks once the checkpoint that follows it has folded the log back (a busy machine may
    # still be copying the log's pages into the file when the vacuum shows)
    assert wait_for(lambda: db.stat().st_size < size - 2_000_000, timeout=5), (db.stat().st_size, size)


def test_uploads_declared_past_the_quota_hold_nothing_that_refuses_another(serve):
    """Two uploads declared past their caller's quota are refused at once, so their bytes never count against
    the server's total; another caller's upload that fits is stored."""
    s = serve(
        "--files-max-bytes",
        "4000000",
        "--tenant-storage-mb",
        "2",
        "--storage-max-mb",
        "3",
        "--files-upload-min-kbps",
        "0",
    )
    doomed = [open_upload(s.url, 2_600_000, b"z" * 1_100_000) for _ in range(2)]
    try:
        for sock in doomed:
            sock.settimeout(5)
            status, body = answer(sock)
            assert status == 413 and "storage quota" in body["message"], body
        with httpx.Client(base_url=s.url, transport=httpx.HTTPTransport(local_address="127.0.0.7")) as other:
            ok = other.post(
                "/v1/files",
                files={"file": ("a.jsonl", b"y" * 1_500_000 + b"\n")},
                data={"purpose": "batch"},
                timeout=10,
            )
            assert ok.status_code == 200, ok.text
    finally:
        for sock in doomed:
            sock.close()
