"""OpenAI Batch API lines for /v1/chat/completions and /v1/completions (issue 26, item 1), with the official
`openai` client against a live `--backend smollm2` server: each line runs on the generation engine and is
answered with the body the online route gives for the same request (greedy, so the same text and usage), a bad
body goes to the error file, and lines refused for KV capacity wait for it (issue 33), not failed.

The engine is made tiny (one sequence at a time, one waiting: `--generation-max-seqs 1 --max-queue 1`) so a
batch of six lines is always partly refused for capacity when its lines start together."""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

import httpx

import orjson
import pytest

from tests.conftest import LiveServer, start_server

if TYPE_CHECKING:
    import openai

pytestmark = [pytest.mark.slow, pytest.mark.parallel]  # the real model; answers only, no timing: the parallel workers

MODEL = "SmolLM2-135M-Instruct"
COUNTRIES = ("France", "Italy", "Japan", "Peru")
PROMPTS = ("The capital of Spain is", "One, two, three,")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("gen-batch")
    s = start_server(
        "--backend",
        "smollm2",
        "--max-new-tokens",
        "8",
        "--generation-max-seqs",
        "1",
        "--max-queue",
        "1",
        "--generation-max-context",
        "512",
        "--jobs-db",
        str(tmp / "jobs.db"),
        "--jobs-retry-base-ms",
        "20",
        "--jobs-max-attempts",
        "200",
        timeout=180,
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="any", max_retries=0, timeout=60)


def chat_body(country: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"What is the capital of {country}?"}],
        "max_tokens": 8,
        "temperature": 0,
    }


def completion_body(prompt: str) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}


def run_batch(client: openai.OpenAI, endpoint: str, bodies: dict[str, dict]) -> Any:
    lines = [{"custom_id": cid, "method": "POST", "url": endpoint, "body": body} for cid, body in bodies.items()]
    content = b"".join(orjson.dumps(line) + b"\n" for line in lines)
    f = client.files.create(file=("in.jsonl", content, "application/jsonl"), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")  # type: ignore
    give_up = time.monotonic() + 240
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < give_up, f"batch {batch.id} still {batch.status}"
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    return batch


def lines_of(client: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    rows = [orjson.loads(line) for line in client.files.content(file_id).content.splitlines()]
    return {r["custom_id"]: r for r in rows}


def same_answer(body: dict) -> dict:
    """What a greedy answer must repeat: everything but its id and creation time."""
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def refused_for_capacity(server: LiveServer) -> float:
    text = httpx.get(server.url + "/metrics").text
    m = re.search(r'^batchserve_generation_rejected_total\{reason="queue_full"\} ([0-9.e+]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_chat_and_completion_lines_answer_as_the_online_route(server: LiveServer, client: openai.OpenAI) -> None:
    chats = {f"chat-{c}": chat_body(c) for c in COUNTRIES}
    completions = {f"cmpl-{i}": completion_body(p) for i, p in enumerate(PROMPTS)}
    with httpx.Client(base_url=server.url, timeout=60) as http:  # the online answers first, one at a time
        online = {cid: http.post("/v1/chat/completions", json=b).json() for cid, b in chats.items()}
        online |= {cid: http.post("/v1/completions", json=b).json() for cid, b in completions.items()}
    assert all("choices" in body for body in online.values()), online
    before = refused_for_capacity(server)

    bad = {"bad": {**chat_body("Chile"), "temperature": 7}}  # the route's 400: the line's, in the error file
    batch = run_batch(client, "/v1/chat/completions", chats | bad)
    assert batch.status == "completed" and batch.model == MODEL
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (5, 4, 1)
    out = lines_of(client, batch.output_file_id)
    assert set(out) == set(chats)
    for cid, line in out.items():
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        assert same_answer(body) == same_answer(online[cid]), cid
    err = lines_of(client, batch.error_file_id)["bad"]
    assert err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"]["param"] == "temperature"

    batch = run_batch(client, "/v1/completions", completions)
    assert batch.status == "completed" and batch.request_counts.completed == 2 and batch.error_file_id is None
    for cid, line in lines_of(client, batch.output_file_id).items():
        body = line["response"]["body"]
        assert body["object"] == "text_completion"
        assert same_answer(body) == same_answer(online[cid]), cid
    # One sequence at a time and one waiting: lines that started together were refused for KV capacity (503),
    # waited for it (`jobs/lines.py`: backoff within the batch's completion window), and none failed for it.
    assert refused_for_capacity(server) > before


def test_an_unknown_model_is_refused_at_creation(server: LiveServer, client: openai.OpenAI) -> None:
    body = {**completion_body("x"), "model": "no-such-model"}
    line = orjson.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body}) + b"\n"
    f = client.files.create(file=("in.jsonl", line, "application/jsonl"), purpose="batch")
    r = httpx.post(
        server.url + "/v1/batches",
        json={"input_file_id": f.id, "endpoint": "/v1/completions", "completion_window": "24h"},
    )
    assert r.status_code == 404 and set(r.json()) >= {"error", "message", "request_id"}, r.text
