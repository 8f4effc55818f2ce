"""The core path through real HTTP on a live server (issue 2): batching, answers, errors, status, metrics."""

from __future__ import annotations

import asyncio
import re
import socket
import time

import aiohttp
import pytest

from tests.conftest import hang_up_behind_a_busy_worker, start_server


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text (labels in any order), 0 when absent."""
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? ([0-9.e+-]+|NaN|[+-]Inf)$", line)
        if not m or m.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if found == labels:
            return float(m.group(3))
    return 0.0


async def burst(url: str, n: int) -> list[tuple[int, dict]]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=n)) as session:

        async def one(i: int) -> tuple[int, dict]:
            async with session.post(url + "/v1/inference", json={"input": f"caller-{i}-{'x' * (i % 7)}"}) as r:
                return r.status, await r.json()

        return await asyncio.gather(*(one(i) for i in range(n)))


def test_thousand_concurrent_callers_each_get_their_own_answer(sim_server):
    with sim_server.client() as c:
        before = c.get("/metrics").text
    results = asyncio.run(burst(sim_server.url, 1000))
    for i, (status, body) in enumerate(results):
        assert status == 200, body
        assert body["output"] == f"caller-{i}-{'x' * (i % 7)}"[::-1]
        assert 1 <= body["batch_size"] <= 100
    with sim_server.client() as c:
        after = c.get("/metrics").text
    batches = metric(after, "batchserve_batch_size_count", model="sim@v1") - metric(
        before, "batchserve_batch_size_count", model="sim@v1"
    )
    items = metric(after, "batchserve_batch_size_sum", model="sim@v1") - metric(
        before, "batchserve_batch_size_sum", model="sim@v1"
    )
    assert items == 1000
    assert batches >= 10  # 1000 items in batches of at most 100
    over_100 = metric(after, "batchserve_batch_size_bucket", model="sim@v1", le="+Inf") - metric(
        after, "batchserve_batch_size_bucket", model="sim@v1", le="100.0"
    )
    assert over_100 == 0
    assert max(b["batch_size"] for _, b in results) > 1  # it really batched
    full = metric(after, "batchserve_batches_total", model="sim@v1", cause="full") - metric(
        before, "batchserve_batches_total", model="sim@v1", cause="full"
    )
    assert full >= 1  # a burst fills batches to the brim: flushed because full


async def steady(url: str, n: int, gap_s: float) -> list[tuple[int, dict]]:
    """n requests leaving gap_s apart (open loop), answers gathered at the end."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=n)) as session:

        async def one(i: int) -> tuple[int, dict]:
            async with session.post(url + "/v1/inference", json={"input": f"s{i}"}) as r:
                return r.status, await r.json()

        tasks = []
        for i in range(n):
            tasks.append(asyncio.ensure_future(one(i)))
            await asyncio.sleep(gap_s)
        return await asyncio.gather(*tasks)


@pytest.mark.parametrize(
    "devices,slo_ms,cause",
    [
        ("4", "200", "pace"),  # dispatch delay 95 ms > S/G = 25 ms: batches go out paced S/G apart
        # dispatch delay 25 ms < S/G = 50 ms: the oldest item's deadline sends it, unless the client stalls 25 ms
        # between two requests (a delay of 45 ms, at SLO 150, flipped to pace on a 5 ms stall of a loaded CI machine)
        ("2", "130", "deadline"),
    ],
)
def test_steady_load_flushes_by_pace_or_deadline(server_factory, devices, slo_ms, cause):
    server = server_factory("--devices", devices, "--slo-ms", slo_ms)
    results = asyncio.run(steady(server.url, 120, 0.005))
    assert all(s == 200 and b["output"] == f"s{i}"[::-1] for i, (s, b) in enumerate(results))
    with server.client() as c:
        text = c.get("/metrics").text
    assert metric(text, "batchserve_batches_total", model="sim@v1", cause=cause) >= 3
    assert metric(text, "batchserve_batches_total", model="sim@v1", cause="full") == 0


def test_answer_shape_headers_and_request_status(sim_server):
    with sim_server.client() as c:
        r = c.post("/v1/inference", json={"input": "E equals "}, headers={"X-Request-ID": "my-id-42"})
        assert r.status_code == 200
        body = r.json()
        assert body["output"] == " slauqe E"
        assert body["request_id"] == "my-id-42" == r.headers["x-request-id"]
        assert body["model"] == "sim@v1"
        assert body["compute_ms"] >= 90 and body["latency_ms"] >= body["compute_ms"]
        assert re.match(r"queue;dur=[\d.]+, compute;dur=[\d.]+", r.headers["server-timing"])
        status = c.get("/v1/requests/my-id-42").json()
        assert status["status"] == "completed" and status["batch_size"] >= 1
        r2 = c.post("/api/inference", json={"input": "ab", "model": "sim@v1"})
        assert r2.status_code == 200 and r2.json()["output"] == "ba"
        assert r2.headers["x-request-id"].startswith("req_")
        missing = c.get("/v1/requests/nope")
        assert missing.status_code == 404 and missing.json()["error"] == "REQUEST_NOT_FOUND"


