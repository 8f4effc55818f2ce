"""The gateway gauges (issue 26 item 4): `batchserve_num_requests_waiting` / `_running` per model move with real
load on a live server and fall back to 0; the KV-cache gauge is exported for a generation model (here from an
injected reading: the real engine needs the real model, tests/integration/generation/test_routes.py); the
collector in process is tests/unit/core/test_gateway_gauges.py."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.unit.core.test_gateway_gauges import gauges


def test_gauges_move_under_load(server_factory):
    """One device taking batches of at most 4 for 400 ms: 10 requests at once are 4 running and 6 waiting,
    then 4 and 2, then 2 and 0; once answered, 0 and 0."""
    server = server_factory(
        "--devices", "1", "--max-batch-size", "4", "--sim-batch-ms", "400", "--slo-ms", "5000", "--timeout-ms", "20000"
    )

    async def run() -> tuple[list[int], list[dict]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            assert gauges((await c.get("/metrics")).text) == {
                ("batchserve_num_requests_waiting", "sim@v1"): 0,
                ("batchserve_num_requests_running", "sim@v1"): 0,
            }
            tasks = [asyncio.create_task(c.post("/v1/inference", json={"input": f"g{i}"})) for i in range(10)]
            seen = []
            while not all(t.done() for t in tasks):
                seen.append(gauges((await c.get("/metrics")).text))
                await asyncio.sleep(0.05)
            return [(await t).status_code for t in tasks], seen

    statuses, seen = asyncio.run(run())
    assert statuses == [200] * 10
    running = [g[("batchserve_num_requests_running", "sim@v1")] for g in seen]
    waiting = [g[("batchserve_num_requests_waiting", "sim@v1")] for g in seen]
    assert max(running) == 4 and max(waiting) >= 2, (running, waiting)
    assert all(0 <= w + r <= 10 for w, r in zip(waiting, running))
    give_up = time.monotonic() + 5
    while True:
        after = gauges(httpx.get(server.url + "/metrics").text)
        if set(after.values()) == {0} or time.monotonic() > give_up:
            break
        time.sleep(0.05)
    assert set(after.values()) == {0}, after
