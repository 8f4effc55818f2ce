"""`/v1/inference` of SmolLM2 on the generation engine's slot stepper (issue 25, item 1), on live servers with
the real weights on the CPU: the answers are transformers `generate`'s, greedy, token for token (as text, the
same decode), for prompts of mixed lengths sent together, more of them than the engine has slots; a batch job
of `/v1/inference` inputs runs there too; and a request whose deadline cannot be met is refused at the door.
(`--inference-path static` answering through the batcher's static batches, as `generate` does, is checked on
the static-path server of tests/integration/generation/test_routes.py.)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time

import httpx
import pytest

from tests.conftest import LiveServer, start_server
from tests.integration.generation.conftest import Reference
from tests.integration.inference.test_routes import metric
from tests.integration.jobs.test_routes import finished, results, wait_for

pytestmark = pytest.mark.slow
MAX_NEW = 24
SLOTS = 2
PROMPTS = [
    "Hi",
    "What is the capital of France?",
    "Name three colours.",
    "Write one sentence about the sea, the wind and the small boats that sail on it every morning before dawn.",
    "What is 2 + 2?",
    "Explain in a few words why the sky is blue, as you would to a child who keeps asking why, again and again, "
    "on a long summer afternoon in the garden.",
]


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory, generate_reference: Reference):
    """(the server, the reference answers): the server loads and warms its model while `generate` answers
    PROMPTS here, in the test process (each alone took ~10 s of the suite, one after the other)."""
    s = start_server(
        "--backend",
        "smollm2",
        "--max-new-tokens",
        str(MAX_NEW),
        "--generation-max-seqs",
        str(SLOTS),
        "--generation-max-context",
        "512",
        "--timeout-ms",
        "120000",
        "--max-timeout-ms",
        "300000",
        "--jobs-db",
        str(tmp_path_factory.mktemp("jobs") / "jobs.db"),
        ready=False,
        timeout=300,
    )
    try:
        answers = generate_reference(PROMPTS, MAX_NEW)
        s.wait_ready(300)
        yield s, answers
    finally:
        s.stop()


@pytest.fixture(scope="module")
def server(started: tuple[LiveServer, dict[str, str]]) -> LiveServer:
    return started[0]


@pytest.fixture(scope="module")
def reference(started: tuple[LiveServer, dict[str, str]]) -> dict[str, str]:
    return started[1]


def engine(server: LiveServer) -> dict:
    return httpx.get(server.url + "/internal/generation").json()


def infer(server: LiveServer, text: str, timeout_ms: int = 120000) -> httpx.Response:
    return httpx.post(server.url + "/v1/inference", json={"input": text, "timeout_ms": timeout_ms}, timeout=180)


def test_mixed_prompts_beyond_the_slots_answer_as_generate_does(server: LiveServer, reference: dict[str, str]) -> None:
    before = engine(server)["generated_tokens"]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda t: infer(server, t), PROMPTS))
    for text, r in zip(PROMPTS, answers):
        assert r.status_code == 200, r.text
        assert r.json()["output"] == reference[text], text
    bodies = [r.json() for r in answers]
    assert all(1 <= b["batch_size"] <= SLOTS for b in bodies), bodies  # the rows of the step each joined
    assert max(b["queue_ms"] for b in bodies) > 0, bodies  # more requests than slots: some waited for one
    assert all(b["compute_ms"] > 0 and b["latency_ms"] >= b["queue_ms"] for b in bodies), bodies
    assert engine(server)["generated_tokens"] > before  # the engine made them, not the batcher
    status = httpx.get(server.url + f"/v1/requests/{bodies[0]['request_id']}").json()
    assert status["status"] == "completed" and status["batch_size"] == bodies[0]["batch_size"]


def test_a_batch_job_of_inference_inputs_runs_on_the_stepper(server: LiveServer, reference: dict[str, str]) -> None:
    inputs = PROMPTS[:4]
    before = engine(server)["generated_tokens"]
    with httpx.Client(base_url=server.url, timeout=30) as c:
        job = c.post("/v1/batches", json={"inputs": inputs})
        assert job.status_code == 202, job.text
        done = wait_for(lambda: finished(c, job.json()["id"]), timeout=240, every=0.2)
        assert done["status"] == "completed" and done["completed"] == len(inputs), done
        assert [line["output"] for line in results(c, done["id"])] == [reference[t] for t in inputs]
    assert engine(server)["generated_tokens"] > before


def test_a_deadline_that_cannot_be_met_is_refused_at_the_door(server: LiveServer) -> None:
    r = infer(server, "Hi", timeout_ms=1)  # shorter than the answer's own generation: no retry can meet it
    assert r.status_code == 504 and r.json()["error"] == "DEADLINE_EXCEEDED" and "retry_after_ms" not in r.json()
    # Both slots held by long generations (~400 steps): a request that must be answered within 5 s would wait
    # for one longer than that, so it is refused now with a hint, rather than failing with 504 later.
    # The holders stream, and hang up once the refusal is checked: their cancel frees the slots at once
    # instead of after the ~400 steps (25 s of the suite on 2 cores) that running them out took.
    long = {
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }

    def cancelled() -> float:
        return metric(
            httpx.get(server.url + "/metrics").text, "batchserve_generation_cancelled_total", reason="client_disconnect"
        )

    before = cancelled()
    with httpx.Client(base_url=server.url, timeout=300) as c, contextlib.ExitStack() as holding:
        held = [holding.enter_context(c.stream("POST", "/v1/chat/completions", json=long)) for _ in range(SLOTS)]
        assert [h.status_code for h in held] == [200] * SLOTS
        wait_for(lambda: engine(server)["running"] == SLOTS and engine(server)["generated_tokens"] > 0, timeout=60)
        time.sleep(0.5)  # a few steps: the engine's step time is measured under this load
        # Long enough for an answer of up to 24 tokens alone (three times over, at the step time measured now:
        # a busy machine makes it ~200 ms), far too short for the ~390 steps the holders have left.
        within_ms = max(5000, int(3 * 24 * engine(server)["step_ms"]))
        refused = infer(server, "Hi", timeout_ms=within_ms)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"] == "SERVICE_OVERLOADED" and refused.json()["retry_after_ms"] > 0
        assert "Retry-After" in refused.headers
        assert engine(server)["running"] == SLOTS  # still held when refused: the refusal was about them
    wait_for(lambda: engine(server)["running"] == 0, timeout=30, every=0.05)
    assert cancelled() == before + SLOTS  # freed by the hang-ups, not run out


def test_health_and_the_load_signals_describe_the_stepper_that_answers(server: LiveServer) -> None:
    """/internal/health gives the stepper model's answer time (not the batcher's unused seed) and says which
    path answers it; a node busy only with stepper /v1/inference reads its engine's load, not ~0."""
    health = httpx.get(server.url + "/internal/health").json()
    assert health["answer_ms"] and health["batch_ms"] == {} and health["batch_ms_by_size"] == {}, health
    assert health["inference_path"] == {m: "stepper" for m in health["answer_ms"]}
    step_ms = engine(server)["step_ms"]
    for ms in health["answer_ms"].values():  # --max-new-tokens (+2) steps at the engine's step time
        assert ms == pytest.approx((MAX_NEW + 2) * step_ms, rel=0.5)
    seen: list[tuple[float, float, float]] = []  # health's load_ratio, its predicted_wait_ratio, /metrics' gauge
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = [pool.submit(infer, server, text) for text in PROMPTS]  # 6 inputs at once for 2 slots
        while not all(a.done() for a in answers):
            h = httpx.get(server.url + "/internal/health").json()
            gauge = metric(httpx.get(server.url + "/metrics").text, "batchserve_load_ratio")
            seen.append((h["load_ratio"], h["predicted_wait_ratio"], gauge))
            time.sleep(0.05)
    assert all(a.result().status_code == 200 for a in answers)
    # the slots were full with more waiting: demand at or past the engine's capacity, and a wait predicted
    assert max(s[0] for s in seen) >= 1.0, seen
    assert max(s[2] for s in seen) >= 1.0, seen
    assert max(s[1] for s in seen) > 0, seen
    idle = httpx.get(server.url + "/internal/health").json()
    assert idle["load_ratio"] == 0 and idle["predicted_wait_ratio"] == 0, idle