@pytest.mark.parametrize(
    "body,content_type,fragment",
    [
        (b"{not json", "application/json", "not valid JSON"),
        (b"[1, 2]", "application/json", "JSON object"),
        (b"{}", "application/json", "input"),
        (b'{"input": 5}', "application/json", "input"),
        (b'{"input": ""}', "application/json", "input"),
        (b'{"input": "a", "timeout_ms": -1}', "application/json", "timeout_ms"),
        (b'{"input": "a", "timeout_ms": "soon"}', "application/json", "timeout_ms"),
        (b'{"input": "\xff\xfe"}', "application/json", "UTF-8"),
        (b'{"input": "a"}', "text/plain", "Content-Type"),
        (b'{"input": "a", "model": 7}', "application/json", "model"),
    ],
)
def test_bad_requests_get_400_json(sim_server, body, content_type, fragment):
    with sim_server.client() as c:
        r = c.post("/v1/inference", content=body, headers={"Content-Type": content_type})
    assert r.status_code == 400
    err = r.json()
    assert err["error"] == "INVALID_REQUEST" and fragment in err["message"] and err["request_id"]


def test_unknown_model_404_and_route_errors(sim_server):
    with sim_server.client() as c:
        r = c.post("/v1/inference", json={"input": "a", "model": "gpt-9"})
        assert r.status_code == 404 and r.json()["error"] == "MODEL_NOT_FOUND"
        r = c.post("/v1/inference", json={"input": "a", "model": "sim@v7"})
        assert r.status_code == 404
        assert c.get("/nowhere").json()["error"] == "NOT_FOUND"
        assert c.get("/v1/inference").status_code == 405


