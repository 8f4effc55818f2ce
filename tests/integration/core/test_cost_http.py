"""Predictions that hold on real models (issue 22) and long inputs that stay their sender's problem (issue 28
item 1), through real servers and HTTP: a warm-up with one slow round does not lock the model out, a burst
within capacity right after start is queued, a 2,048-input embeddings request is served on an idle minilm, and
one client's long minilm inputs do not take the worker from another client's short ones."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path

import aiohttp
import httpx
import pytest

from tests.conftest import start_server
from tests.integration.backends.test_plugin import write_plugins
from tests.integration.http.test_tenancy import add_key

# An unsteady plugin (rounds of 50 and 80 ms in turn never agree within 15 %) whose 8th call — the last warm-up
# round — takes 2.5 s; call 9 is the answer check, and every batch served after it takes 0.5 s. The slower of the
# last two rounds (the old figure) is 2.5 s, past --max-timeout-ms 2000: every request was refused "timeout_ms is
# shorter than one batch". The median of the rounds after the first is 80 ms.
SLOW_ROUND = """
import time
calls = [0]

def batch(inputs):
    calls[0] += 1
    n = calls[0]
    time.sleep(2.5 if n == 8 else 0.5 if n > 9 else (0.05 if n % 2 else 0.08))
    return [s.upper() for s in inputs]
"""


def test_one_slow_warm_up_round_does_not_lock_the_model_out(tmp_path: Path) -> None:
    """Ten requests at once right after start are all answered. Sent one at a time they would not tell: the door
    lets an idle model run one probe request past a figure that says no batch fits (PROBE_EVERY_S), and that
    batch's own time replaces the figure, so with the old figure too every later lone request ran. Sent together,
    the nine that arrive while the probe's 0.5 s batch runs meet the old 2.5 s figure and were refused 504 (1 of
    10 answered); with the robust figure they are queued and run in the next batch (about 1 s, within the 2 s
    timeout). `--slo-ms` is set so the SLO bound admits a second 0.5 s batch whatever the figure."""
    env = write_plugins(tmp_path, slowround=SLOW_ROUND)
    server = start_server(
        "--backend", "slowround:batch", "--max-timeout-ms", "2000", "--slo-ms", "1500", env=env, timeout=120
    )
    try:
        warmed = [line for line in server.log_lines if "warmed" in line]
        assert warmed and re.search(r", 2\d{3} ms \(not stable\)$", warmed[0]), warmed  # the last round: 2.5 s

        async def at_once() -> list[tuple[int, str]]:
            async with aiohttp.ClientSession() as session:

                async def one(i: int) -> tuple[int, str]:
                    async with session.post(server.url + "/v1/inference", json={"input": f"x{i}"}) as r:
                        return r.status, await r.text()

                return list(await asyncio.gather(*(one(i) for i in range(10))))

        answers = asyncio.run(at_once())
        assert [status for status, _ in answers] == [200] * 10, answers
    finally:
        server.stop()


# 30 ms a batch plus 1 ms an input: a burst of 60 is two short batches.
STEADY = """
import time

def batch(inputs):
    time.sleep(0.03 + 0.001 * len(inputs))
    return [s.upper() for s in inputs]
