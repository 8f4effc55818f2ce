"""Batch jobs (issue 5) through real HTTP on a live server with a real SQLite file: input order, idempotency,
cancellation, tenant isolation, limits, poison and transient failures, and a SIGKILL mid-job followed by a
restart on the same file (every item completed and recorded exactly once, each output its input reversed)."""

from __future__ import annotations

import signal
import sqlite3
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

import httpx
import jsonschema
import orjson
import pytest

from batchserve.http.guards import digest, new_key
from tests.conftest import LiveServer, start_server


def wait_for(check: Callable[[], Any], timeout: float = 20.0, every: float = 0.05) -> Any:
    give_up = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > give_up:
            raise AssertionError(f"not true within {timeout}s: {check}")
        time.sleep(every)


def results(c: httpx.Client, job_id: str) -> list[dict]:
    r = c.get(f"/v1/batches/{job_id}/results")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    return [orjson.loads(line) for line in r.content.splitlines()]


def finished(c: httpx.Client, job_id: str) -> dict | None:
    job = c.get(f"/v1/batches/{job_id}").json()
    return job if job["status"] in ("completed", "failed", "cancelled") else None


def db_items(path: Path, job_id: str) -> list[dict]:
    """The job's items as the file holds them, each output decoded from its JSON text."""
    conn = sqlite3.connect(path)
    conn.row_factory = sqlite3.Row
    try:
        rows = conn.execute(
            "SELECT idx, input, status, output, error, writes FROM items WHERE job_id = ? ORDER BY idx", (job_id,)
        ).fetchall()
    finally:
        conn.close()
    return [{**dict(row), "output": orjson.loads(row["output"]) if row["output"] is not None else None} for row in rows]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """1 sim device, 20-item batches of 20 ms (1,000 items/s), small limits, a poison marker."""
    db = tmp_path_factory.mktemp("jobs") / "jobs.db"
    s = start_server(
        "--devices",
        "1",
        "--sim-batch-ms",
        "20",
        "--max-batch-size",
        "20",
        "--jobs-db",
        str(db),
        "--jobs-max-items",
        "3000",
        "--max-input-chars",
        "100",
        "--jobs-max-body-bytes",
        "200000",
        "--sim-fail-marker",
        "POISON",
    )
    yield s
    s.stop()


@pytest.fixture
def c(server: LiveServer):
    with server.client() as client:
        yield client


def test_results_come_back_in_input_order(c):
    inputs = [f"item-{i:04d}-{'x' * (i % 7)}" for i in range(300)]
    r = c.post("/v1/batches", json={"inputs": inputs, "metadata": {"purpose": "order"}})
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["id"].startswith("batch_") and job["status"] == "queued" and job["total"] == 300
    assert r.headers["location"] == f"/v1/batches/{job['id']}"
    done = wait_for(lambda: finished(c, job["id"]))
    assert done["status"] == "completed" and (done["completed"], done["failed"], done["pending"]) == (300, 0, 0)
    assert done["metadata"] == {"purpose": "order"} and done["started_at"] <= done["finished_at"]
    lines = results(c, job["id"])
    assert [line["index"] for line in lines] == list(range(300))
    assert [line["output"] for line in lines] == [s[::-1] for s in inputs]
    assert all(line["status"] == "completed" for line in lines)
    listed = c.get("/v1/batches").json()
    assert job["id"] in [j["id"] for j in listed["data"]]


def test_results_of_a_long_job_page_through_in_input_order(c):
    """Results are read from the store a page (2,000 rows) at a time: a 2,500-item job crosses a page boundary.
    Cancelled at once, so its lines are a few completed items, then cancelled ones, every index exactly once."""
    inputs = [f"long-{i:04d}" for i in range(2500)]
    job = c.post("/v1/batches", json={"inputs": inputs}).json()
    cancelled = c.post(f"/v1/batches/{job['id']}/cancel").json()
    assert cancelled["status"] == "cancelled" and cancelled["cancelled"] > 2000
    lines = results(c, job["id"])
    assert [line["index"] for line in lines] == list(range(2500))
    assert sum(line["status"] == "cancelled" for line in lines) == cancelled["cancelled"]
    assert all(line["output"] == inputs[line["index"]][::-1] for line in lines if line["status"] == "completed")
    assert all(line["error"]["error"] == "CANCELLED" for line in lines if line["status"] == "cancelled")


