"""Storage of OpenAI's Files + Batches (issue 34, items 1 and 2) over a real server, on SQLite and PostgreSQL:
a 413 in JSON past the upload limit (never a reset, even past 64 MiB), the cap on uploads in progress, output
files streamed and sized without being rendered, per-tenant byte quotas enforced at upload, at batch creation
and as outputs grow, expiry that frees the bytes, the upload -> batch -> cancel -> delete loop held within the
quota, and a line nested too deep refused at batch creation. Limits are configured small, so files are small.
"""

from __future__ import annotations

import socket
import sqlite3
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import httpx
import orjson
import psycopg
import pytest

from batchserve.jobs.openai_batch import file_line
from batchserve.jobs.store import OUTPUT, ItemRow
from tests.conftest import LiveServer, add_key
from tests.integration.jobs.test_openai_batch import jsonl, launch

LINE = {"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"model": "embed", "input": "x"}}
STORE_PLUGIN = '''
import time
from pathlib import Path

GATE = Path(__file__).with_name("open")


class Big:
    """Answers an input of digits n with a text of n two-byte characters: outputs of megabytes from tiny inputs."""

    output_kind = "text"
    max_batch_size = 8

    def batch(self, inputs):
        return ["\u00e9" * int(t) if t.isdigit() else t for t in inputs]


class Held:
    """Echoes its inputs; a batch holding an input that starts with "hold" first waits (30 s at most) for the
    file `open` beside this module: a test holds a job running while it reads the store."""

    output_kind = "text"
    max_batch_size = 8

    def batch(self, inputs):
        give_up = time.monotonic() + 30
        while any(t.startswith("hold") for t in inputs) and not GATE.exists() and time.monotonic() < give_up:
            time.sleep(0.01)
        return list(inputs)
'''


def store_models(tmp: Path) -> str:
    """The [[models]] `big` and `held` (STORE_PLUGIN, written in `tmp`), for `serve(models=...)`."""
    (tmp / "storeplug.py").write_text(STORE_PLUGIN)
    return (
        '\n[[models]]\nname = "big"\nbackend = "storeplug:Big"\n'
        '\n[[models]]\nname = "held"\nbackend = "storeplug:Held"\n'
    )


def lines(n: int, inputs: int = 1, pad: int = 0) -> bytes:
    return jsonl(
        [
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": "embed", "input": ["w" * (1 + pad)] * inputs},
            }
            for i in range(n)
        ]
    )


def slow_lines(n: int, pad: int = 0) -> bytes:
    """/v1/inference lines on the 300 ms sim model: a batch of them runs for seconds (8 items in flight)."""
    return jsonl(
        [
            {
                "custom_id": f"s{i}",
                "method": "POST",
                "url": "/v1/inference",
                "body": {"model": "slow", "input": "w" * (1 + pad)},
            }
            for i in range(n)
        ]
    )


def upload(h: httpx.Client, content: bytes, **fields: str) -> httpx.Response:
    return h.post(
        "/v1/files", files={"file": ("in.jsonl", content, "application/jsonl")}, data={"purpose": "batch", **fields}
    )


def create(h: httpx.Client, file_id: str, endpoint: str = "/v1/embeddings", **extra: Any) -> httpx.Response:
    return h.post(
        "/v1/batches", json={"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h", **extra}
    )