"""


def test_a_burst_within_capacity_right_after_start_is_queued(tmp_path: Path) -> None:
    env = write_plugins(tmp_path, steady=STEADY)
    server = start_server("--backend", "steady:batch", env=env, timeout=120)
    try:

        async def burst() -> list[int]:
            async with aiohttp.ClientSession() as session:

                async def one(i: int) -> int:
                    async with session.post(server.url + "/v1/inference", json={"input": f"b{i}"}) as r:
                        await r.read()
                        return r.status

                return list(await asyncio.gather(*(one(i) for i in range(60))))

        codes = asyncio.run(burst())
        assert codes.count(200) == 60, (sorted(set(codes)), server.log())
    finally:
        server.stop()


@pytest.mark.slow
def test_minilm_many_inputs_are_served_and_long_inputs_do_not_take_the_worker_from_short_ones(tmp_path: Path) -> None:
    config = tmp_path / "bs.toml"
    config.write_text('[[models]]\nname = "minilm"\nbackend = "minilm"\n')
    keys = {
        tenant: {"Authorization": f"Bearer {add_key(config, tenant, 'paid', '--rate', '100000')}"}
        for tenant in ("long", "short")
    }
    server = start_server("--config", str(config), timeout=300)
    try:
        # 2,048 inputs (the documented limit) on an idle server, with a timeout their batches fit: served.
        inputs = [f"item {i} of the list" for i in range(2048)]
        r = httpx.post(
            server.url + "/v1/embeddings",
            json={"input": inputs, "timeout_ms": 60000},
            timeout=120,
            headers=keys["short"],
        )
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == 2048

        # One tenant sends 60 inputs of 16,384 characters every 2 s (within every limit, a long timeout); another
        # a short sentence every 0.1 s. The long batches are expected to be long: no false hang mark, and the
        # short tenant never meets NO_HEALTHY_WORKER or a 504 after admission.
        long_text = ("lorem ipsum dolor sit amet " * 700)[:16384]
        stop = time.monotonic() + 12
        long_codes: list[int] = []
        short_codes: list[str] = []

        def long_client() -> None:
            with httpx.Client(base_url=server.url, timeout=90, headers=keys["long"]) as c:
                while True:
                    rr = c.post("/v1/embeddings", json={"input": [long_text] * 60, "timeout_ms": 60000})
                    long_codes.append(rr.status_code)
                    if time.monotonic() + 2.0 >= stop:  # the next would start past the end: not a last idle 2 s
                        break
                    time.sleep(2.0)

        thread = threading.Thread(target=long_client)
        thread.start()
        with httpx.Client(base_url=server.url, timeout=30, headers=keys["short"]) as c:
            while time.monotonic() < stop:
                rr = c.post("/v1/embeddings", json={"input": "a short sentence to embed"})
                short_codes.append(
                    str(rr.status_code) if rr.status_code != 503 else rr.json()["error"].get("code") or "503"
                )
                time.sleep(0.1)
        thread.join(timeout=120)
        log = server.log()
        assert "marked unhealthy" not in log, log
        assert not any(code in ("NO_HEALTHY_WORKER", "504") for code in short_codes), short_codes
        assert short_codes.count("200") >= len(short_codes) / 2, short_codes  # the rest: 503 at the door
        assert long_codes and 500 not in long_codes and 504 not in long_codes, long_codes
    finally:
        server.stop()


# A backend whose batch costs the sum of its inputs' words (no padding), declared as cost_of_batch. A batch with
# "slow" in it takes 0.6 s, so the inputs sent meanwhile queue together and the test sees how they are batched.
SUMMED = """
import time


class Summed:
    def cost_of_batch(self, texts):
        return float(sum(len(t.split()) for t in texts))

    def batch(self, inputs):
        time.sleep(0.6 if "slow" in inputs else 0.02)
        return [s.upper() for s in inputs]
"""


def test_a_plugin_declaring_cost_of_batch_is_budgeted_and_admitted_by_it(tmp_path: Path) -> None:
    env = write_plugins(tmp_path, summed=SUMMED)
    server = start_server(
        "--backend", "summed:Summed", "--max-batch-tokens", "100", "--slo-ms", "5000", env=env, timeout=120
    )  # a long objective: the 0.6 s batch lowers no budget
    try:

        async def queued_together() -> list[tuple[int, int]]:
            async with aiohttp.ClientSession() as session:

                async def one(text: str, delay: float) -> tuple[int, int]:
                    await asyncio.sleep(delay)
                    async with session.post(
                        server.url + "/v1/inference", json={"input": text, "timeout_ms": 20000}
                    ) as r:
                        body = await r.json()
                        return r.status, body.get("batch_size", 0)

                # While "slow" runs, one input of 40 words and ten of 4 queue. Summed they cost 80, within the
                # budget: one batch of 11. Padded (rows x longest) the long input's batch would hold 2.
                texts = [" ".join(["w"] * 40)] + ["a b c d"] * 10
                return list(await asyncio.gather(one("slow", 0.0), *(one(t, 0.2) for t in texts)))

        answers = asyncio.run(queued_together())
        assert [status for status, _ in answers] == [200] * 12, (answers, server.log())
        assert [size for _, size in answers[1:]] == [11] * 11, (answers, server.log())
        with httpx.Client(base_url=server.url, timeout=30) as c:
            # An input that alone costs more than a batch may (by its declared cost): 413 at the door, and the
            # server goes on serving.
            r = c.post("/v1/inference", json={"input": " ".join(["w"] * 120)})
            assert r.status_code == 413, r.text
            assert set(r.json()) >= {"error", "message", "request_id"}
            assert c.post("/v1/inference", json={"input": "still here"}).status_code == 200
    finally:
        server.stop()