def test_answers_match_the_published_schemas(c):
    doc = c.get("/openapi.json").json()
    paths = doc["paths"]

    def check(path: str, method: str, status: int, value: Any) -> None:
        schema = paths[path][method]["responses"][str(status)]["content"]
        schema = schema.get("application/json", schema.get("application/x-ndjson"))["schema"]
        jsonschema.Draft202012Validator({**doc, **schema}).validate(value)

    r = c.post("/v1/batches", json={"inputs": ["s1", "s2"], "metadata": {"k": "v"}})
    check("/v1/batches", "post", 202, r.json())
    job_id = r.json()["id"]
    wait_for(lambda: finished(c, job_id))
    check("/v1/batches/{batch_id}", "get", 200, c.get(f"/v1/batches/{job_id}").json())
    check("/v1/batches", "get", 200, c.get("/v1/batches").json())
    for line in results(c, job_id):
        check("/v1/batches/{batch_id}/results", "get", 200, line)
    check("/v1/batches/{batch_id}/cancel", "post", 200, c.post(f"/v1/batches/{job_id}/cancel").json())
    check("/v1/batches/{batch_id}", "get", 404, c.get("/v1/batches/batch_none").json())
    check("/v1/batches", "post", 400, c.post("/v1/batches", json={"inputs": []}).json())


def test_a_poison_item_fails_alone(c):
    inputs = [f"p{i}" for i in range(50)]
    inputs[17] = "POISON-17"
    job = c.post("/v1/batches", json={"inputs": inputs}).json()
    done = wait_for(lambda: finished(c, job["id"]))
    assert done["status"] == "completed" and (done["completed"], done["failed"]) == (49, 1)
    lines = results(c, job["id"])
    assert lines[17]["status"] == "failed" and lines[17]["error"]["error"] == "INFERENCE_FAILED"
    assert all(line["output"] == inputs[i][::-1] for i, line in enumerate(lines) if i != 17)


def test_idempotency_key_returns_the_same_job_and_refuses_another_body(c):
    body = {"inputs": ["a", "b", "c"], "metadata": {"x": 1, "y": 2}}
    first = c.post("/v1/batches", json=body, headers={"Idempotency-Key": "idem-1"})
    assert first.status_code == 202
    # The same request again, even spelled differently (key order, spacing): the same job, 200.
    again = c.post(
        "/v1/batches",
        content=b'{"metadata": {"y": 2, "x": 1},  "inputs": ["a","b","c"]}',
        headers={"Idempotency-Key": "idem-1", "Content-Type": "application/json"},
    )
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    conflict = c.post("/v1/batches", json={"inputs": ["a", "b", "d"]}, headers={"Idempotency-Key": "idem-1"})
    assert conflict.status_code == 409 and conflict.json()["error"] == "CONFLICT"
    other = c.post("/v1/batches", json=body, headers={"Idempotency-Key": "idem-2"})
    assert other.status_code == 202 and other.json()["id"] != first.json()["id"]
    ids = [j["id"] for j in c.get("/v1/batches", params={"limit": 100}).json()["data"]]
    assert ids.count(first.json()["id"]) == 1


def test_cancel_stops_the_job_and_freezes_its_counts(c):
    inputs = [f"c{i}" for i in range(1000)]
    job = c.post("/v1/batches", json={"inputs": inputs}).json()
    wait_for(lambda: c.get(f"/v1/batches/{job['id']}").json()["completed"] >= 60)
    r = c.post(f"/v1/batches/{job['id']}/cancel")
    assert r.status_code == 200
    cancelled = r.json()
    assert cancelled["status"] == "cancelled" and cancelled["finished_at"] is not None
    assert cancelled["completed"] + cancelled["cancelled"] == 1000 and cancelled["cancelled"] > 0
    time.sleep(0.3)  # items that were on the worker finish, and must not be recorded after the cancel
    later = c.get(f"/v1/batches/{job['id']}").json()
    assert later == cancelled
    lines = results(c, job["id"])
    assert sum(line["status"] == "cancelled" for line in lines) == cancelled["cancelled"]
    assert all(line["output"] == inputs[line["index"]][::-1] for line in lines if line["status"] == "completed")
    assert c.post(f"/v1/batches/{job['id']}/cancel").json()["status"] == "cancelled"  # idempotent