class Store:
    """Reads what the store keeps, beside the server (SQLite readers do not block its writer in WAL mode)."""

    def __init__(self, location: str) -> None:
        self.location = location

    def kept(self) -> int:
        query = "SELECT (SELECT COALESCE(SUM(bytes), 0) FROM {p}files) + (SELECT COALESCE(SUM(bytes), 0) FROM {p}jobs)"
        if self.location.startswith("postgresql://"):
            with psycopg.connect(self.location) as conn:
                return int(conn.execute(query.format(p="batchserve_")).fetchone()[0])  # type: ignore[index]
        conn = sqlite3.connect(self.location)
        try:
            return int(conn.execute(query.format(p="")).fetchone()[0])
        finally:
            conn.close()

    def rows(self, job_id: str) -> list[ItemRow]:
        """The job's items as stored, whole, in input order."""
        query = "SELECT idx, status, output, error, message, input FROM {p}items WHERE job_id = {m} ORDER BY idx"
        if self.location.startswith("postgresql://"):
            with psycopg.connect(self.location) as conn:
                return [ItemRow(*r) for r in conn.execute(query.format(p="batchserve_", m="%s"), (job_id,))]
        conn = sqlite3.connect(self.location)
        try:
            return [ItemRow(*r) for r in conn.execute(query.format(p="", m="?"), (job_id,))]
        finally:
            conn.close()


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "postgres":
        return request.getfixturevalue("pg_server").fresh_url()
    return str(tmp_path / "jobs.db")


@pytest.fixture
def serve(tmp_path, db: str) -> Iterator[Any]:
    started: list[LiveServer] = []

    def start(*args: str, models: str = "") -> LiveServer:
        s = launch(tmp_path, "--jobs-db", db, *args, models=models)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


# -- 413, never a reset ----------------------------------------------------------------------------------------
def test_413_in_json_past_the_limit_declared_or_streamed_even_past_64_mib(serve):
    s = serve("--files-max-bytes", "100000")
    big = 70 << 20  # past the 64 MiB the server used to read of a refused body before it closed (a reset)
    status, body = raw_post(s.url, big)  # as a client that writes its whole body before it reads
    assert status == 413 and orjson.loads(body)["error"] == "PAYLOAD_TOO_LARGE"
    with s.client() as h:

        def chunks() -> Iterator[bytes]:  # no Content-Length: refused as it streams in
            yield (
                b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
                b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'
            )
            for _ in range(big // (1 << 20)):
                yield b"y" * (1 << 20)

        streamed = h.post("/v1/files", content=chunks(), headers={"content-type": "multipart/form-data; boundary=b"})
        assert streamed.status_code == 413 and "--files-max-bytes" in streamed.json()["message"]
        ok = upload(h, lines(3))
        assert ok.status_code == 200, ok.text
        assert h.get("/v1/files").json()["data"] == [ok.json()]  # the refused ones left nothing behind


def raw_post(url: str, size: int) -> tuple[int, bytes]:
    """POST /v1/files with a declared body of `size` bytes, every byte written before the answer is read (a
    reset while writing or reading fails the test)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
            b"Content-Length: %d\r\n\r\n" % size
        )
        block = b"x" * (1 << 20)
        for _ in range(size // len(block)):
            sock.sendall(block)
        sock.sendall(b"x" * (size % len(block)))
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


# -- uploads in progress ---------------------------------------------------------------------------------------
def hold_upload(url: str) -> socket.socket:
    """An upload whose body is sent in part and then held: it stays in progress until the socket closes."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = (
        b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
        b'Content-Length: 5000\r\n\r\n--b\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n'
    )
    sock.sendall(head + b"z" * 100)
    return sock


def wait_for(check: Any, timeout: float = 10.0) -> Any:
    give_up = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < give_up, "timed out"
        time.sleep(0.05)
    return found


def test_uploads_in_progress_are_capped_per_tenant_429_and_in_all_503(serve):
    s = serve("--files-max-uploads-per-tenant", "1", "--files-max-uploads", "0")
    with s.client() as h:
        held = hold_upload(s.url)
        try:
            refused = wait_for(lambda: (r := upload(h, lines(2))).status_code == 429 and r)
            body = refused.json()
            assert body["error"] == "RATE_LIMITED" and "uploads in progress" in body["message"]
            assert body["retry_after_ms"] > 0 and refused.headers["retry-after"]
        finally:
            held.close()
        assert wait_for(lambda: upload(h, lines(2)).status_code == 200)  # the place is free again


