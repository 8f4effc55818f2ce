"""`/v1/inference` of SmolLM2 on the generation engine's stepper, as operators see it (follow-up of issue 25): its
answers feed the batch path's Prometheus series and OpenTelemetry spans, and the static batch backend it no
longer uses is neither loaded nor warmed (while the model's card, readiness, derived deadlines and batch jobs
stay as they were). A live server with the real weights on the CPU, tracing to an OTLP receiver this test runs.
"""

from __future__ import annotations

import concurrent.futures
import re
import secrets

import httpx
import pytest

from tests.conftest import LiveServer, start_server
from tests.integration.inference.test_routes import metric
from tests.integration.jobs.test_routes import finished, wait_for as wait_until
from tests.integration.test_tracing import Receiver, attrs, wait_for

# answers, metrics, spans and log lines only, no timing: CI runs it in the parallel workers (.ci/run)
pytestmark = [pytest.mark.slow, pytest.mark.parallel]
MAX_NEW = 8
SLOTS = 2
PROMPTS = ["Hi", "What is 2 + 2?", "Name a colour.", "Say yes."]


@pytest.fixture(scope="module")
def server(receiver: Receiver, tmp_path_factory: pytest.TempPathFactory):
    # No --timeout-ms / --slo-ms: the deadlines are derived, now from the stepper's answer time.
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.server_port}", "OTEL_BSP_SCHEDULE_DELAY": "50"}
    s = start_server(
        "--backend",
        "smollm2",
        "--max-new-tokens",
        str(MAX_NEW),
        "--generation-max-seqs",
        str(SLOTS),
        "--generation-max-context",
        "256",
        "--jobs-db",
        str(tmp_path_factory.mktemp("jobs") / "jobs.db"),
        env=env,
        timeout=300,
    )
    yield s
    s.stop()


def model_id(server: LiveServer) -> str:
    cards = httpx.get(server.url + "/v1/models").json()["data"]
    return next(c["id"] for c in cards if c.get("backend") == "smollm2")


def infer(server: LiveServer, text: str, **kw: object) -> httpx.Response:
    return httpx.post(server.url + "/v1/inference", json={"input": text, **kw}, timeout=120)


def test_the_static_batch_backend_is_neither_loaded_nor_warmed(server: LiveServer) -> None:
    wait_until(lambda: "batchserve ready: " in server.log(), timeout=10)  # the log reader may be a line behind /readyz
    log = server.log()
    model = model_id(server)
    assert f"not loading {model}'s batch backend" in log, log
    assert f"loading {model} (backend smollm2)" not in log and f"warm-up round 1 of {model}" not in log, log
    # What reads the model's backend still does: its card (output kind), readiness, the derived default deadline.
    card = next(c for c in httpx.get(server.url + "/v1/models").json()["data"] if c["id"] == model)
    assert card["output_kind"] == "text"
    assert httpx.get(server.url + "/readyz").status_code == 200
    # The deadlines left unset follow an answer's time on the stepper: (max_new_tokens + 2) warm-up steps.
    step = re.search(r"generation ready: .*, ([\d.]+) ms/step", log)
    derived = re.search(
        rf"deadlines of {re.escape(model)} from the stepper's answer time (\d+) ms: slo_ms=(\d+) \(derived\) "
        r"timeout_ms=(\d+) \(derived\)",
        log,
    )
    assert step and derived, log
    answer_ms, slo_ms, timeout_ms = (float(x) for x in derived.groups())
    assert answer_ms == pytest.approx((MAX_NEW + 2) * float(step.group(1)), abs=MAX_NEW + 2)  # ms/step rounded
    assert slo_ms == pytest.approx(max(200, 3 * answer_ms), abs=2)
    assert timeout_ms == pytest.approx(min(60000, max(2000, 10 * answer_ms, slo_ms)), abs=5)
    h = httpx.get(server.url + "/internal/health").json()
    assert (h["slo_ms"][model], h["timeout_ms"][model]) == (slo_ms, timeout_ms)
    r = infer(server, "Hi")  # the body names no timeout: the derived default must leave room for the answer
    assert r.status_code == 200 and r.json()["output"], r.text