@pytest.mark.parametrize(
    "body, status",
    [
        ({"inputs": [f"i{n}" for n in range(3001)]}, 400),  # over --jobs-max-items
        ({"inputs": ["ok", "y" * 101]}, 413),  # an input over --max-input-chars
        ({"inputs": ["ok"] * 999 + ["z" * 1000]}, 413),
        ({"inputs": []}, 400),
        ({"inputs": ["ok", 7]}, 400),
        ({"inputs": ["ok", ""]}, 400),
        ({"inputs": "not a list"}, 400),
        ({"inputs": ["ok"], "metadata": "not an object"}, 400),
        ({"inputs": ["ok"], "model": "nope"}, 404),
        ({"input": "ok"}, 400),
    ],
)
def test_limits_refuse_the_whole_job(c, body, status):
    before = len(c.get("/v1/batches", params={"limit": 100}).json()["data"])
    r = c.post("/v1/batches", json=body)
    assert r.status_code == status, r.text
    assert set(r.json()) >= {"error", "message", "request_id"}
    assert len(c.get("/v1/batches", params={"limit": 100}).json()["data"]) == before  # no partial job


def test_body_over_the_job_body_limit_gets_413(c):
    r = c.post(
        "/v1/batches", content=b'{"inputs": ["' + b"a" * 300_000 + b'"]}', headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 413 and r.json()["error"] == "PAYLOAD_TOO_LARGE"


def test_unknown_job_is_404_in_the_error_shape(c):
    for r in (
        c.get("/v1/batches/batch_nope"),
        c.get("/v1/batches/batch_nope/results"),
        c.post("/v1/batches/batch_nope/cancel"),
    ):
        assert r.status_code == 404 and r.json()["error"] == "BATCH_NOT_FOUND"


def test_tenants_see_only_their_own_jobs(tmp_path, server_factory):
    keys = {"acme": new_key(), "globex": new_key()}
    config = tmp_path / "keys.toml"
    config.write_text(
        "".join(
            f'[[keys]]\ntenant = "{t}"\ntier = "paid"\nsha256 = "{digest(k)}"\nrate = 1000\n' for t, k in keys.items()
        )
    )
    s = server_factory(
        "--devices",
        "1",
        "--sim-batch-ms",
        "50",
        "--max-batch-size",
        "10",
        "--config",
        str(config),
        "--jobs-db",
        str(tmp_path / "jobs.db"),
    )
    acme = s.client(headers={"Authorization": f"Bearer {keys['acme']}"})
    globex = s.client(headers={"Authorization": f"Bearer {keys['globex']}"})
    with acme, globex, s.client() as anonymous:
        job = acme.post("/v1/batches", json={"inputs": ["secret"]}, headers={"Idempotency-Key": "k"}).json()
        wait_for(lambda: finished(acme, job["id"]))
        assert results(acme, job["id"])[0]["output"] == "terces"
        for r in (
            globex.get(f"/v1/batches/{job['id']}"),
            globex.get(f"/v1/batches/{job['id']}/results"),
            globex.post(f"/v1/batches/{job['id']}/cancel"),
        ):
            assert r.status_code == 404 and r.json()["error"] == "BATCH_NOT_FOUND"
        assert globex.get("/v1/batches").json()["data"] == []
        assert [j["id"] for j in acme.get("/v1/batches").json()["data"]] == [job["id"]]
        # Nor can another tenant cancel a job that is still running (200 items at 200 items/s: about 1 s).
        running = acme.post("/v1/batches", json={"inputs": [f"r{i}" for i in range(200)]}).json()
        r = globex.post(f"/v1/batches/{running['id']}/cancel")
        assert r.status_code == 404 and r.json()["error"] == "BATCH_NOT_FOUND"
        assert acme.get(f"/v1/batches/{running['id']}").json()["status"] in ("queued", "running")
        done = wait_for(lambda: finished(acme, running["id"]))
        assert (done["status"], done["completed"], done["cancelled"]) == ("completed", 200, 0)
        job_ids = [running["id"], job["id"]]
        assert [j["id"] for j in acme.get("/v1/batches").json()["data"]] == job_ids
        # An idempotency key belongs to its tenant: the same key from another tenant is a new job.
        theirs = globex.post("/v1/batches", json={"inputs": ["other"]}, headers={"Idempotency-Key": "k"})
        assert theirs.status_code == 202 and theirs.json()["id"] != job["id"]
        assert anonymous.get("/v1/batches").status_code == 401
        assert anonymous.post("/v1/batches", json={"inputs": ["x"]}).json()["error"] == "UNAUTHORIZED"


def test_transient_failures_retry_with_backoff(tmp_path, server_factory):
    """A batch that hangs its only worker is answered 504 (transient). The hanging input is retried only after
    its backoff (0.75-1.5 s here), so the items behind it, which run as soon as the worker is back (0.3 s), all
    finish while it is still pending; it keeps failing and ends failed after --jobs-max-attempts runs. Without
    the backoff its retry would be first in line when the worker came back, and fail before they finish."""
    s = server_factory(
        "--devices",
        "1",
        "--sim-batch-ms",
        "10",
        "--max-batch-size",
        "1",
        "--sim-hang-marker",
        "HANG",
        "--sim-hang-ms",
        "300",
        "--gpu-timeout-ms",
        "100",
        "--jobs-max-attempts",
        "2",
        "--jobs-retry-base-ms",
        "1500",
        "--jobs-db",
        str(tmp_path / "j.db"),
    )
    inputs = [f"t{i}" for i in range(10)]
    inputs[3] = "HANG-3"

    def others_done_while_the_hanging_one_waits(c: httpx.Client, job_id: str) -> bool:
        job = c.get(f"/v1/batches/{job_id}").json()
        assert job["failed"] == 0, f"the retry was not held back by its backoff: {job}"
        return (job["completed"], job["pending"]) == (9, 1)

    with s.client() as c:
        job = c.post("/v1/batches", json={"inputs": inputs}).json()
        wait_for(lambda: others_done_while_the_hanging_one_waits(c, job["id"]), timeout=30, every=0.02)
        done = wait_for(lambda: finished(c, job["id"]), timeout=30)
        lines = results(c, job["id"])
        metrics = c.get("/metrics").text
    assert (done["completed"], done["failed"]) == (9, 1)
    assert lines[3]["status"] == "failed" and lines[3]["error"]["error"] == "DEADLINE_EXCEEDED"
    # Item 3 ended last (after its retry), yet the results are in input order, each its own answer.
    assert [line["index"] for line in lines] == list(range(10))
    assert all(line["output"] == inputs[i][::-1] for i, line in enumerate(lines) if i != 3)
    assert 'batchserve_job_items_processed_total{model="sim@v1",outcome="retried"} 1.0' in metrics


def test_sigkill_mid_job_then_restart_records_every_item_exactly_once(tmp_path, server_factory):
    db = tmp_path / "jobs.db"
    args = ("--devices", "1", "--sim-batch-ms", "50", "--max-batch-size", "10", "--jobs-db", str(db))
    inputs = [f"kill-{i:03d}-{'ab' * (i % 5)}" for i in range(400)]  # 200 items/s: about 2 s of work
    first = server_factory(*args)
    with first.client() as c:
        r = c.post("/v1/batches", json={"inputs": inputs}, headers={"Idempotency-Key": "kill-test"})
        assert r.status_code == 202
        job_id = r.json()["id"]
        wait_for(lambda: c.get(f"/v1/batches/{job_id}").json()["completed"] >= 60)
    first.stop(signal.SIGKILL)
    assert first.proc.returncode == -signal.SIGKILL
    before = db_items(db, job_id)
    done_before = sum(row["status"] == "completed" for row in before)
    assert 60 <= done_before < 400, "the kill must land mid-job"

    second = server_factory(*args)
    with second.client() as c:
        # The client retries its POST after the crash: the same job, not a second one.
        again = c.post("/v1/batches", json={"inputs": inputs}, headers={"Idempotency-Key": "kill-test"})
        assert again.status_code == 200 and again.json()["id"] == job_id
        done = wait_for(lambda: finished(c, job_id), timeout=30)
        lines = results(c, job_id)
        assert len(c.get("/v1/batches").json()["data"]) == 1
    assert done["status"] == "completed" and (done["completed"], done["failed"], done["pending"]) == (400, 0, 0)
    assert [line["output"] for line in lines] == [s[::-1] for s in inputs]
    assert "resuming 1 unfinished batch job" in second.log()
    rows = db_items(db, job_id)
    assert [row["idx"] for row in rows] == list(range(400))
    assert all(row["status"] == "completed" and row["output"] == row["input"][::-1] for row in rows)
    assert [row["writes"] for row in rows] == [1] * 400  # recorded exactly once, across the crash


def test_sigterm_mid_job_exits_promptly_and_the_job_resumes(tmp_path, server_factory):
    """A drain does not wait for batch jobs (they are durable): the process exits at once, and the next one
    finishes the job with nothing lost and nothing recorded twice."""
    db = tmp_path / "jobs.db"
    args = ("--devices", "1", "--sim-batch-ms", "50", "--max-batch-size", "10", "--jobs-db", str(db))
    inputs = [f"term-{i:03d}" for i in range(300)]
    first = server_factory(*args)
    with first.client() as c:
        job_id = c.post("/v1/batches", json={"inputs": inputs}).json()["id"]
        wait_for(lambda: c.get(f"/v1/batches/{job_id}").json()["completed"] >= 40)
    assert first.stop(signal.SIGTERM) == 0
    # The process exited with the job unfinished: the drain did not wait for it.
    assert sum(row["status"] == "completed" for row in db_items(db, job_id)) < 300
    second = server_factory(*args)
    with second.client() as c:
        done = wait_for(lambda: finished(c, job_id), timeout=30)
    assert (done["status"], done["completed"]) == ("completed", 300)
    rows = db_items(db, job_id)
    assert all(row["output"] == row["input"][::-1] and row["writes"] == 1 for row in rows)


def test_a_job_file_from_before_json_outputs_reads_back_the_same(tmp_path, server_factory):
    """Files written before outputs were stored as JSON text held the string itself; opening one migrates it
    (user_version 0 -> 1) so those items answer exactly what they answered before."""
    from batchserve.jobs.sqlite_store import SCHEMA

    db = tmp_path / "old.db"
    legacy = ["olleh", 'say "hi"\\ ÿ→', '{"not": "an object"}']
    conn = sqlite3.connect(db)
    conn.executescript(SCHEMA)
    conn.execute(
        "INSERT INTO jobs (id, tenant, model, status, total, completed, request_hash, created_at, "
        "finished_at) VALUES ('batch_old', 'anonymous@127.0.0.1', 'sim@v1', 'completed', 3, 3, 'h', 1.0, 2.0)"
    )
    conn.executemany(
        "INSERT INTO items (job_id, idx, input, status, output, writes) VALUES ('batch_old', ?, ?, 'completed', ?, 1)",
        [(i, out[::-1], out) for i, out in enumerate(legacy)],
    )
    conn.commit()
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 0
    conn.close()
    server = server_factory("--devices", "1", "--sim-batch-ms", "20", "--jobs-db", str(db))
    with server.client() as c:
        lines = [orjson.loads(line) for line in c.get("/v1/batches/batch_old/results").text.splitlines()]
        assert [line["output"] for line in lines] == legacy
        new = c.post("/v1/batches", json={"inputs": ["abc"]}).json()
        done = wait_for(lambda: finished(c, new["id"]))
        assert done["status"] == "completed" and results(c, new["id"])[0]["output"] == "cba"
    conn = sqlite3.connect(db)
    assert (
        conn.execute("PRAGMA user_version").fetchone()[0] == 2
    )  # sqlite_store.SCHEMA_VERSION: 2 since file chunks and byte accounting
    conn.close()


def test_an_integer_past_64_bits_in_a_job_body_is_named_as_such(c):
    body = b'{"inputs": ["a"], "metadata": {"n": 123456789012345678901234567890}}'
    r = c.post("/v1/batches", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "integer outside the 64-bit range" in r.json()["message"], r.text
