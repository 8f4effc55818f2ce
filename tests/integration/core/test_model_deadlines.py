"""Each model its own SLO and timeouts on a live server (issue 46 item 7): two models of very different batch
times, a fast one and a slow one (the same plugin with a different batch sleep; neither declares its batch time,
so each is warmed and measured as a real model is). An embedder beside a chat model once logged `slo_ms=205`, then
ran under the chat model's `slo_ms=29411 ... timeout_ms=60000`: here the fast model's requests must get the fast
model's default deadline and be held to its SLO, not the slow one's. (The arithmetic on injected figures:
tests/unit/core/test_model_deadlines.py.)"""

from __future__ import annotations

import re
import time

import pytest

from tests.conftest import LiveServer
from tests.integration.backends.test_plugin import write_plugins
from tests.integration.inference.test_routes import metric

SLEEPER = """
import time


class Sleeper:
    \"\"\"A batch of `batch_ms`; an input "sleep:N" makes its batch N ms longer.\"\"\"

    def __init__(self, batch_ms=5):
        self.batch_s = batch_ms / 1000

    def batch(self, inputs):
        extra = max((float(t.split(":", 1)[1]) for t in inputs if t.startswith("sleep:")), default=0.0)
        time.sleep(self.batch_s + extra / 1000)
        return [t[::-1] for t in inputs]
"""

CONFIG = """
[[models]]
name = "fast"
backend = "sleeper:Sleeper"
[models.options]
batch_ms = 5

[[models]]
name = "slow"
backend = "sleeper:Sleeper"
[models.options]
batch_ms = 400
"""

FAST, SLOW = "fast@v1", "slow@v1"
LINE = re.compile(
    r"deadlines of (\S+) from the warm-up batch time (\d+) ms: slo_ms=(\d+) \(derived\) timeout_ms=(\d+) \(derived\) "
    r"max_timeout_ms=(\d+) \(default\)"
)


@pytest.fixture
def server(server_factory, tmp_path) -> LiveServer:
    env = write_plugins(tmp_path, sleeper=SLEEPER)
    (tmp_path / "models.toml").write_text(CONFIG)
    # One worker; a batch held long on purpose below must not mark it hung (the derived limit is 10 x S).
    return server_factory(
        "--config", str(tmp_path / "models.toml"), "--devices", "1", "--gpu-timeout-ms", "30000", env=env
    )


def logged(server: LiveServer) -> dict[str, tuple[float, ...]]:
    """Each model's start-up line: (batch ms, slo_ms, timeout_ms, max_timeout_ms)."""
    give_up = time.monotonic() + 10  # the log reader may be a line behind /readyz
    while True:
        found = {m.group(1): tuple(float(x) for x in m.groups()[1:]) for m in LINE.finditer(server.log())}
        if len(found) == 2 or time.monotonic() > give_up:
            return found


def test_each_model_has_its_own_slo_and_default_timeout(server: LiveServer) -> None:
    lines = logged(server)
    assert set(lines) == {FAST, SLOW}, server.log()
    (fast_batch, fast_slo, fast_timeout, _), (slow_batch, slow_slo, slow_timeout, _) = lines[FAST], lines[SLOW]
    assert fast_batch < 100 <= 400 <= slow_batch, lines
    assert (fast_slo, fast_timeout) == (200, 2000)  # 3 and 10 batches of its own are below the floors
    assert slow_slo == pytest.approx(3 * slow_batch, abs=1) and slow_timeout == pytest.approx(10 * slow_batch, abs=5)
    assert slow_slo > 1000 and slow_timeout > 3500, lines

    with server.client() as c:
        health = c.get("/internal/health").json()
        cards = {card["id"]: card for card in c.get("/v1/models").json()["data"]}
    assert health["slo_ms"] == {FAST: fast_slo, SLOW: slow_slo}
    assert health["timeout_ms"] == {FAST: fast_timeout, SLOW: slow_timeout}
    assert health["max_timeout_ms"] == {FAST: 60000, SLOW: 60000}
    for model, slo, timeout in ((FAST, fast_slo, fast_timeout), (SLOW, slow_slo, slow_timeout)):
        assert (cards[model]["slo_ms"], cards[model]["timeout_ms"], cards[model]["max_timeout_ms"]) == (
            slo,
            timeout,
            60000,
        ), cards

    with server.client() as c:
        # The SLO ledger holds each model's answers to its own SLO: 600 ms is slow for the fast model (200 ms),
        # while the slow model's ~400 ms answer meets its ~1200 ms (under one shared SLO both would be met).
        fast = c.post("/v1/inference", json={"input": "sleep:600", "model": "fast", "timeout_ms": 5000})
        slow = c.post("/v1/inference", json={"input": "x", "model": "slow"})
        assert fast.status_code == slow.status_code == 200, (fast.text, slow.text)
        assert fast_slo < fast.json()["latency_ms"] and slow.json()["latency_ms"] < slow_slo, (fast.json(), slow.json())
        text = c.get("/metrics").text
        series = "batchserve_slo_requests_total"
        assert metric(text, series, model=FAST, tier="paid", outcome="slow") == 1
        assert metric(text, series, model=FAST, tier="paid", outcome="met") == 0
        assert metric(text, series, model=SLOW, tier="paid", outcome="met") == 1

        # A request naming no timeout is due at its own model's default: a 3 s answer of the fast model is 504 at
        # its 2 s, though the slow model's default (~4 s) would have let it finish.
        began = time.monotonic()
        late = c.post("/v1/inference", json={"input": "sleep:3000", "model": "fast"})
        took = time.monotonic() - began
    assert late.status_code == 504 and late.json()["error"] == "DEADLINE_EXCEEDED", late.text
    assert fast_timeout / 1000 - 0.1 <= took < 2.9, took