def test_kserve_reads_the_shell_and_answers_through_the_stepper(server: LiveServer) -> None:
    name = model_id(server).split("@")[0]
    assert httpx.get(server.url + f"/v2/models/{name}/ready").status_code == 200
    assert httpx.get(server.url + f"/v2/models/{name}").json()["outputs"][0]["datatype"] == "BYTES"
    generated = httpx.get(server.url + "/internal/generation").json()["generated_tokens"]
    body = {
        "inputs": [{"name": "input", "datatype": "BYTES", "shape": [1], "data": ["Hi"]}],
        "parameters": {"timeout": 60_000_000},
    }
    r = httpx.post(server.url + f"/v2/models/{name}/infer", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["outputs"][0]["data"][0], r.text
    assert httpx.get(server.url + "/internal/generation").json()["generated_tokens"] > generated  # the engine's


def test_a_batch_job_runs_with_no_static_backend(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        job = c.post("/v1/batches", json={"inputs": PROMPTS[:2]})
        assert job.status_code == 202, job.text
        done = wait_until(lambda: finished(c, job.json()["id"]), timeout=240, every=0.2)
        assert done["status"] == "completed" and done["completed"] == 2, done


def test_stepper_answers_feed_the_batch_paths_histograms(server: LiveServer) -> None:
    model = model_id(server)
    before = httpx.get(server.url + "/metrics").text
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # more than the slots: some wait for one
        answers = list(pool.map(lambda t: infer(server, t, timeout_ms=60000), PROMPTS))
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    after = httpx.get(server.url + "/metrics").text

    def grew(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    n = len(PROMPTS)
    assert grew("batchserve_requests_total", model=model, status="200") == n
    assert grew("batchserve_request_duration_seconds_count", model=model) == n
    assert grew("batchserve_queue_wait_seconds_count", model=model) == n
    assert grew("batchserve_batch_compute_seconds_count", model=model) == n
    assert grew("batchserve_batch_size_count", model=model) == n
    bodies = [r.json() for r in answers]
    # The sums are the answers' own figures: rows joined, seconds queued and computing.
    assert grew("batchserve_batch_size_sum", model=model) == sum(b["batch_size"] for b in bodies)
    assert grew("batchserve_queue_wait_seconds_sum", model=model) == pytest.approx(
        sum(b["queue_ms"] for b in bodies) / 1000, abs=0.002 * n
    )
    assert grew("batchserve_batch_compute_seconds_sum", model=model) == pytest.approx(
        sum(b["compute_ms"] for b in bodies) / 1000, abs=0.002 * n
    )
    # A refusal is counted as one on the batch path is.
    refused = infer(server, "Hi", timeout_ms=1)
    assert refused.status_code == 504
    assert metric(httpx.get(server.url + "/metrics").text, "batchserve_requests_total", model=model, status="504") >= 1


def test_stepper_answers_make_the_batch_paths_spans(server: LiveServer, receiver: Receiver) -> None:
    model = model_id(server)
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    r = httpx.post(
        server.url + "/v1/inference",
        json={"input": "Hi", "timeout_ms": 60000},
        timeout=120,
        headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
    )
    assert r.status_code == 200, r.text

    def complete(spans):
        mine = [s for s in spans if s.trace_id.hex() == trace_id]
        request = [s for s in mine if s.name == "POST /v1/inference"]
        queue = [s for s in mine if s.name == "queue"]
        batch = [
            s
            for s in spans
            if s.name == f"batch {model}" and request and any(link.span_id == request[0].span_id for link in s.links)
        ]
        return (request[0], queue[0], batch[0]) if request and queue and batch else None

    found, spans = wait_for(receiver, complete)
    assert found, [(s.name, s.trace_id.hex()) for s in spans]
    request, queue, batch = found
    a = attrs(request)
    assert a["gen_ai.request.model"] == model and a["batchserve.tier"] == "paid" and a["batchserve.outcome"] == "ok"
    assert queue.parent_span_id == request.span_id
    assert [link.span_id for link in queue.links] == [batch.span_id]
    # It waited, then it ran (spans are stamped in wall time converted from the monotonic clock at each call:
    # a few ms of slack for a busy machine between the two readings).
    assert queue.end_time_unix_nano <= batch.start_time_unix_nano + 20_000_000
    b = attrs(batch)
    assert b["batchserve.path"] == "stepper" and b["batchserve.worker"] == "stepper"
    assert b["batchserve.batch.size"] == b["batchserve.stepper.rows"] == r.json()["batch_size"]
    assert 1 <= b["gen_ai.usage.output_tokens"] <= MAX_NEW
    assert (batch.end_time_unix_nano - batch.start_time_unix_nano) / 1e6 == pytest.approx(
        r.json()["compute_ms"], abs=20.0
    )


def test_each_process_of_a_group_leaves_the_static_backend_unloaded(server_factory) -> None:
    # `--processes N` loads its models in each child before the runtime starts: the wiring hands them the choice.
    s = server_factory(
        "--backend",
        "smollm2",
        "--processes",
        "2",
        "--devices",
        "2",
        "--max-new-tokens",
        str(MAX_NEW),
        "--generation-max-seqs",
        "1",
        "--generation-max-context",
        "256",
        "--jobs-db",
        "",
        timeout=300,
    )
    with httpx.Client(base_url=s.url, timeout=120) as c:
        wait_until(lambda: c.get("/readyz").status_code == 200, timeout=240, every=0.2)
        r = c.post("/v1/inference", json={"input": "Hi", "timeout_ms": 60000})
        assert r.status_code == 200 and r.json()["output"], r.text
    wait_until(lambda: s.log().count("not loading smollm2@v1's batch backend") == 2, timeout=240, every=0.2)
    assert "loading smollm2@v1 (backend smollm2)" not in s.log() and "warm-up round" not in s.log(), s.log()