def test_uploads_in_progress_are_capped_in_all_503(serve):
    s = serve("--files-max-uploads-per-tenant", "0", "--files-max-uploads", "1")
    with s.client() as h:
        held = hold_upload(s.url)
        try:
            refused = wait_for(lambda: (r := upload(h, lines(2))).status_code == 503 and r)
            assert (
                refused.json()["error"] == "SERVICE_OVERLOADED" and "--files-max-uploads" in refused.json()["message"]
            )
        finally:
            held.close()
        assert wait_for(lambda: upload(h, lines(2)).status_code == 200)


# -- outputs ---------------------------------------------------------------------------------------------------
def test_output_file_is_streamed_and_its_size_known_without_rendering_it(serve):
    s = serve()
    with s.client() as h:
        file_id = upload(h, lines(300, inputs=3)).json()["id"]
        batch = create(h, file_id).json()
        done = wait_for(
            lambda: (b := h.get(f"/v1/batches/{batch['id']}").json())["status"] == "completed" and b, timeout=60
        )
        meta = h.get(f"/v1/files/{done['output_file_id']}").json()
        with h.stream("GET", f"/v1/files/{done['output_file_id']}/content") as r:
            assert r.status_code == 200 and r.headers.get("transfer-encoding") == "chunked"
            body = b"".join(r.iter_bytes())
        assert meta["bytes"] == len(body) > 0  # the size kept as the lines were written, not rendered
        got = [orjson.loads(line) for line in body.splitlines()]
        assert [line["custom_id"] for line in got] == [f"r{i}" for i in range(300)]
        assert all(len(line["response"]["body"]["data"]) == 3 for line in got)
        with h.stream("GET", f"/v1/files/{file_id}/content") as r:  # an upload: chunks from the store
            assert r.headers.get("transfer-encoding") == "chunked" and b"".join(r.iter_bytes()) == lines(300, inputs=3)


def test_outputs_of_megabytes_from_tiny_inputs_are_downloaded_whole(serve, db, tmp_path):
    """Outputs of up to 1.4 MB a line from inputs of a few bytes (the server reads them in pages bounded in bytes,
    a large output a piece at a time: tests/unit/jobs/test_pages.py): the output file and the native results
    arrive complete, byte for byte the lines of the stored rows, the file as long as the size it states."""
    s = serve(models=store_models(tmp_path))
    store = Store(db)
    sizes = ["5", "700000", "40", "150000", "300000", "9"]  # characters of two bytes each
    content = jsonl(
        [
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/inference", "body": {"model": "big", "input": n}}
            for i, n in enumerate(sizes)
        ]
    )
    with s.client(timeout=60) as h:
        batch = create(h, upload(h, content).json()["id"], "/v1/inference").json()
        native = h.post("/v1/batches", json={"model": "big", "inputs": sizes}).json()
        for job_id in (batch["id"], native["id"]):
            wait_for(lambda j=job_id: h.get(f"/v1/batches/{j}").json()["status"] == "completed", timeout=60)
        output_id = h.get(f"/v1/batches/{batch['id']}").json()["output_file_id"]
        stated = h.get(f"/v1/files/{output_id}").json()["bytes"]
        body = h.get(f"/v1/files/{output_id}/content").content
        results = h.get(f"/v1/batches/{native['id']}/results").content
    assert len(body) == stated > 2 * 1_150_000
    assert body == b"".join(file_line(batch["id"], row, OUTPUT) or b"" for row in store.rows(batch["id"]))
    lines = [orjson.loads(line) for line in body.splitlines()]
    assert [(line["custom_id"], line["response"]["body"]["output"]) for line in lines] == [
        (f"r{i}", "\u00e9" * int(n)) for i, n in enumerate(sizes)
    ]
    assert results == b"".join(orjson.dumps(row.public()) + b"\n" for row in store.rows(native["id"]))
    assert [orjson.loads(line)["output"] for line in results.splitlines()] == ["\u00e9" * int(n) for n in sizes]


