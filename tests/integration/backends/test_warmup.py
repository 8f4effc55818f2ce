"""Defaults that fit the backend (issue 9 §3) on live servers: the sim keeps its defaults, and a batch whose callers
all left frees its worker (the warm-up arithmetic is tests/unit/backends/test_warmup.py)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import httpx
import pytest

from tests.integration.inference.test_routes import metric


def test_the_sim_keeps_its_defaults(server_factory) -> None:
    server = server_factory()
    with server.client() as c:
        health = c.get("/internal/health").json()
    assert (health["slo_ms"], health["timeout_ms"]) == ({"sim@v1": 200.0}, {"sim@v1": 2000.0})
    assert "deadlines of sim@v1: slo_ms=200 (default) timeout_ms=2000 (default)" in server.log()
    assert "from the warm-up batch time" not in server.log()


BATCH_MS = 2000  # long enough that a batch run to its end and one stopped early differ by seconds


def test_a_batch_whose_callers_all_left_frees_its_worker(server_factory) -> None:
    server = server_factory(
        "--devices",
        "1",
        "--sim-batch-ms",
        str(BATCH_MS),
        "--max-batch-size",
        "2",
        "--slo-ms",
        "10000",
        "--timeout-ms",
        "20000",
        "--gpu-timeout-ms",
        "60000",
    )
    stopped = 'batchserve_batches_stopped_early_total{model="sim@v1"}'

    def stopped_early() -> float:
        return metric(httpx.get(server.url + "/metrics").text, "batchserve_batches_stopped_early_total", model="sim@v1")

    # A caller hangs up 0.5 s into a 2 s batch it has alone: the batch stops, and the next caller runs at once
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
                async with s.post(
                    server.url + "/v1/inference", json={"input": text}, timeout=aiohttp.ClientTimeout(total=timeout)
                ) as r:
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
