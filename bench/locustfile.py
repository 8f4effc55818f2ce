"""Locust users for batchserve: each posts distinct inputs to /v1/inference and checks the reversed answer.

Why both this and `loadgen.py`: locust users are closed-loop (each waits for its answer, then thinks), which is
how interactive callers behave and what locust's web UI is good at showing; `loadgen.py` is the open-loop
Poisson source the standard table uses. Only point it at 127.0.0.1.

    locust -f bench/locustfile.py --host http://127.0.0.1:8000                       # web UI on :8089
    locust -f bench/locustfile.py --host http://127.0.0.1:8000 --headless -u 200 -r 50 -t 30s

BENCH_WAIT_S (default 0.1) sets each user's think time between requests; BENCH_TIMEOUT_MS, when set, is sent
as the request's `timeout_ms`.
"""

from __future__ import annotations

import itertools
import os
import secrets

import orjson
from locust import constant, events, task
from locust.contrib.fasthttp import FastHttpUser

WAIT_S = float(os.environ.get("BENCH_WAIT_S", "0.1"))
TIMEOUT_MS = os.environ.get("BENCH_TIMEOUT_MS")
_counter = itertools.count()
_tag = secrets.token_hex(4)  # per locust process, so inputs stay distinct across worker processes


@events.init.add_listener
def _loopback_only(environment, **_kw) -> None:
    host = (environment.host or "").split("//", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]
    if host and host not in ("127.0.0.1", "localhost", "[::1]"):
        raise SystemExit("batchserve's locustfile only loads 127.0.0.1")


class InferenceUser(FastHttpUser):
    """One caller: a distinct input per request, the answer must be that input reversed."""

    wait_time = constant(WAIT_S)
    connection_timeout = 5.0
    network_timeout = 10.0

    @task
    def infer(self) -> None:
        text = f"{_tag}-{next(_counter):08d}-locust ÿ→"
        body: dict = {"input": text}
        if TIMEOUT_MS:
            body["timeout_ms"] = int(TIMEOUT_MS)
        with self.client.post("/v1/inference", data=orjson.dumps(body),
                              headers={"Content-Type": "application/json"}, name="/v1/inference",
                              catch_response=True) as resp:
            if resp.status_code != 200:
                try:
                    code = orjson.loads(resp.content or b"{}").get("error", "?")
                except orjson.JSONDecodeError:
                    code = "non-JSON"
                resp.failure(f"{resp.status_code} {code}")
                return
            try:
                output = orjson.loads(resp.content).get("output")
            except orjson.JSONDecodeError:
                resp.failure("200 non-JSON")
                return
            if output != text[::-1]:
                resp.failure("mismatch: the answer is not this input reversed")
            else:
                resp.success()