# -- quotas ----------------------------------------------------------------------------------------------------
def test_quota_at_upload_and_at_batch_creation(serve, db):
    s = serve("--tenant-storage-mb", "0.02")  # 20 kB
    store = Store(db)
    content = lines(70)  # about 6.9 kB: two fit in 20 kB, three do not
    assert 6700 < len(content) < 9000
    with s.client() as h:
        first = upload(h, content).json()["id"]
        second = upload(h, content).json()["id"]
        over = upload(h, content)  # 3 x 7 kB > 20 kB
        assert over.status_code == 413 and "storage quota" in over.json()["message"], over.text
        assert len(h.get("/v1/files").json()["data"]) == 2 and store.kept() == 2 * len(content)
        refused = create(h, first)  # its copy of the file would pass the quota too
        assert refused.status_code == 413 and "--tenant-storage-mb" in refused.json()["message"]
        assert h.get("/v1/batches").json()["data"] == []
        assert h.delete(f"/v1/files/{second}").status_code == 200  # deleting frees the bytes at once
        assert create(h, first).status_code == 202
        assert store.kept() <= 20_000


def test_native_jobs_count_against_the_quota_and_are_deleted_with_their_data(serve, db, tmp_path):
    s = serve("--tenant-storage-mb", "0.01", models=store_models(tmp_path))  # 10 kB
    store = Store(db)
    with s.client() as h:
        over = h.post("/v1/batches", json={"model": "held", "inputs": ["x" * 1000] * 11})
        assert over.status_code == 413 and "storage quota" in over.json()["message"]
        try:  # the job is held running: the store keeps its inputs and no output yet
            job = h.post("/v1/batches", json={"model": "held", "inputs": ["hold" + "x" * 996] * 4}).json()
            assert job["bytes"] == 4000 and store.kept() == 4000
        finally:
            (tmp_path / "open").touch()
        done = wait_for(lambda: (j := h.get(f"/v1/batches/{job['id']}").json())["status"] == "completed" and j)
        assert done["bytes"] == store.kept() > 4000  # its outputs count too
        assert h.delete(f"/v1/batches/{job['id']}").status_code == 200 and store.kept() == 0


def test_a_keys_storage_mb_in_the_config_file_is_its_tenants_quota(tmp_path, db):
    """`[[keys]] storage_mb` gives one tenant its own quota beside --tenant-storage-mb for the others."""
    import os

    from tests.conftest import start_server
    from tests.integration.embeddings.test_routes import EMBED_PLUGIN
    from tests.integration.jobs.test_openai_batch import CONFIG

    (tmp_path / "embedplug.py").write_text(EMBED_PLUGIN)
    config = tmp_path / "bs.toml"
    config.write_text(CONFIG)

    small = add_key(config, "small", "paid")
    big = add_key(config, "big", "paid")
    with config.open("a") as fh:
        fh.write("storage_mb = 0.1\n")  # the last [[keys]] table: big keeps up to 100 kB
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    s = start_server("--config", str(config), "--jobs-db", db, "--tenant-storage-mb", "0.01", env=env)
    content = lines(200)  # ~20 kB
    try:
        with s.client(headers={"Authorization": f"Bearer {small}"}) as h:
            refused = upload(h, content)
            assert refused.status_code == 413 and "--tenant-storage-mb" in refused.json()["message"]
        with s.client(headers={"Authorization": f"Bearer {big}"}) as h:
            assert upload(h, content).status_code == 200
            assert create(h, upload(h, content).json()["id"]).status_code == 202
    finally:
        s.stop()


