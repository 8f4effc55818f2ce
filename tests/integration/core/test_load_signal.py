"""The autoscaling signals a real server exports under load and past its ceiling (the arithmetic is
tests/unit/core/test_load_signal.py)."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from batchserve.core.load_signal import SATURATED


def gauge(metrics: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", metrics, re.M)
    assert m, f"{name} not exported"
    return float(m.group(1))


async def open_loop(url: str, rate: float, seconds: float) -> tuple[list[int], str, dict]:
    """Requests at fixed intervals whatever the answers (arrivals do not wait for the server); /metrics and
    /internal/health as the last request leaves (waiting for the answers first would let the average decay);
    the statuses."""
    async with httpx.AsyncClient(base_url=url, timeout=10, limits=httpx.Limits(max_connections=None)) as c:
        loop = asyncio.get_running_loop()
        start, tasks = loop.time(), []
        for i in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, start + i / rate - loop.time()))
            tasks.append(asyncio.create_task(c.post("/v1/inference", json={"input": f"load-{i}"})))
        metrics, health = (await c.get("/metrics")).text, (await c.get("/internal/health")).json()
        return [r.status_code for r in await asyncio.gather(*tasks)], metrics, health


def test_a_server_exports_its_load_ratio_under_load_and_past_its_ceiling(server_factory):
    # 1 device, batches of at most 2 taking 100 ms: a ceiling of 20 requests/s (little for the client to send).
    server = server_factory("--devices", "1", "--max-batch-size", "2", "--sim-batch-ms", "100", "--slo-ms", "300")
    with server.client() as c:
        idle = c.get("/metrics").text
        assert gauge(idle, "batchserve_load_ratio") == 0 and gauge(idle, "batchserve_predicted_wait_ratio") == 0
        # Half the ceiling, long enough for the ~2 s average (tau 2 s) to settle: 5 s reads 0.46 (6 s read 0.475).
        statuses, metrics, health = asyncio.run(open_loop(server.url, 10, 5))
        half = gauge(metrics, "batchserve_load_ratio")
        assert 0.35 <= half <= 0.65 and statuses.count(200) == len(statuses)
        assert health["load_ratio"] == pytest.approx(half, abs=0.1)
        assert 0 <= gauge(metrics, "batchserve_predicted_wait_ratio") < SATURATED
        assert 0 <= health["predicted_wait_ratio"] < SATURATED
        # 2.5 x the ceiling: from ~0.46, 3 s reads ~2.0, so past 1.0 even when a busy machine's client sends only
        # half its rate (1.5 x read 0.77 on a loaded CI runner).
        _, metrics, health = asyncio.run(open_loop(server.url, 50, 3))
        assert gauge(metrics, "batchserve_load_ratio") > 1.0 and health["load_ratio"] > 1.0