def test_payload_limits_413_before_buffering(server_factory):
    server = server_factory("--max-body-bytes", "1000", "--max-input-chars", "50")
    with server.client() as c:
        r = c.post("/v1/inference", json={"input": "x" * 51})
        assert r.status_code == 413 and r.json()["error"] == "PAYLOAD_TOO_LARGE"
        r = c.post("/v1/inference", json={"input": "x" * 2000})
        assert r.status_code == 413
    # A 10 MB body announced by Content-Length is refused from the headers alone: we send only the headers
    # and the answer still comes, so nothing waited for (or buffered) the body.
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(
            b"POST /v1/inference HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 10000000\r\n\r\n" + b"{" * 100
        )
        answer = ""
        while "PAYLOAD_TOO_LARGE" not in answer:
            chunk = sock.recv(4096).decode()
            if not chunk:
                break
            answer += chunk
    assert answer.startswith("HTTP/1.1 413") and "PAYLOAD_TOO_LARGE" in answer

    # Chunked, no Content-Length: refused once the running count passes the limit.
    def chunks():
        yield b'{"input": "'
        for _ in range(10_000):
            yield b"x" * 1000

    with server.client() as c:
        r = c.post("/v1/inference", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413
        assert c.post("/v1/inference", json={"input": "still fine"}).json()["output"] == "enif llits"


def test_deadline_in_queue_gives_504_and_never_reaches_backend(server_factory):
    # The one worker is stuck on a hang (gpu_timeout far away), so the next item waits in the queue.
    server = server_factory(
        "--devices", "1", "--sim-hang-marker", "HANG", "--sim-hang-ms", "1500", "--gpu-timeout-ms", "60000"
    )

    async def scenario() -> tuple[int, dict, int, dict]:
        async with aiohttp.ClientSession() as s:
            hang = asyncio.ensure_future(s.post(server.url + "/v1/inference", json={"input": "HANG"}))
            await asyncio.sleep(0.3)
            async with s.post(
                server.url + "/v1/inference",
                json={"input": "late", "timeout_ms": 400},
                headers={"X-Request-ID": "late-1"},
            ) as r:
                late = (r.status, await r.json())
            h = await hang
            return late[0], late[1], h.status, await h.json()

    late_status, late_body, hang_status, _ = asyncio.run(scenario())
    assert late_status == 504 and late_body["error"] == "DEADLINE_EXCEEDED"
    assert hang_status == 200
    with server.client() as c:
        text = c.get("/metrics").text
        assert c.get("/v1/requests/late-1").json()["status"] == "failed"
    # Batches dispatched after warm-up: only the hang's single item ever reached the backend.
    assert metric(text, "batchserve_batch_size_sum", model="sim@v1") == 1


def test_disconnected_caller_frees_its_place(server_factory):
    server = server_factory(
        "--devices", "1", "--sim-hang-marker", "HANG", "--sim-hang-ms", "800", "--gpu-timeout-ms", "60000"
    )

    assert (
        hang_up_behind_a_busy_worker(server.url, "/v1/inference", {"input": "HANG"}, b'{"input": "gone"}', "gone-1")
        == 200
    )
    time.sleep(0.3)
    with server.client() as c:
        record = c.get("/v1/requests/gone-1").json()
        text = c.get("/metrics").text
    assert record["status"] == "failed" and record["error"] == "CLIENT_DISCONNECTED"
    assert metric(text, "batchserve_batch_size_sum", model="sim@v1") == 1


def test_overload_is_refused_at_the_door(server_factory):
    server = server_factory(
        "--devices",
        "1",
        "--sim-hang-marker",
        "HANG",
        "--sim-hang-ms",
        "1000",
        "--gpu-timeout-ms",
        "60000",
        "--max-queue",
        "2",
    )

    async def scenario() -> list[tuple[int, dict, float]]:
        async with aiohttp.ClientSession() as s:
            hang = asyncio.ensure_future(s.post(server.url + "/v1/inference", json={"input": "HANG"}))
            await asyncio.sleep(0.2)
            queued = [
                asyncio.ensure_future(s.post(server.url + "/v1/inference", json={"input": f"q{i}"})) for i in range(2)
            ]
            await asyncio.sleep(0.1)
            t = time.monotonic()
            async with s.post(server.url + "/v1/inference", json={"input": "third"}) as r:
                refused = (r.status, await r.json(), time.monotonic() - t, r.headers.get("Retry-After"))
            for f in [hang, *queued]:
                (await f).release()
            return [refused]

    ((status, body, _, retry_after),) = asyncio.run(scenario())
    assert status == 503 and body["error"] == "SERVICE_OVERLOADED"
    assert body["retry_after_ms"] >= 1 and int(retry_after) >= 1


def test_health_endpoints_and_metrics_names(sim_server):
    with sim_server.client() as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        assert c.get("/readyz").status_code == 200
        health = c.get("/health")  # the name vLLM/TGI/TEI clients (guidellm) probe: the same answer as /readyz
        assert health.status_code == 200 and health.json() == c.get("/readyz").json()
        c.post("/v1/inference", json={"input": "abc"})
        h = c.get("/internal/health").json()
        assert h["status"] == "ok" and len(h["workers"]) == 4
        assert {"gpu_utilization", "queue_depth", "requests_per_second", "workers"} <= h.keys()
        text = c.get("/metrics").text
        models = c.get("/v1/models").json()
    for name in [
        "batchserve_requests_total",
        "batchserve_request_duration_seconds_bucket",
        "batchserve_queue_wait_seconds_bucket",
        "batchserve_batch_compute_seconds_bucket",
        "batchserve_batch_size_bucket",
        "batchserve_queue_depth",
        "batchserve_inflight_requests",
        "batchserve_worker_busy_ratio",
        "batchserve_worker_healthy",
    ]:
        assert name in text, name
    assert metric(text, "batchserve_requests_total", model="sim@v1", status="200") >= 1
    assert models["object"] == "list" and models["data"][0]["id"] == "sim@v1"


@pytest.mark.slow
@pytest.mark.parallel  # readiness and an answer (a 60 s deadline), no timing: CI runs it in the parallel workers
def test_real_model_answers_paris_and_is_not_ready_until_warm():
    server = start_server("--backend", "smollm2", "--max-new-tokens", "24", ready=False, timeout=600)
    try:
        with server.client(timeout=600) as c:
            first = c.get("/readyz")
            assert first.status_code == 503 and first.json()["reason"] == "warming up"
            early = c.post("/v1/inference", json={"input": "hi"})
            assert early.status_code == 503 and early.json()["error"] == "NO_HEALTHY_WORKER"
            give_up = time.monotonic() + 600
            while c.get("/readyz").status_code != 200:
                assert time.monotonic() < give_up and server.proc.poll() is None, server.log()
                time.sleep(0.2)
            r = c.post("/v1/inference", json={"input": "What is the capital of France?", "timeout_ms": 60000})
            assert r.status_code == 200, r.text
            assert "Paris" in r.json()["output"]
            assert r.json()["model"] == "smollm2@v1"
    finally:
        server.stop()
