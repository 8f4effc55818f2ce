"""The README's first command on the real model (issue 9 §3): `batchserve serve --backend smollm2` and nothing
else (generation off here only to spare a second model load). Its SLO and timeout come from the stable warm-up
batch time, so the longest answer is not cut off at the sim's 2 s; an idle server admits at once; and a batch
whose only caller hung up stops between generation steps instead of holding the worker."""

from __future__ import annotations

import json
import re
import statistics
import socket
import time

import httpx
import pytest

from tests.conftest import LiveServer, start_server
from tests.integration.inference.test_routes import metric

# Serial as well as slow: the deadlines follow from the warm-up batch time, which three busy workers beside it
# stretched 4x (the static path measured 88 s a batch and refused a 106-token input as too long).
pytestmark = [pytest.mark.slow, pytest.mark.serial]
STORY = "Write a long story about a dragon who learns to fly."


@pytest.fixture(scope="module")
def server():
    s = start_server("--backend", "smollm2", "--generation", "off", timeout=900)
    yield s
    s.stop()


def health(server: LiveServer) -> dict:
    return httpx.get(server.url + "/internal/health").json()


def log_line(server: LiveServer, needle: str, within_s: float = 10) -> str:
    """The first log line holding `needle`; the reader thread may still be a line or two behind /readyz."""
    give_up = time.monotonic() + within_s
    while not (found := [line for line in server.log_lines if needle in line]):
        assert time.monotonic() < give_up, f"no log line with {needle!r}:\n" + server.log()[-3000:]
        time.sleep(0.05)
    return found[0]


def test_deadlines_are_derived_from_the_stable_warm_up(server: LiveServer) -> None:
    warmed = re.search(r"warmed smollm2@v1 on \S+: ([\d, ]+) ms", log_line(server, "warmed smollm2@v1"))
    assert warmed
    rounds = [float(x) for x in warmed.group(1).split(", ")]
    line = log_line(server, "deadlines of smollm2@v1 from the warm-up")
    derived = re.search(r"batch time (\d+) ms: slo_ms=(\d+) \(derived\) timeout_ms=(\d+) \(derived\)", line)
    assert derived, line
    batch_ms, slo_ms, timeout_ms = (float(x) for x in derived.groups())
    # the median of the rounds after the cold first one (issue 22: one slow round no longer sets it)
    assert len(rounds) >= 2 and batch_ms == pytest.approx(statistics.median(rounds[1:]), abs=1), (rounds, batch_ms)
    assert slo_ms == pytest.approx(max(200, 3 * batch_ms), abs=2)
    assert timeout_ms == pytest.approx(min(60000, max(2000, 10 * batch_ms, slo_ms)), abs=5)
    h = health(server)
    assert (h["slo_ms"]["smollm2@v1"], h["timeout_ms"]["smollm2@v1"]) == (slo_ms, timeout_ms)


def test_the_longest_answer_fits_the_default_timeout(server: LiveServer) -> None:
    r = httpx.post(server.url + "/v1/inference", json={"input": STORY}, timeout=300)
    assert r.status_code == 200, r.text
    assert len(r.json()["output"]) > 40  # a long answer (all of --max-new-tokens), not a 504 after 2 s
    capital = httpx.post(server.url + "/v1/inference", json={"input": "What is the capital of France?"}, timeout=300)
    assert capital.status_code == 200 and "Paris" in capital.json()["output"]


def test_a_batch_whose_caller_left_stops_between_steps(server: LiveServer) -> None:
    batch_ms = health(server)["batch_ms"]["smollm2@v1"]
    before = metric(
        httpx.get(server.url + "/metrics").text, "batchserve_batches_stopped_early_total", model="smollm2@v1"
    )
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"input": STORY}).encode()
    with socket.create_connection((host, int(port))) as caller:
        caller.sendall(
            b"POST /v1/inference HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        give_up = time.monotonic() + 2 * batch_ms / 1000  # at most one pace interval in the queue
        while not health(server)["workers"][0]["busy"]:  # hang up once its batch runs, not while it queues
            assert time.monotonic() < give_up, "the batch never started"
            time.sleep(0.02)
    after = httpx.post(server.url + "/v1/inference", json={"input": "What is the capital of France?"}, timeout=300)
    assert after.status_code == 200 and "Paris" in after.json()["output"]
    metrics = httpx.get(server.url + "/metrics").text
    assert metric(metrics, "batchserve_batches_stopped_early_total", model="smollm2@v1") == before + 1
    assert after.json()["queue_ms"] < batch_ms / 2, after.json()  # it did not wait for the abandoned batch