def test_a_batch_whose_outputs_would_pass_the_quota_fails_saying_why(serve, db):
    s = serve("--tenant-storage-mb", "0.015")  # inputs 2 x 3.5 kB; 20 lines of 20 vectors' answers are more
    store = Store(db)
    with s.client() as h:
        file_id = upload(h, lines(20, inputs=20)).json()["id"]
        batch = create(h, file_id)
        assert batch.status_code == 202, batch.text
        done = wait_for(
            lambda: (
                (b := h.get(f"/v1/batches/{batch.json()['id']}").json())["status"] not in ("in_progress", "validating")
                and b
            ),
            timeout=60,
        )
        assert done["status"] == "failed", done
        assert done["errors"]["data"][0]["code"] == "storage_quota_exceeded"
        assert "--tenant-storage-mb" in done["errors"]["data"][0]["message"]
        assert done["request_counts"]["failed"] > 0
        errors = [orjson.loads(x) for x in h.get(f"/v1/files/{done['error_file_id']}/content").content.splitlines()]
        assert {e["error"]["code"] for e in errors} == {"storage_quota_exceeded"}
        assert store.kept() <= 15_000


# -- retention -------------------------------------------------------------------------------------------------
def test_expiry_deletes_files_and_batches_and_frees_their_bytes(serve, db):
    s = serve("--storage-sweep-s", "0.2")
    store = Store(db)
    with s.client() as h:
        kept = upload(h, lines(5)).json()
        assert kept["expires_at"] > time.time() + 29 * 86400  # the server's default: 30 days
        short = upload(h, lines(5), **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "1"}).json()
        assert short["expires_at"] <= time.time() + 2
        batch = create(h, kept["id"], output_expires_after={"anchor": "created_at", "seconds": 1}).json()
        wait_done_http(h, batch["id"])
        before = store.kept()
        assert wait_for(lambda: h.get(f"/v1/files/{short['id']}").status_code == 404)
        assert wait_for(lambda: h.get(f"/v1/batches/{batch['id']}").status_code == 404)
        assert h.get(f"/v1/files/{kept['id']}").status_code == 200
        assert store.kept() == len(lines(5)) < before
        bad = upload(h, lines(5), **{"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "5"})
        assert bad.status_code == 400 and "expires_after" in bad.json()["message"]


def wait_done_http(h: httpx.Client, batch_id: str) -> dict:
    return wait_for(
        lambda: (b := h.get(f"/v1/batches/{batch_id}").json())["status"] in ("completed", "failed", "cancelled") and b,
        timeout=60,
    )


def test_upload_batch_cancel_delete_loop_stays_within_the_quota(serve, db):
    quota = 40_000
    s = serve("--tenant-storage-mb", str(quota / 1e6))
    store = Store(db)
    content = slow_lines(100, pad=50)  # ~14 kB: a file and its batch's copy are ~28 kB
    assert 12_000 < len(content) < 16_000
    refused = 0
    with s.client() as h:
        for _ in range(5):
            file_id = upload(h, content).json()["id"]
            made = create(h, file_id, "/v1/inference")
            if made.status_code == 413:
                refused += 1
                assert "storage quota" in made.json()["message"]
            else:
                assert made.status_code == 202, made.text
                assert h.post(f"/v1/batches/{made.json()['id']}/cancel").status_code == 200
            assert h.delete(f"/v1/files/{file_id}").status_code == 200
            assert store.kept() <= quota
        assert refused >= 2  # the cancelled batches' copies kept their bytes: later rounds were refused
        for b in h.get("/v1/batches").json()["data"]:
            wait_done_http(h, b["id"])
            assert h.delete(f"/v1/batches/{b['id']}").json() == {"id": b["id"], "object": "batch", "deleted": True}
            assert h.get(f"/v1/batches/{b['id']}").status_code == 404
        assert store.kept() == 0
        assert create(h, upload(h, content).json()["id"], "/v1/inference").status_code == 202  # usable again


def test_a_running_batch_is_deleted_only_once_cancelled(serve):
    s = serve()
    with s.client() as h:
        batch = create(h, upload(h, slow_lines(200)).json()["id"], "/v1/inference").json()
        running = h.delete(f"/v1/batches/{batch['id']}")
        assert running.status_code == 409 and "cancel it first" in running.json()["message"]
        assert h.post(f"/v1/batches/{batch['id']}/cancel").status_code == 200
        assert h.delete(f"/v1/batches/{batch['id']}").status_code == 200
        assert h.get(f"/v1/batches/{batch['id']}").status_code == 404
        assert h.get(f"/v1/files/file-{batch['id']}-errors").status_code == 404  # its files went with it
        assert h.delete("/v1/batches/batch_nope").status_code == 404


# The SQLite schema before issue 34 (version 1): a file's bytes in one `content` value, items WITHOUT ROWID.
SCHEMA_V1 = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
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
) WITHOUT ROWID;
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
    content BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS files_by_tenant ON files (tenant, seq);
"""


def test_a_store_file_from_before_keeps_its_uploads_and_jobs(tmp_path):
    """Opening a version-1 file moves each upload's `content` into chunks and counts each job's bytes: the
    upload reads back whole, a batch can be made from it, and the old job is counted and can be deleted."""
    db = tmp_path / "old.db"
    content = lines(30)
    conn = sqlite3.connect(db)
    conn.executescript(SCHEMA_V1 + "ALTER TABLE jobs ADD COLUMN openai TEXT; PRAGMA user_version = 1;")
    conn.execute(
        "INSERT INTO files (id, tenant, filename, purpose, bytes, created_at, content) VALUES "
        "('file-old', 'anonymous@127.0.0.1', 'old.jsonl', 'batch', ?, 1.0, ?)",
        (len(content), content),
    )
    conn.execute(
        "INSERT INTO jobs (id, tenant, model, status, total, completed, request_hash, created_at, "
        "finished_at) VALUES ('batch_old', 'anonymous@127.0.0.1', 'echo@v1', 'completed', 1, 1, 'h', 1.0, 2.0)"
    )
    conn.execute(
        "INSERT INTO items (job_id, idx, input, status, output, writes) VALUES "
        "('batch_old', 0, 'abcd', 'completed', '\"dcba\"', 1)"
    )
    conn.commit()
    conn.close()
    s = launch(tmp_path, "--jobs-db", str(db))
    try:
        with s.client() as h:
            assert h.get("/v1/files/file-old/content").content == content
            assert h.get("/v1/files/file-old").json()["bytes"] == len(content)
            assert h.get("/v1/batches/batch_old").json()["bytes"] == len("abcd") + len('"dcba"')
            assert create(h, "file-old").status_code == 202
            assert h.delete("/v1/batches/batch_old").status_code == 200
    finally:
        s.stop()
    conn = sqlite3.connect(db)
    assert "content" not in {r[1] for r in conn.execute("PRAGMA table_info(files)")}
    conn.close()


# -- input checks ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [255, 600, 1100])
def test_a_line_nested_too_deep_is_a_400_at_batch_creation(serve, depth):
    s = serve()
    nested = b"[" * depth + b"]" * depth
    content = jsonl([LINE]) + (
        b'{"custom_id": "deep", "method": "POST", "url": "/v1/embeddings", '
        b'"body": {"model": "embed", "input": ' + nested + b"}}\n"
    )
    with s.client() as h:
        file_id = upload(h, content).json()["id"]
        r = create(h, file_id)
        assert r.status_code == 400, r.text
        assert "line 2" in r.json()["message"] and ("nested" in r.json()["message"] or "depth" in r.json()["message"])
        assert h.get("/v1/batches").json()["data"] == []


def test_a_batch_from_a_file_of_many_chunks_keeps_every_line(serve):
    """Lines that cross the store's 1 MB chunks are read whole, in order, at creation and when copied."""
    s = serve("--files-max-bytes", str(4 << 20))
    content = lines(3000, pad=700)  # ~2.3 MB: lines straddle chunk ends
    assert len(content) > 2 << 20
    with s.client() as h:
        up = upload(h, content).json()
        assert up["bytes"] == len(content)
        assert h.get(f"/v1/files/{up['id']}/content").content == content
        batch = create(h, up["id"])
        assert batch.status_code == 202, batch.text
        assert batch.json()["request_counts"]["total"] == 3000
