"""Defaults that fit the backend (issue 9 §3): the warm-up runs until the batch time is stable, SLO and timeout
follow from it where the user set neither, and a batch whose callers all left stops early and frees its worker.

The policy has unit tests with an injected clock; the early stop runs through a live sim server (the sim honours
the same hook as the real model's generation, which tests/test_real_defaults.py checks on the weights).
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import httpx
import pytest

from batchserve.config import Settings
from batchserve.backends.warmup import MAX_ROUNDS, derive_deadlines, warm_until_stable
from tests.test_api import metric


class FakeModel:
    """A warm-up whose rounds take the given times on a clock that only it moves."""

    def __init__(self, rounds: list[float]) -> None:
        self.rounds, self.now, self.calls = list(rounds), 0.0, 0

    def clock(self) -> float:
        return self.now

    def warm(self) -> None:
        self.now += self.rounds[min(self.calls, len(self.rounds) - 1)]
        self.calls += 1


def test_a_cold_first_batch_is_not_the_batch_time() -> None:
    model = FakeModel([15.0, 2.0, 1.1, 1.0, 9.0])
    warm = warm_until_stable(model.warm, model.clock)
    assert warm.stable and model.calls == 4
    assert warm.batch_s == pytest.approx(1.1)  # the slower of the two that agree, never the cold 15 s


def test_an_unsteady_warm_up_stops_at_its_bound() -> None:
    model = FakeModel([1.0, 2.0] * 10)
    warm = warm_until_stable(model.warm, model.clock)
    assert not warm.stable and model.calls == MAX_ROUNDS and warm.batch_s == 2.0
    slow = FakeModel([100.0, 50.0, 20.0, 10.0])
    assert len(warm_until_stable(slow.warm, slow.clock, budget_s=120).rounds_s) == 2  # 150 s spent: stop


def test_deadlines_derive_from_the_batch_time_unless_set() -> None:
    derived = derive_deadlines(Settings(backend="smollm2"), batch_s=1.5)
    assert (derived.slo_ms, derived.timeout_ms) == (4500, 15000)
    fast = derive_deadlines(Settings(backend="smollm2"), batch_s=0.01)  # never under the sim's defaults
    assert (fast.slo_ms, fast.timeout_ms) == (200, 2000)
    capped = derive_deadlines(Settings(backend="smollm2", max_timeout_ms=8000), batch_s=1.5)
    assert capped.timeout_ms == 8000
    chosen = derive_deadlines(Settings(backend="smollm2", given={"slo_ms": "--slo-ms",
                                                                "timeout_ms": "BATCHSERVE_TIMEOUT_MS"}), 1.5)
    assert (chosen.slo_ms, chosen.timeout_ms) == (None, None)


def test_the_sim_keeps_its_defaults(server_factory) -> None:
    server = server_factory()
    with server.client() as c:
        health = c.get("/internal/health").json()
    assert (health["slo_ms"], health["timeout_ms"]) == (200.0, 2000.0)
    assert "deadlines from the warm-up" not in server.log()


BATCH_MS = 3000


def test_a_batch_whose_callers_all_left_frees_its_worker(server_factory) -> None:
    server = server_factory("--devices", "1", "--sim-batch-ms", str(BATCH_MS), "--max-batch-size", "2",
                            "--slo-ms", "10000", "--timeout-ms", "20000", "--gpu-timeout-ms", "60000")
    stopped = 'batchserve_batches_stopped_early_total{model="sim@v1"}'

    def stopped_early() -> float:
        return metric(httpx.get(server.url + "/metrics").text, "batchserve_batches_stopped_early_total",
                      model="sim@v1")

    # A caller hangs up 0.5 s into a 3 s batch it has alone: the batch stops, and the next caller runs at once
    # instead of waiting for the rest of it (and for the pace it set).
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/inference", json={"input": "gone"}, timeout=0.5)
    time.sleep(0.5)
    with server.client() as c:
        after = c.post("/v1/inference", json={"input": "next"})
    assert after.status_code == 200 and after.json()["output"] == "txen"
    assert after.json()["queue_ms"] < BATCH_MS / 3, after.json()
    assert stopped_early() == 1, stopped

    # One caller of two leaves mid-batch: the other still waits, so the batch runs to its end.
    async def shared_batch() -> dict:
        async with aiohttp.ClientSession() as s:
            async def post(text: str, timeout: float | None) -> dict:
                async with s.post(server.url + "/v1/inference", json={"input": text},
                                  timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                    return await r.json()

            busy = asyncio.ensure_future(post("busy", None))  # holds the worker, so the next two queue together
            await asyncio.sleep(0.3)
            leaver = asyncio.ensure_future(post("leaver", BATCH_MS / 1000 + 0.7))
            stayer = asyncio.ensure_future(post("stayer", None))
            await busy
            with pytest.raises(asyncio.TimeoutError):
                await leaver
            return await stayer

    stayer = asyncio.run(shared_batch())
    assert stayer["output"] == "reyats" and stayer["batch_size"] == 2
    assert stayer["compute_ms"] >= BATCH_MS * 0.9, stayer
    assert stopped_early() == 1
